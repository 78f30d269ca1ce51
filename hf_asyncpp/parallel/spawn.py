"""Run a function on N real ranks of this machine (spawned processes, gloo on CPU) and collect what
each returns: the tests' and benchmarks' way to start a small distributed job without a launcher."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue as queue_module
import signal
import time
import traceback

from .mesh import free_port

__all__ = ["run_ranks"]

def _worker(rank: int, world_size: int, port: int, queue, target, args):
    # The rest of the environment (HF_HUB_OFFLINE, …) is inherited from the parent.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks asks a stuck rank where it is
    try:
        import torch

        torch.set_num_threads(1)  # several ranks share the machine's cores
        queue.put((rank, "ok", target(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(world_size: int, target, *args, timeout_s: float = 600.0) -> list:
    """target(rank, world_size, *args) on each rank; returns results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, queue, target, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in procs:
            try:
                rank, status, value = queue.get(timeout=timeout_s)
            except queue_module.Empty:
                stuck = [r for r, p in enumerate(procs) if r not in results and p.is_alive()]
                for r in stuck:  # each prints every thread's Python stack to stderr
                    os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(3)
                errors.append(f"ranks {stuck} did not finish within {timeout_s:.0f} s; their stacks are on stderr")
                break
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
