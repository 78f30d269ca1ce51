"""Schedule names → what each needs: stages per rank, their placement, and the action lists.

The asynchronous schedules join this registry with an `order` (an AsyncOrder: who holds which
weight version when); the engine and the config validation read only `ScheduleSpec`, never a class name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from ..torch_internals import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, REDUCE_GRAD, _Action

from .actions import ComputeActions, gpipe_actions, one_f_one_b_actions, torch_multi_stage_actions
from ..update.held import GlobalClipping
from .async_order import AsyncOrder, SegmentPrograms, StepBoundary, check_versions
from .pipedream import PIPEDREAM, PIPEDREAM_2BW
from .sync_start import SyncStart
from .comm_plan import Collective, HostWait, plan_program
from .errors import ScheduleError
from .play import Timeline
from .validate import check_program, check_schedule
from .wpipe import WPIPE

__all__ = ["MODEL_COSTS", "ScheduleSpec", "SCHEDULES", "get_schedule_spec", "model_cost", "register_schedule"]

# Asynchronous orders are checked over this many consecutive steps: the first, a middle and the last.
VALIDATION_STEPS = 3
# The timing model's default costs (validate.check_program): a backward takes two forwards, and a
# zero-bubble schedule's input and weight halves one each; nothing else takes time.
MODEL_COSTS = {FORWARD: 1.0, FULL_BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}


def model_cost(rank: int, action) -> float:
    return MODEL_COSTS.get(action.computation_type, 0.0)


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    description: str
    make_actions: Callable[[int, int], ComputeActions] | None  # (pp_size, n_microbatches) → per-rank lists
    stages_per_rank: int = 1
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": rank r holds r and 2p − 1 − r
    order: AsyncOrder | None = None  # asynchronous schedules: the continuous order and weight versions

    @property
    def synchronous(self) -> bool:
        return self.order is None

    def starting_synchronously(self, sync_steps: int) -> "ScheduleSpec":
        """This asynchronous schedule with its first `sync_steps` steps synchronous (sync_start.py)."""
        if not sync_steps:
            return self
        if self.order is None:
            raise ValueError(f"schedule '{self.name}' is synchronous: sync_steps applies to asynchronous ones")
        return replace(self, order=SyncStart(self.order, sync_steps))

    def n_stages(self, pp_size: int) -> int:
        return pp_size * self.stages_per_rank

    def step_boundary(self, pp_size: int, n_microbatches: int) -> StepBoundary:
        """Whether a run of this schedule on pp_size ranks can stop (a checkpoint, SIGTERM), be
        evaluated, or resume by replay between two steps. Always for a synchronous schedule (it
        flushes every step) and for the single-process emulator (pp_size 1: it holds nothing in
        flight between steps, and its kept weight versions are saved). An asynchronous order is
        answered at the boundary after its first asynchronous step (a sync start's steps flush): the
        ones after it hold the same units in flight, a step later (tests/schedules/test_boundaries.py)."""
        if self.order is None or pp_size == 1:
            return StepBoundary()
        return self.order.boundary_after(pp_size, n_microbatches, self.order.sync_steps)

    def stage_indices(self, pp_size: int, rank: int) -> list[int]:
        if self.placement == "v":
            return [rank, 2 * pp_size - 1 - rank]
        return [rank + k * pp_size for k in range(self.stages_per_rank)]

    def reads_tokens(self, pp_size: int, rank: int) -> bool:
        """Whether rank `rank` holds the first stage (token inputs) or the last (labels): the others
        never look at a token."""
        return bool({0, self.n_stages(pp_size) - 1} & set(self.stage_indices(pp_size, rank)))

    def actions(self, pp_size: int, n_microbatches: int, clip_globally: bool = False) -> ComputeActions:
        """The compute lists, checked in one process with the communication the runtime posts for
        them (validate.py); raises ScheduleError or ValueError.

        For an asynchronous schedule: VALIDATION_STEPS steps of its continuous order (global
        microbatch ids), each segment planned as its runtime plans it, and its weight versions;
        `clip_globally`: with its updates waiting for global gradient norms (update/held.GlobalClipping)."""
        if self.order is None:
            actions = self.make_actions(pp_size, n_microbatches)
            check_schedule(actions, pp_size, self.n_stages(pp_size), n_microbatches)
            return actions
        actions = self.order.stream(pp_size, n_microbatches, VALIDATION_STEPS)
        clipping = GlobalClipping(self.order, pp_size, n_microbatches) if clip_globally else None
        check_schedule(actions, pp_size, self.n_stages(pp_size), n_microbatches * VALIDATION_STEPS,
                       plan=partial(self.programs, pp_size, n_microbatches, VALIDATION_STEPS), clipping=clipping)
        check_versions(self.order, pp_size, n_microbatches, VALIDATION_STEPS)
        return actions

    def programs(self, pp_size: int, n_microbatches: int, n_steps: int, stage_to_rank) -> dict:
        """Every rank's program for n_steps steps of an asynchronous order, segment by segment as the
        runtime plans them, ending where `finish()` waits for the last sends."""
        n_stages = self.n_stages(pp_size)
        plan = SegmentPrograms(self.order, pp_size, n_microbatches, n_steps, stage_to_rank, n_stages)
        return {r: [e for k in range(n_steps) for e in plan.program(r, k)] + [None] for r in range(pp_size)}

    def stage_ranks(self, pp_size: int) -> dict[int, int]:
        """Stage → the rank that holds it, from `stage_indices`."""
        return {s: r for r in range(pp_size) for s in self.stage_indices(pp_size, r)}

    def rank_pairs(self, pp_size: int) -> list[tuple[int, int]]:
        """The pairs of pipeline ranks (lower first, sorted) that exchange activations and gradients:
        the ranks of each two consecutive stages, where they differ."""
        ranks = self.stage_ranks(pp_size)
        return sorted({tuple(sorted((ranks[s], ranks[s + 1]))) for s in range(self.n_stages(pp_size) - 1)
                       if ranks[s] != ranks[s + 1]})

    def timeline(self, pp_size: int, n_microbatches: int, n_steps: int, cost, clip_globally: bool = False,
                 streams: str = "pair", link_s: float = 0.0, transport: str = "nccl") -> Timeline:
        """n_steps steps played as a timing model (validate.check_program with `cost(rank, action)`
        seconds per action, `link_s` per message): synchronous schedules step after step, each flushed
        and ended by each stage's update (a REDUCE_GRAD action, what `cost` charges for the optimizer
        step) after, when clipping by the global norm, the norm's all-reduce over every rank; asynchronous
        ones as their runtime plans them (a stage's update is its REDUCE_GRAD), clipping by the global
        norm if `clip_globally`. `streams`: "pair" as the runtime posts on NCCL (a group per pair of
        ranks), "rank" for one group per pipeline; `transport`: how messages move, "nccl" or "gloo"
        (schedules/play.py)."""
        n_stages, to_rank = self.n_stages(pp_size), self.stage_ranks(pp_size).__getitem__
        clipping = None
        if self.order is None:
            step = plan_program(self.make_actions(pp_size, n_microbatches), to_rank, n_stages)
            norm = [Collective("default", frozenset(step)), HostWait("default")] if clip_globally else []
            program = {r: [e for _ in range(n_steps) for e in [*ops, None, *norm, *self._updates(pp_size, r)]]
                       for r, ops in step.items()}
        else:
            program = self.programs(pp_size, n_microbatches, n_steps, to_rank)
            clipping = GlobalClipping(self.order, pp_size, n_microbatches) if clip_globally else None
        return check_program(program, to_rank, n_stages, streams, clipping=clipping, cost=cost, link_s=link_s,
                             transport=transport)

    def _updates(self, pp_size: int, rank: int) -> list[_Action]:
        """A synchronous step's end on `rank`: each of its stages' update."""
        return [_Action(s, REDUCE_GRAD, None) for s in self.stage_indices(pp_size, rank)]

    def steady_step(self, pp_size: int, n_microbatches: int, cost=model_cost, clip_globally: bool = False,
                    streams: str = "pair", link_s: float = 0.0, transport: str = "nccl") -> tuple[float, float]:
        """(step, limit) once the pipeline is full, in the timing model: how much the makespan, and
        the busiest rank's compute, grow per step from 3 to 5 steps."""
        short, long = (self.timeline(pp_size, n_microbatches, n, cost, clip_globally, streams, link_s, transport)
                       for n in (3, 5))
        return (long.makespan - short.makespan) / 2, max(long.busy[r] - short.busy[r] for r in long.busy) / 2

    def flush_seconds(self, pp_size: int, n_microbatches: int, compute_s_by_rank: list[float]) -> float:
        """How much longer than its busiest rank computes one step of this synchronous schedule takes in
        the timing model, when rank r computes compute_s_by_rank[r] seconds a step, spread over its actions
        in MODEL_COSTS' proportions: the flush's bubble on stages of those costs, nothing else taking time."""
        if self.order is not None:
            raise ValueError(f"schedule '{self.name}' never flushes")
        modeled = self.timeline(pp_size, n_microbatches, 1, model_cost).busy
        scale = {rank: compute_s_by_rank[rank] / modeled[rank] for rank in modeled}
        step = self.timeline(pp_size, n_microbatches, 1, lambda rank, action: model_cost(rank, action) * scale[rank])
        return step.makespan - max(step.busy.values())

    def check_microbatches(self, pp_size: int, n_microbatches: int, clip_globally: bool = False) -> None:
        """Raise ValueError when this schedule cannot run n_microbatches on pp_size ranks (pipelined:
        `clip_globally` when its updates clip by the global norm)."""
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
        try:
            self.actions(pp_size, n_microbatches, clip_globally)
        except (ValueError, ScheduleError) as err:
            first_line = str(err).strip().splitlines()[0]
            raise ValueError(
                f"schedule '{self.name}' cannot run {n_microbatches} microbatches with pp_size {pp_size}: {first_line}"
            ) from None


SCHEDULES: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    SCHEDULES[spec.name] = spec
    return spec


def get_schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule '{name}'; available: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def _one_f_one_b(pp_size: int, n_microbatches: int) -> ComputeActions:
    if n_microbatches < pp_size:  # torch's Schedule1F1B refuses this too
        raise ValueError(f"1F1B needs at least as many microbatches as stages ({pp_size})")
    return one_f_one_b_actions(pp_size, n_microbatches)


register_schedule(ScheduleSpec("gpipe", "GPipe: all forwards, then all backwards; flush each step", gpipe_actions))
register_schedule(ScheduleSpec("1f1b", "1F1B: one forward, one backward in steady state; flush each step", _one_f_one_b))
register_schedule(
    ScheduleSpec(
        "interleaved-1f1b",
        "Interleaved 1F1B: two stages per rank (loop placement), depth-first; flush each step",
        partial(torch_multi_stage_actions, ScheduleInterleaved1F1B),
        stages_per_rank=2,
    )
)
register_schedule(
    ScheduleSpec(
        "zbv",
        "Zero-bubble V: two stages per rank in a V, backward split into input and weight parts",
        partial(torch_multi_stage_actions, ScheduleZBVZeroBubble),
        stages_per_rank=2,
        placement="v",
    )
)
register_schedule(
    ScheduleSpec(
        "pipedream-2bw",
        "PipeDream-2BW: 1F1B without flushes, two weight versions, every stage one step stale",
        None,
        order=PIPEDREAM_2BW,
    )
)
register_schedule(
    ScheduleSpec(
        "pipedream",
        "PipeDream: 1F1B without flushes, an update after every backward, stage r p-1-r updates stale",
        None,
        order=PIPEDREAM,
    )
)
register_schedule(
    ScheduleSpec(
        "wpipe",
        "WPipe: two stages per rank in two groups; the first half of the layers one step stale, the second fresh",
        None,
        stages_per_rank=2,
        order=WPIPE,
    )
)
