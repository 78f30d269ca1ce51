"""A torch.profiler trace of chosen training steps, on every rank (`profile_steps`).

Each chosen step is recorded whole, with the host's operators and, on a GPU, its kernels and
streams, and written as a Chrome trace (chrome://tracing, ui.perfetto.dev) to
<output_dir>/profile/step<N>_rank<R>.json. The pipeline's runtime names each action of a rank's
program (`0F3`: stage 0's forward in chunk 3, the microbatch of a synchronous step, a slot of an
asynchronous one; `1SEND_B2`, ...), so the trace shows which compute overlaps which message. Only the chosen steps pay the profiler's cost.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["profiled_step", "trace_path"]


def trace_path(output_dir: str | Path, step: int, rank: int) -> Path:
    return Path(output_dir) / "profile" / f"step{step}_rank{rank}.json"


@contextlib.contextmanager
def profiled_step(step: int, steps: list[int], output_dir: str | Path, rank: int, on_gpu: bool):
    """Profile what runs inside when `step` is one of `steps`; write its trace after."""
    if step not in steps:
        yield None
        return
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = trace_path(output_dir, step, rank)
    with torch.profiler.profile(activities=activities) as profile:
        yield path
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.export_chrome_trace(str(path))
