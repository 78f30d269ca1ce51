"""The suite's tiers (tests/conftest.py, docs/testing.md): a fast-tier test that needs what a slower tier
does fails at once, naming the marker; a marked test gets the session's rank pool."""

import multiprocessing
import subprocess
import sys

import pytest

from tests import ranks


def test_a_fast_tier_test_sees_no_rank_pool():
    assert ranks.pool is None
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.multirank"):
        ranks.run_ranks(1, print)


@pytest.mark.parametrize("argv", [[sys.executable, "-c", "pass"], ["torchrun", "--help"], ["bash", "run.sh"]])
def test_a_fast_tier_test_cannot_start_python(argv):
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.launch"):
        subprocess.run(argv)


def test_a_fast_tier_test_cannot_start_a_process():
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.launch"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_fast_tier_test_may_run_programs_that_are_not_python():
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0


@pytest.mark.multirank
def test_a_multi_rank_test_runs_on_the_session_pool(rank_pool):
    assert ranks.pool is rank_pool


def test_every_other_tier_is_a_declared_marker(pytestconfig):
    declared = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    assert {"multirank", "launch", "package", "repo"} <= declared
