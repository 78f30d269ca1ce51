"""Build the torch runtime that executes a registered schedule on this rank's stages."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action, _add_unshard_reshard, _PipelineScheduleRuntime

from .registry import ScheduleSpec
from .validate import lower_with_comms

__all__ = ["ActionListSchedule", "build_eval_schedule", "build_schedule"]


class ActionListSchedule(_PipelineScheduleRuntime):
    """torch's action-list runtime fed with our checked compute lists (comms added by torch).

    `eval()` (forward only, e.g. validation loss or logits) runs the same lists with every backward
    removed: each rank keeps its forwards in the training order, so the lowered program stays
    deadlock-free, and the stages are the same objects, so torch's train ↔ eval switch applies.
    Sharded stages get torch's UNSHARD / RESHARD actions around their compute, as in training.
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, actions,
                 spec: ScheduleSpec | None):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
        self.spec = spec
        self.pipeline_order = actions
        self._prepare_schedule_with_comms(actions)
        self._train_order = self.pipeline_order_with_comms
        # FSDP stages (parallel/fsdp.py) are gathered before their first forward and released after.
        forward_only = {r: _add_unshard_reshard([a for a in ops if a is not None and a.computation_type == FORWARD])
                        for r, ops in actions.items()}
        self._eval_order = lower_with_comms(forward_only, self.stage_index_to_group_rank.__getitem__, self._num_stages)

    def _step_microbatches(self, *args, **kwargs):
        self.pipeline_order_with_comms = self._train_order if self._has_backward else self._eval_order
        return super()._step_microbatches(*args, **kwargs)


def build_schedule(spec: ScheduleSpec, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable):
    pp_size = stages[0].group_size
    return ActionListSchedule(stages, n_microbatches, loss_fn, spec.actions(pp_size, n_microbatches), spec)


def build_eval_schedule(stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable) -> ActionListSchedule:
    """A forward-only program (GPipe order: each rank forwards its stages in index order, all
    microbatches of one before the next) for stages placed in a loop, stage s on rank s mod pp.

    Asynchronous pipelines evaluate through it: their training runtime never finishes a step with an
    empty pipeline, so evaluation runs beside it, on its own PipelineStage objects, with untagged
    messages that cannot match the training runtime's tagged ones (async_runtime.py)."""
    pp_size, n_stages = stages[0].group_size, stages[0].num_stages
    local = {r: list(range(r, n_stages, pp_size)) for r in range(pp_size)}
    # torch checks a full training order; its backwards (GPipe's, reversed) are never run.
    actions = {r: [_Action(s, FORWARD, j) for s in local[r] for j in range(n_microbatches)]
               + [_Action(s, FULL_BACKWARD, j) for s in reversed(local[r]) for j in range(n_microbatches)]
               for r in range(pp_size)}
    return ActionListSchedule(stages, n_microbatches, loss_fn, actions, None)
