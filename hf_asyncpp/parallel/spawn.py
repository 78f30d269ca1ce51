"""Run a function on N real ranks of this machine (spawned processes, gloo on CPU) and collect what
each returns: the tests' and benchmarks' way to start a small distributed job without a launcher.

`run_ranks` starts fresh processes for one run (benchmarks measure memory and start-up that way).
A `RankPool` keeps its processes between runs: a test suite of dozens of multi-rank runs otherwise
spends most of its time importing torch and transformers again in every rank. Each run still starts
its own process groups; between runs a rank is put back to the state a fresh process has (below,
`_ProcessState`), and a run that fails or times out retires every process of the pool, so no run
inherits a broken group or a rank stuck in a collective. A target must tear down the process groups
it starts (`shutdown_parallel`) and undo what it patches; a rank left with a group is replaced.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler

from .mesh import free_port

__all__ = ["RankPool", "run_ranks"]

_RESET_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what resilience.py's handlers take over


class _ProcessState:
    """What a run may change in its process and a fresh rank starts with: environment, working
    directory, torch's default RNG seed, default dtype, grad mode and thread count, signal handlers."""

    def __init__(self):
        import torch

        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.seed = torch.initial_seed()  # a fresh process's default generator state
        self.handlers = {s: signal.getsignal(s) for s in _RESET_SIGNALS}

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.manual_seed(self.seed)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)  # several ranks share the machine's cores
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        gc.collect()


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the thread that started it ends (a test runner killed
    mid-run would otherwise leave its pool's ranks behind, holding their ports and memory)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _serve(tasks, results) -> None:
    """A rank process: run each task from `tasks` until None arrives (or its run left a group)."""
    _die_with_parent()
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) prints where every thread was
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool asks a stuck rank where it is
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fresh = _ProcessState()
    while (task := tasks.get()) is not None:
        rank, world_size, port, target, args = task
        # The rest of the environment (HF_HUB_OFFLINE, …) is inherited from the parent.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        try:
            # Pickled here rather than by the queue, whose feeder thread would drop a reply it fails to
            # pickle: the parent would never hear of it. The queue then only moves these bytes.
            reply = (rank, "ok", bytes(ForkingPickler.dumps(target(rank, world_size, *args))))
        except BaseException:  # report everything, including assertion errors, to the parent
            reply = (rank, "error", traceback.format_exc())
        left_a_group = dist.is_initialized()
        results.put((*reply, not left_a_group))
        if left_a_group:
            return  # a group outliving its run would meet the next run's: the pool replaces this rank
        fresh.restore()


class RankPool:
    """Rank processes reused from one `run` to the next (see the module's docstring)."""

    def __init__(self):
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._tasks: list = []
        self._results = None

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _ensure(self, world_size: int) -> None:
        if self._results is None:
            self._results = self._ctx.Queue()
        for rank in range(world_size):  # the process at index r always runs rank r
            if rank < len(self._procs) and self._procs[rank].is_alive():
                continue
            tasks = self._ctx.Queue()
            proc = self._ctx.Process(target=_serve, args=(tasks, self._results), daemon=True)
            proc.start()
            if rank < len(self._procs):
                self._procs[rank], self._tasks[rank] = proc, tasks
            else:
                self._procs.append(proc)
                self._tasks.append(tasks)

    def run(self, world_size: int, target, *args, timeout_s: float = 600.0) -> list:
        """target(rank, world_size, *args) on ranks 0..world_size−1; returns results ordered by rank.
        Raises AssertionError with the failing rank's traceback, or naming the ranks that did not
        finish within `timeout_s` (their stacks go to stderr)."""
        self._ensure(world_size)
        port = free_port()
        for rank in range(world_size):
            self._tasks[rank].put((rank, world_size, port, target, args))
        try:
            return self._collect(world_size, timeout_s)
        except BaseException:  # a failed rank, a timeout, or the caller interrupted (^C, a test timeout)
            self.close(graceful=False)  # ranks may still run this task, or be stuck in a collective
            raise

    def _collect(self, world_size: int, timeout_s: float) -> list:
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size:
            try:  # short waits: a rank that dies without a result (a crash, a kill) ends the run at once
                rank, status, value, reusable = self._results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue_module.Empty:
                missing = [r for r in range(world_size) if r not in results]
                if any(not self._procs[r].is_alive() for r in missing):
                    try:  # a result its rank put just before exiting may still be on its way
                        rank, status, value, reusable = self._results.get(timeout=2)
                    except queue_module.Empty:
                        dead = [f"{r} (exit code {self._procs[r].exitcode})" for r in missing
                                if not self._procs[r].is_alive()]
                        raise AssertionError(f"ranks {', '.join(dead)} died without a result; their output is "
                                             "on stderr") from None
                elif time.monotonic() < deadline:
                    continue
                else:
                    for r in missing:  # each prints every thread's Python stack to stderr
                        os.kill(self._procs[r].pid, signal.SIGUSR1)
                    time.sleep(3)
                    raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s; their stacks "
                                         "are on stderr") from None
            if status != "ok":
                raise AssertionError(f"rank {rank}:\n{value}")
            results[rank] = ForkingPickler.loads(value)
            if not reusable:
                self._procs[rank].join(timeout=30)
        return [results[r] for r in range(world_size)]

    def close(self, graceful: bool = True) -> None:
        """Stop every rank process: let idle ones exit (`graceful`), kill the rest."""
        if graceful:
            for proc, tasks in zip(self._procs, self._tasks):
                if proc.is_alive():
                    tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=30 if graceful else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._tasks, self._results = [], [], None


def run_ranks(world_size: int, target, *args, timeout_s: float = 600.0) -> list:
    """target(rank, world_size, *args) on each of `world_size` fresh processes; results by rank."""
    pool = RankPool()
    try:
        return pool.run(world_size, target, *args, timeout_s=timeout_s)
    finally:
        pool.close()
