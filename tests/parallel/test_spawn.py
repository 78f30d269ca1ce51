"""Rank processes for tests and benchmarks: fresh ones per run (`run_ranks`), or a `RankPool` whose
processes serve run after run. A reused rank must be indistinguishable from a fresh one, and a run
that fails must never leave a rank behind for the next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hf_asyncpp.parallel.spawn import RankPool, run_ranks

pytestmark = pytest.mark.launch  # each test starts rank processes of its own

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _disturb_then_report(rank, world_size, disturb: bool):
    """What a fresh process would show, after (optionally) changing all of it."""
    import os
    import signal

    import torch

    if disturb:
        os.environ["LEFT_BY_A_RUN"] = "1"
        os.chdir("/")
        torch.manual_seed(123)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(2)
        signal.signal(signal.SIGTERM, lambda *_: None)
    return dict(env="LEFT_BY_A_RUN" in os.environ, cwd=os.getcwd(), draw=torch.rand(3).tolist(),
                dtype=str(torch.get_default_dtype()), threads=torch.get_num_threads(),
                sigterm=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, rank=rank,
                rank_env=(os.environ["RANK"], os.environ["WORLD_SIZE"]))


def _all_reduce_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    init_parallel(read_launch(), 1)
    try:
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        return total.item()
    finally:
        shutdown_parallel()


def _fail_on_rank_one(rank, world_size):
    import time

    if rank == 1:
        raise ValueError("rank one refuses")
    time.sleep(60)  # as a rank waiting in a collective for the failed one would


def _die_on_rank_one(rank, world_size):
    import os
    import time

    if rank == 1:
        os._exit(3)  # as a crash or a kill would: no result, no traceback
    time.sleep(60)


def _leave_a_group(rank, world_size):
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel

    init_parallel(read_launch(), 1)
    return rank


def _hang(rank, world_size):
    import time

    time.sleep(600)


_KILLED_PARENT = """
import sys
from hf_asyncpp.parallel.spawn import RankPool
from tests.parallel.test_spawn import _all_reduce_rank
if __name__ == "__main__":
    pool = RankPool()
    pool.run(2, _all_reduce_rank)
    print(*pool.pids(), flush=True)
    sys.stdin.read()  # until killed
"""


@pytest.fixture(scope="module")
def pool():
    """One pool for the module's tests: each starts from whatever the one before left (ranks that
    served other runs, or none after a failure), as the suite's own pool (tests/ranks.py) does."""
    pool = RankPool()
    yield pool
    pool.close()


def test_a_reused_rank_starts_each_run_as_a_fresh_process_would(pool):
    fresh = run_ranks(2, _disturb_then_report, False)
    pool.run(2, _disturb_then_report, True)
    pids = pool.pids()
    reused = pool.run(2, _disturb_then_report, False)
    assert pool.pids() == pids  # the same processes served both runs
    # A fresh process's generator starts from a random seed: the reused one must not keep the run's.
    seeded_by_the_run = torch.Generator().manual_seed(123)
    assert reused[0]["draw"] != torch.rand(3, generator=seeded_by_the_run).tolist()
    for row in (*fresh, *reused):
        row.pop("draw")
    assert reused == fresh
    assert [r["rank_env"] for r in reused] == [("0", "2"), ("1", "2")]


def test_each_run_starts_its_own_process_groups_in_the_same_ranks(pool):
    assert pool.run(2, _all_reduce_rank) == [1.0, 1.0]
    pids = pool.pids()
    assert pool.run(2, _all_reduce_rank) == [1.0, 1.0]
    assert pool.pids() == pids


def test_a_failed_run_names_its_rank_and_retires_every_process(pool):
    pool.run(2, _all_reduce_rank)
    before = pool.pids()
    with pytest.raises(AssertionError, match=r"(?s)rank 1:.*ValueError: rank one refuses"):
        pool.run(2, _fail_on_rank_one)
    assert pool.pids() == []  # rank 0, still sleeping, was killed with the rest
    assert pool.run(2, _all_reduce_rank) == [1.0, 1.0]
    assert set(pool.pids()).isdisjoint(before)


def test_a_rank_that_dies_without_a_result_ends_the_run_at_once(pool):
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks 1 \(exit code 3\) died without a result"):
        pool.run(2, _die_on_rank_one)
    assert time.monotonic() - started < 30  # not the run's 600 s timeout
    assert pool.pids() == []
    assert pool.run(2, _all_reduce_rank) == [1.0, 1.0]


def test_a_rank_left_holding_a_process_group_is_replaced(pool):
    assert pool.run(2, _leave_a_group) == [0, 1]
    before = pool.pids()
    assert pool.run(2, _all_reduce_rank) == [1.0, 1.0]
    assert set(pool.pids()).isdisjoint(before)


def test_a_run_the_caller_interrupts_retires_every_process(pool):
    """A test runner's timeout or ^C raises in the caller while the ranks still run: the next run
    must not be queued behind them."""
    pool.run(2, _disturb_then_report, False)
    previous = signal.signal(signal.SIGALRM, _interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(TimeoutError):
            pool.run(2, _hang)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert pool.pids() == []
    assert pool.run(2, _all_reduce_rank) == [1.0, 1.0]


def _interrupt(signum, frame):
    raise TimeoutError("interrupted by the caller")


def test_a_run_that_does_not_finish_in_time_names_the_stuck_ranks(pool, capfd):
    pool.close()  # ranks started under capfd write their stacks where it reads them
    pool.run(2, _disturb_then_report, False)  # started: the hang, not the start-up, outlasts the timeout
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] did not finish within 5 s"):
        pool.run(2, _hang, timeout_s=5)
    assert "_hang" in capfd.readouterr().err  # each stuck rank printed its stack
    assert pool.pids() == []


@pytest.mark.launch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_do_not_outlive_a_killed_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_KILLED_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited, awaiting its (dead) parent
    except FileNotFoundError:
        return False
