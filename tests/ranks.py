"""The suite's rank processes: one `RankPool` for the whole session, so each multi-rank test starts
its process groups in ranks that have already imported torch, transformers and the project."""

from __future__ import annotations

import atexit

from hf_asyncpp.parallel.spawn import RankPool

POOL = RankPool()
atexit.register(POOL.close)


def run_ranks(world_size: int, target, *args, timeout_s: float = 600.0) -> list:
    """target(rank, world_size, *args) on ranks of the session's pool; results ordered by rank."""
    return POOL.run(world_size, target, *args, timeout_s=timeout_s)
