"""The suite's rank processes: one `RankPool` for the whole session (conftest's session fixture
`rank_pool` opens it for the tests of the multi-rank tier and closes it when the session ends), so each
multi-rank test starts its process groups in ranks that have already imported torch, transformers and
the project; and `train_py`, train.py's main on ranks of that pool, for the reference runs tests
compare with."""

from __future__ import annotations

from hf_asyncpp.parallel.spawn import RankPool

# The pool the running test may use: the session's, set by conftest for a multi-rank test only.
pool: RankPool | None = None


def run_ranks(world_size: int, target, *args, timeout_s: float = 600.0) -> list:
    """target(rank, world_size, *args) on ranks of the session's pool; results ordered by rank."""
    if pool is None:
        raise RuntimeError("this test runs on the rank pool: mark it @pytest.mark.multirank (docs/testing.md)")
    return pool.run(world_size, target, *args, timeout_s=timeout_s)


def _train_py_main(rank, world_size, argv, log_dir):
    """training_scripts/train.py's main(argv) on this rank, its stdout and stderr (file descriptors 1
    and 2, so every writer's) in log_dir/rank{rank}.out and .err; (exit status, the stderr)."""
    import os
    import sys

    from hf_asyncpp.run import main

    paths = [os.path.join(log_dir, f"rank{rank}.{kind}") for kind in ("out", "err")]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, path in zip((1, 2), paths):
        with open(path, "w") as log:
            os.dup2(log.fileno(), fd)
    try:
        code = main(list(argv))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    with open(paths[1]) as log:
        return code, log.read()


def train_py(world_size: int, argv: list[str], log_dir) -> list[tuple[int, str]]:
    """train.py's main(argv) on `world_size` ranks of the session's pool, which set RANK, WORLD_SIZE,
    LOCAL_RANK and MASTER_ADDR/PORT as torchrun does (without its import of torch and the project in
    every rank): [(exit status, stderr)] by rank. For the reference runs that tests compare launched
    runs with; what a launcher itself does (restarts, its report, signals) needs torchrun."""
    import os

    os.makedirs(log_dir, exist_ok=True)
    return run_ranks(world_size, _train_py_main, list(argv), str(log_dir))
