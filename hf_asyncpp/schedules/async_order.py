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

__all__ = ["AsyncOrder", "check_versions"]


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
