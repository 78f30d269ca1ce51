"""Per-rank compute action lists (`_Action` from torch.distributed.pipelining) for each schedule.

A schedule is data: `{rank: [action or None, ...]}` with actions such as `0F3` (stage 0 forward of
microbatch 3) or `1B0`. torch's runtime lowers such a list (adding sends, receives and gradient
reduction) and executes it, so what is validated in one process is exactly what runs.

GPipe and 1F1B are generated here in the order torch's ScheduleGPipe / Schedule1F1B execute them.
(torch 2.13's Schedule1F1B exposes an action list that is off by one on the last rank, so its own
listing cannot serve as the data; its `_step_microbatches` order is what we reproduce.) The
multi-stage schedules (Interleaved1F1B, ZBV) take torch's own lists, built without any process group.
"""

from __future__ import annotations

from unittest import mock

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from ..torch_internals import FORWARD, FULL_BACKWARD, _Action

__all__ = ["ComputeActions", "gpipe_actions", "one_f_one_b_actions", "torch_multi_stage_actions"]

ComputeActions = dict[int, list["_Action | None"]]


def gpipe_actions(pp_size: int, n_microbatches: int) -> ComputeActions:
    """All forwards, then all backwards, one stage per rank."""
    return {
        r: [_Action(r, FORWARD, i) for i in range(n_microbatches)]
        + [_Action(r, FULL_BACKWARD, i) for i in range(n_microbatches)]
        for r in range(pp_size)
    }


def one_f_one_b_actions(pp_size: int, n_microbatches: int) -> ComputeActions:
    """Warm-up of min(m, p − r) forwards on rank r, then one backward per forward, then drain."""
    actions: ComputeActions = {}
    for r in range(pp_size):
        warmup = min(n_microbatches, pp_size - r)
        ops = [_Action(r, FORWARD, i) for i in range(warmup)]
        for i in range(n_microbatches):
            ops.append(_Action(r, FULL_BACKWARD, i))
            if warmup + i < n_microbatches:
                ops.append(_Action(r, FORWARD, warmup + i))
        actions[r] = ops
    return actions


def _mock_stages(pp_size: int, stages_per_rank: int, rank: int):
    stages = []
    for local in range(stages_per_rank):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size = rank, pp_size
        stage.num_stages = pp_size * stages_per_rank
        stage.stage_index = local  # only read for bookkeeping; the order depends on rank and sizes
        stage.submod = None
        stages.append(stage)
    return stages


def torch_multi_stage_actions(schedule_class: type, pp_size: int, n_microbatches: int) -> ComputeActions:
    """torch's own compute order for a multi-stage schedule, without a process group."""
    if schedule_class not in (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble):
        raise TypeError(f"{schedule_class.__name__} is not a multi-stage schedule class")
    schedule = schedule_class(_mock_stages(pp_size, 2, 0), n_microbatches)
    return {r: list(ops) for r, ops in schedule.pipeline_order.items()}
