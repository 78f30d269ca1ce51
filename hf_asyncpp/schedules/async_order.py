"""What an asynchronous schedule is, as data: a per-rank continuous order cut into per-step
segments, when each stage updates, and the weight version each microbatch is bound to.

An asynchronous schedule never flushes: the actions of one optimizer step on a rank (its segment)
may forward microbatches of the next minibatch, whose backward comes in the next segment. Actions
use global microbatch ids j = k·m + i; the runtime maps them to torch's per-stage chunk slots
j mod (2m). A stage updates after the backward of each minibatch's last microbatch, or after every
backward; the new weights are version v = number of the stage's updates so far, held in buffer
v mod n_buffers.
`stream` concatenates the segments of n_steps steps, which is what one-process validation checks
(sends, receives, F before B, no deadlock) together with `check_versions`.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import FORWARD, _Action

from .validate import ScheduleError

__all__ = ["AsyncOrder", "check_versions", "replay_after"]


class AsyncOrder:
    name: str
    per_microbatch_updates: bool = False  # True: a stage updates after each backward, else once per step

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        """Rank `rank`'s actions (all its stages) between step `step`'s start and the next step's."""
        raise NotImplementedError

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        """Updates between the version a gradient is taken at and the weights it is applied to."""
        raise NotImplementedError

    def n_buffers(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        """Weight version buffers the stage keeps (the versions in-flight microbatches still need)."""
        return self.delay(stage, pp_size, n_microbatches) + 1

    def unit(self, j: int, n_microbatches: int) -> int:
        """The update unit microbatch j belongs to: its minibatch, or itself with per-microbatch updates."""
        return j if self.per_microbatch_updates else j // n_microbatches

    def version(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        """The weight version microbatch j runs on (forward and backward): its unit − delay, from 0."""
        return max(self.unit(j, n_microbatches) - self.delay(stage, pp_size, n_microbatches), 0)

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
            done, delay = updates.get(stage, 0), order.delay(stage, pp_size, m)
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
            if done - version > delay or (version > 0 and done - version != delay):
                raise ScheduleError(f"{where}: the gradient of {j} is {done - version} updates old, not {delay}")
            if order.per_microbatch_updates or j % m == m - 1:
                updates[stage] = done + 1
                written = order.buffer(stage, pp_size, done + 1, m)
                clash = sorted(i for (s, i), v in bound.items() if s == stage and order.buffer(s, pp_size, v, m) == written)
                if clash:
                    raise ScheduleError(
                        f"{where}: update {done + 1} overwrites buffer {written} while microbatches {clash} wait "
                        "for their backward"
                    )


def replay_after(order: AsyncOrder, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> dict[int, list[_Action]]:
    """Per rank, what a run resumed after `step` (steps 0..step done) re-executes, in its original
    order, before step `step + 1`'s segment: every action of an update unit that no stage has
    updated yet. Forwards rebuild in-flight activations (and resend pending activations, because
    the peer replays its side too), backwards rebuild pending gradient sums; all are deterministic
    functions of the saved weight versions and the data, so the resumed run continues the same
    trajectory without saving activations or messages.

    Raises ScheduleError when a unit is updated on some stages before the boundary and on others
    after it (e.g. WPipe): replaying it would apply part of its gradient twice."""
    m = n_microbatches
    before = {r: [a for k in range(step + 1) for a in order.segment(r, pp_size, m, k, n_steps)] for r in range(pp_size)}
    stages = {a.stage_index for ops in before.values() for a in ops}

    def updates(a: _Action) -> bool:
        return a.computation_type != FORWARD and (order.per_microbatch_updates or a.microbatch_index % m == m - 1)

    updated = {(a.stage_index, order.unit(a.microbatch_index, m)) for ops in before.values() for a in ops if updates(a)}
    started = {order.unit(a.microbatch_index, m) for ops in before.values() for a in ops}
    finished = {u for u in started if all((s, u) in updated for s in stages)}
    straddling = sorted({u for _, u in updated} - finished)
    if straddling:
        raise ScheduleError(
            f"{order.name}: after step {step}, update unit(s) {straddling} are applied on some stages but not on "
            "others; a run cannot resume at this step boundary by replay"
        )
    return {r: [a for a in ops if order.unit(a.microbatch_index, m) not in finished] for r, ops in before.items()}
