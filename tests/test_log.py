"""The `hf_asyncpp` logger says a run's news once per launch: rank 0 from INFO up, every other rank only
warnings and errors (transformers' default for replicas), as `[hf_asyncpp] ...` lines on stderr."""

from __future__ import annotations

import logging

import pytest

from hf_asyncpp.log import get_logger


@pytest.mark.parametrize("rank, shown", [(None, ["info", "warning"]), ("0", ["info", "warning"]), ("1", ["warning"])])
def test_rank_zero_says_everything_the_other_ranks_only_warnings(rank, shown, monkeypatch, capsys):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)  # one process, no launcher
    else:
        monkeypatch.setenv("RANK", rank)
    logger = get_logger("hf_asyncpp.some_module")
    logger.info("info")
    logger.warning("warning")
    captured = capsys.readouterr()
    expected = {"info": "[hf_asyncpp] info", "warning": "[hf_asyncpp] warning: warning"}
    assert captured.err.splitlines() == [expected[name] for name in shown] and captured.out == ""


def test_its_level_is_the_users_to_set(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    logger, library = get_logger("hf_asyncpp.some_module"), logging.getLogger("hf_asyncpp")
    library.setLevel(logging.WARNING)
    try:
        logger.info("not shown")
    finally:
        library.setLevel(logging.INFO)
    logger.info("shown")
    assert capsys.readouterr().err == "[hf_asyncpp] shown\n"
