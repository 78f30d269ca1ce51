"""Build the torch runtime that executes a registered schedule on this rank's stages."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from .registry import ScheduleSpec

__all__ = ["ActionListSchedule", "build_schedule"]


class ActionListSchedule(_PipelineScheduleRuntime):
    """torch's action-list runtime fed with our checked compute lists (comms added by torch)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, actions, spec: ScheduleSpec):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
        self.spec = spec
        self.pipeline_order = actions
        self._prepare_schedule_with_comms(actions)


def build_schedule(spec: ScheduleSpec, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable):
    pp_size = stages[0].group_size
    return ActionListSchedule(stages, n_microbatches, loss_fn, spec.actions(pp_size, n_microbatches), spec)
