"""One executor per kind of run, behind one interface (base.Executor), chosen once at start-up:

- `SynchronousPipeline` (synchronous.py): a pipeline of pp ranks whose every step flushes;
- `AsynchronousPipeline` (asynchronous.py): a pipeline whose stages update when the order says, on
  stashed weight versions (each stage's update owned by a `StageUpdate`, update/stage.py);
- `EmulatedRun` (emulated.py): an asynchronous schedule's update rule on one rank, no pipeline.
"""

from __future__ import annotations

from .asynchronous import AsynchronousPipeline
from .base import Executor, StepOutcome, build_full_model
from .emulated import EmulatedRun
from .synchronous import SynchronousPipeline

__all__ = ["AsynchronousPipeline", "EmulatedRun", "Executor", "StepOutcome", "SynchronousPipeline", "build_full_model",
           "executor_class"]


def executor_class(spec, layout) -> type[Executor]:
    """The kind of run: a synchronous schedule runs as a pipeline (of one rank, too); an asynchronous one
    as a pipeline on pp > 1 ranks, emulated on one."""
    if spec.order is None:
        return SynchronousPipeline
    return AsynchronousPipeline if layout.pp_size > 1 else EmulatedRun
