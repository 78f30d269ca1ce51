"""What an asynchronous schedule is, as data: a per-rank continuous order cut into per-step
segments, when each stage updates, and the weight version each microbatch is bound to.

An asynchronous schedule never flushes: the actions of one optimizer step on a rank (its segment)
may forward microbatches of the next minibatch, whose backward comes in the next segment. Actions
use global microbatch ids j = k·m + i; the runtime maps them to torch's per-stage chunk slots
j mod (2m). A stage updates once per step (after its segment) or after every backward; the new
weights are version v = number of the stage's updates so far, held in buffer v mod n_buffers.
`stream` concatenates the segments of n_steps steps, which is what one-process validation checks
(sends, receives, F before B, no deadlock) together with `check_versions`.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action

from .validate import ScheduleError

__all__ = ["AsyncOrder", "check_versions"]


class AsyncOrder:
    name: str
    per_microbatch_updates: bool = False  # True: a stage updates after each backward, else once per step

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
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
    """Play each rank's order with its updates: every microbatch runs, forward and backward, on a
    version that exists and is still held; an update never overwrites a buffer that a microbatch
    waiting for its backward is bound to; the version a gradient is taken at is `delay` updates old
    (fewer only at the start)."""
    m = n_microbatches
    for rank in range(pp_size):
        n_buffers = order.n_buffers(rank, pp_size, m)
        updates = 0
        bound: dict[int, int] = {}  # in-flight microbatch → version

        def update(step: int) -> None:
            nonlocal updates
            updates += 1
            written = order.buffer(rank, pp_size, updates, m)
            clash = sorted(j for j, v in bound.items() if order.buffer(rank, pp_size, v, m) == written)
            if clash:
                raise ScheduleError(
                    f"rank {rank}: update {updates} (step {step}) overwrites buffer {written} while microbatches "
                    f"{clash} wait for their backward"
                )

        for step in range(n_steps):
            for action in order.segment(rank, pp_size, m, step, n_steps):
                j = action.microbatch_index
                version = order.version(rank, pp_size, j, m)
                if action.computation_type == FORWARD:
                    if not updates - n_buffers < version <= updates:
                        raise ScheduleError(
                            f"rank {rank}: microbatch {j} needs version {version}, but after {updates} updates "
                            f"only versions {max(updates - n_buffers + 1, 0)}..{updates} are held"
                        )
                    bound[j] = version
                elif action.computation_type == FULL_BACKWARD:
                    if bound.pop(j, None) != version:
                        raise ScheduleError(f"rank {rank}: backward of {j} is not on its forward's version")
                    age = updates - version
                    if age > order.delay(rank, pp_size, m) or (version > 0 and age != order.delay(rank, pp_size, m)):
                        raise ScheduleError(f"rank {rank}: the gradient of {j} is {age} updates old")
                    if order.per_microbatch_updates:
                        update(step)
            if not order.per_microbatch_updates:
                update(step)
