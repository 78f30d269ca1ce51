"""What an asynchronous schedule is, as data: a per-rank continuous order cut into per-step
segments, when each stage updates, and the weight version each microbatch is bound to.

An asynchronous schedule never flushes: the actions of one optimizer step on a rank (its segment)
may forward microbatches of the next minibatch, whose backward comes in the next segment. Actions
use global microbatch ids j = k·m + i; the runtime maps them to torch's per-stage chunk slots
j mod n_slots (`held_spans`: the fewest the order's plays allow). A stage updates after the backward of each minibatch's last microbatch, or after every
backward; the new weights are version v = number of the stage's updates so far, held in buffer
v mod n_buffers.
`stream` concatenates the segments of n_steps steps; `SegmentPrograms` plans each segment's
communication (comm_plan.py) on one rank, which is what the runtime executes and what one-process
validation plays for every rank (validate.check_program), together with `check_versions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..torch_internals import FORWARD, REDUCE_GRAD, _Action

from .comm_plan import CommPlanner, P2PBatch
from .errors import ScheduleError

__all__ = ["AsyncOrder", "SegmentPrograms", "StepBoundary", "check_versions", "held_spans", "replay_after"]


@dataclass(frozen=True)
class StepBoundary:
    """Whether a run can stop (a checkpoint, SIGTERM), be evaluated, or resume by replay between two
    steps: only when every update unit begun is applied there on all stages or on none. A unit
    applied on some stages only (`straddling_units`, e.g. WPipe's) would have evaluated weights mix two
    minibatches' updates, and a replay apply part of its gradient twice; `reason` says so."""
    straddling_units: tuple[int, ...] = ()
    reason: str = ""

    @property
    def clean(self) -> bool:
        return not self.straddling_units


class AsyncOrder:
    name: str
    per_microbatch_updates: bool = False  # True: a stage updates after each backward, else once per step
    sync_steps: int = 0  # the first steps, run synchronously (a sync start, schedules/sync_start.py)

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        """Rank `rank`'s actions (all its stages) between step `step`'s start and the next step's."""
        raise NotImplementedError

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        """Updates between the version a gradient is taken at and the weights it is applied to."""
        raise NotImplementedError

    def delay_at(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        """The delay of microbatch j's gradient (the order's delay, 0 in a sync start's steps)."""
        return self.delay(stage, pp_size, n_microbatches)

    def first_version(self, j: int, n_microbatches: int) -> int:
        """The version the delayed rule counts from for microbatch j: 0, or where a sync start ends."""
        return 0

    def synchronous_step(self, step: int) -> bool:
        """Whether step `step` runs synchronously (a sync start's first steps)."""
        return step < self.sync_steps

    def n_buffers(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        """Weight version buffers the stage keeps (the versions in-flight microbatches still need)."""
        return self.delay(stage, pp_size, n_microbatches) + 1

    def unit(self, j: int, n_microbatches: int) -> int:
        """The update unit microbatch j belongs to: its minibatch, or itself with per-microbatch updates."""
        return j if self.per_microbatch_updates else j // n_microbatches

    def updates_after(self, action: _Action, n_microbatches: int) -> bool:
        """Whether the stage updates right after this action: a backward that ends its update unit."""
        return action.computation_type != FORWARD and (
            self.per_microbatch_updates or action.microbatch_index % n_microbatches == n_microbatches - 1)

    def version(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        """The weight version microbatch j runs on (forward and backward): its unit − delay, from 0."""
        return max(self.unit(j, n_microbatches) - self.delay(stage, pp_size, n_microbatches), 0)

    def n_slots(self, pp_size: int, n_microbatches: int) -> int:
        """torch's chunk ids per stage, each with a receive buffer per direction: microbatch j uses
        j mod n_slots. The smallest count valid for every play of the order: the largest span of
        microbatch ids a stage holds at once (`held_spans`)."""
        return max(held_spans(self, pp_size, n_microbatches).values())

    def span_plays(self, pp_size: int, n_microbatches: int) -> tuple["AsyncOrder", int, list[int]]:
        """What `held_spans` plays: (an order whose plays hold what this one's do, its steps, the steps
        it resumes at). Steps 0 (warm-up), 1…3 (steady: each segment is the one before shifted by m,
        so from a repeated state on, every step repeats) and 4 (a drain: an early stop's last step is
        that of a run of its length); resumed after steps 1 and 2 (a replay)."""
        return self, 5, [2, 3]

    def boundary_after(self, pp_size: int, n_microbatches: int, step: int) -> StepBoundary:
        """Whether a run that goes on past step `step` can stop or resume between it and the next."""
        played = _played_through(self, pp_size, n_microbatches, step, step + 2)
        return _units_applied(self, played, n_microbatches, step)[1]

    def cache_key(self) -> tuple:
        """What identifies the order's plays (for `held_spans`'s cache)."""
        return (type(self).__name__, self.name)

    def buffer(self, stage: int, pp_size: int, version: int, n_microbatches: int) -> int:
        return version % self.n_buffers(stage, pp_size, n_microbatches)

    def stream(self, pp_size: int, n_microbatches: int, n_steps: int) -> dict[int, list[_Action]]:
        return {
            r: [a for k in range(n_steps) for a in self.segment(r, pp_size, n_microbatches, k, n_steps)]
            for r in range(pp_size)
        }


def check_versions(order: AsyncOrder, pp_size: int, n_microbatches: int, n_steps: int) -> None:
    """Play each rank's order with its updates (after every backward, or after the backward of a
    minibatch's last microbatch): every microbatch runs, forward and backward, on a version that
    exists and is still held; an update never overwrites a buffer that a microbatch waiting for its
    backward is bound to; a gradient is taken at weights exactly `delay` updates old (fewer only at
    the start)."""
    m = n_microbatches
    for rank, ops in order.stream(pp_size, m, n_steps).items():
        updates: dict[int, int] = {}  # stage → updates applied
        bound: dict[tuple[int, int], int] = {}  # (stage, in-flight microbatch) → version
        for action in ops:
            stage, j = action.stage_index, action.microbatch_index
            done, delay = updates.get(stage, 0), order.delay_at(stage, pp_size, j, m)
            n_buffers = order.n_buffers(stage, pp_size, m)
            version = order.version(stage, pp_size, j, m)
            where = f"rank {rank}, stage {stage}"
            if action.computation_type == FORWARD:
                if not done - n_buffers < version <= done:
                    raise ScheduleError(
                        f"{where}: microbatch {j} needs version {version}, but after {done} updates only versions "
                        f"{max(done - n_buffers + 1, 0)}..{done} are held"
                    )
                bound[(stage, j)] = version
                continue
            if bound.pop((stage, j), None) != version:
                raise ScheduleError(f"{where}: backward of {j} is not on its forward's version")
            if done - version > delay or (version > order.first_version(j, m) and done - version != delay):
                raise ScheduleError(f"{where}: the gradient of {j} is {done - version} updates old, not {delay}")
            if order.updates_after(action, m):
                updates[stage] = done + 1
                written = order.buffer(stage, pp_size, done + 1, m)
                clash = sorted(i for (s, i), v in bound.items() if s == stage and order.buffer(s, pp_size, v, m) == written)
                if clash:
                    raise ScheduleError(
                        f"{where}: update {done + 1} overwrites buffer {written} while microbatches {clash} wait "
                        "for their backward"
                    )


_SPANS: dict[tuple, dict[str, int]] = {}


def held_spans(order: AsyncOrder, pp_size: int, n_microbatches: int) -> dict[str, int]:
    """The largest span (max − min + 1) of the microbatch ids a stage holds at once, over all stages,
    per kind (comm_plan.CommPlanner: "chunk", and the "activation" and "gradient" receive buffers),
    in the plays the runtime can make: from the start, run to an end (drain), and resumed by replay.
    Two ids held together differ by less than the span, so j mod n never gives them the same index
    when n ≥ the span, whichever the residues and however long the run: a count of the span is
    valid, and one fewer is not (the two ids at the ends of the widest span would share an index).
    Computed once per (order, pp_size, m)."""
    key = (order.cache_key(), pp_size, n_microbatches)
    if key not in _SPANS:
        played, n_steps, resumes = order.span_plays(pp_size, n_microbatches)
        spans: dict[str, int] = {}
        for start in [0, *resumes]:
            replay = None
            if start:
                if not played.boundary_after(pp_size, n_microbatches, start - 1).clean:
                    continue  # an order that cannot resume there (WPipe) never replays
                replay = replay_after(played, pp_size, n_microbatches, start - 1, n_steps)
            plan = SegmentPrograms(played, pp_size, n_microbatches, n_steps, start_step=start, replay=replay,
                                   keep=[], n_slots=None, **_placement(played, pp_size, n_microbatches))
            for k in range(start, n_steps):
                plan.program(0, k)
            for (_, kind), span in plan.spans.items():
                spans[kind] = max(spans.get(kind, 0), span)
        _SPANS[key] = spans
    return dict(_SPANS[key])


def _placement(order: AsyncOrder, pp_size: int, n_microbatches: int) -> dict:
    """The stages each rank runs, from the order itself: stage_to_rank and n_stages."""
    ranks = {a.stage_index: r for r in range(pp_size) for a in order.segment(r, pp_size, n_microbatches, 0, 1)}
    return {"stage_to_rank": ranks.__getitem__, "n_stages": len(ranks)}


def replay_after(order: AsyncOrder, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> dict[int, list[_Action]]:
    """Per rank, what a run resumed after `step` (steps 0..step done) re-executes, in its original
    order, before step `step + 1`'s segment: every action of an update unit that no stage has
    updated yet. Forwards rebuild in-flight activations (and resend pending activations, because
    the peer replays its side too), backwards rebuild pending gradient sums; all are deterministic
    functions of the saved weight versions and the data, so the resumed run continues the same
    trajectory without saving activations or messages.

    Raises ScheduleError when the run cannot resume there (`AsyncOrder.boundary_after`, e.g. WPipe):
    replaying a unit applied on some stages would apply part of its gradient twice."""
    m = n_microbatches
    before = _played_through(order, pp_size, m, step, n_steps)
    finished, boundary = _units_applied(order, before, m, step)
    if not boundary.clean:
        raise ScheduleError(boundary.reason)
    return {r: [a for a in ops if order.unit(a.microbatch_index, m) not in finished] for r, ops in before.items()}


def _played_through(order: AsyncOrder, pp_size: int, n_microbatches: int, step: int,
                    n_steps: int) -> dict[int, list[_Action]]:
    """Per rank, its actions of steps 0..step in a run of n_steps steps."""
    return {r: [a for k in range(step + 1) for a in order.segment(r, pp_size, n_microbatches, k, n_steps)]
            for r in range(pp_size)}


def _units_applied(order: AsyncOrder, played: dict[int, list[_Action]], n_microbatches: int,
                   step: int) -> tuple[set[int], StepBoundary]:
    """After `played` (`_played_through` step `step`): the update units every stage has applied, and
    the boundary there, with the units begun that some stages have applied and others not."""
    m = n_microbatches
    stages = {a.stage_index for ops in played.values() for a in ops}
    updated = {(a.stage_index, order.unit(a.microbatch_index, m)) for ops in played.values() for a in ops
               if order.updates_after(a, m)}
    started = {order.unit(a.microbatch_index, m) for ops in played.values() for a in ops}
    finished = {u for u in started if all((s, u) in updated for s in stages)}
    straddling = sorted({u for _, u in updated} - finished)
    if not straddling:
        return finished, StepBoundary()
    return finished, StepBoundary(tuple(straddling), (
        f"{order.name}: after step {step}, update unit(s) {straddling} are applied on some stages but not on "
        "others; a run cannot resume at this step boundary by replay"))


class SegmentPrograms:
    """The programs of an asynchronous run, one step (segment) at a time, for the ranks in `keep`.

    Every rank plays all ranks' continuous orders (comm_plan.CommPlanner), generated lazily: what a
    rank replays after a resume (`replay`, per rank) ahead of its segment of `start_step`, then its
    segments, each backward that ends an update unit followed by the stage's update (a REDUCE_GRAD
    action naming that microbatch: the dp reduction and optimizer step, after the gradient has been
    sent on). `n_steps` may be lowered between steps (an early stop): the segments not yet played are
    then generated anew for the new last step."""

    def __init__(self, order: AsyncOrder, pp_size: int, n_microbatches: int, n_steps: int, stage_to_rank,
                 n_stages: int, start_step: int = 0, replay: dict[int, list[_Action]] | None = None, keep=None,
                 n_slots: int | None | str = "order"):
        self.order, self.pp_size, self.m = order, pp_size, n_microbatches
        self._n_steps, self._start, self._replay = n_steps, start_step, replay or {}
        self._cursor: dict[int, tuple[int, int]] = {}  # rank → (step, index) of its next, unplaced action
        if n_slots == "order":
            n_slots = order.n_slots(pp_size, n_microbatches)
        self._planner = CommPlanner(range(pp_size), self._actions_of, stage_to_rank, n_stages, n_slots, keep)

    def _step_actions(self, rank: int, step: int) -> list[_Action]:
        actions = self._replay.get(rank, []) if step == self._start else []
        with_updates = []
        for action in actions + self.order.segment(rank, self.pp_size, self.m, step, self._n_steps):
            with_updates.append(action)
            if self.order.updates_after(action, self.m):
                with_updates.append(_Action(action.stage_index, REDUCE_GRAD, action.microbatch_index))
        return with_updates

    def _actions_of(self, rank: int, step: int | None = None, index: int = 0):
        step = self._start if step is None else step
        while step < self._n_steps:
            actions = self._step_actions(rank, step)
            for i in range(index, len(actions)):
                self._cursor[rank] = (step, i)
                yield step, actions[i]
            step, index = step + 1, 0
        self._cursor[rank] = (step, 0)

    @property
    def n_steps(self) -> int:
        return self._n_steps

    @n_steps.setter
    def n_steps(self, n_steps: int) -> None:
        first_changed = min(n_steps, self._n_steps) - 1  # the last step's segment has no forwards ahead
        placed = [r for r in range(self.pp_size) if self._planner.last_placed_segment(r) >= first_changed]
        if n_steps != self._n_steps and placed:
            raise RuntimeError(f"the run cannot end after {n_steps} steps: ranks {placed} have planned beyond")
        self._n_steps = n_steps
        for rank, (step, index) in self._cursor.items():
            self._planner.restart(rank, self._actions_of(rank, step, index))

    @property
    def spans(self) -> dict[tuple[int, str], int]:
        """(stage, kind) → the largest span of microbatch ids it has held at once so far (CommPlanner)."""
        return self._planner.spans

    def program(self, rank: int, step: int) -> list[_Action | P2PBatch]:
        """Rank `rank`'s program for step `step` (call for consecutive steps from `start_step`)."""
        return self._planner.program(rank, step)
