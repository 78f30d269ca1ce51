"""What an asynchronous schedule is, as data: a per-rank continuous order cut into per-step
segments, and the weight version each microbatch is bound to.

An asynchronous schedule never flushes: the actions of one optimizer step on a rank (its segment)
may forward microbatches of the next minibatch, whose backward comes in the next segment. Actions
use global microbatch ids j = k·m + i; the runtime maps them to torch's per-stage chunk slots
j mod (2m). `stream` concatenates the segments of n_steps steps, which is what one-process
validation checks (sends, receives, F before B, no deadlock) together with `check_versions`.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action

from .validate import ScheduleError

__all__ = ["AsyncOrder", "check_versions"]


class AsyncOrder:
    name: str
    n_buffers: int  # weight version buffers per stage
    updates_per_step: int  # optimizer updates per stage per minibatch

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        raise NotImplementedError

    def version(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        """The weight version (number of the stage's updates) microbatch j runs on."""
        raise NotImplementedError

    def buffer_written_after(self, stage: int, pp_size: int, step: int) -> int:
        """The version buffer that receives the new master weights after step `step`."""
        raise NotImplementedError

    def delay(self, stage: int, pp_size: int) -> int:
        """Updates between the version a gradient is taken at and the weights it is applied to."""
        raise NotImplementedError

    def stream(self, pp_size: int, n_microbatches: int, n_steps: int) -> dict[int, list[_Action]]:
        return {
            r: [a for k in range(n_steps) for a in self.segment(r, pp_size, n_microbatches, k, n_steps)]
            for r in range(pp_size)
        }


def check_versions(order: AsyncOrder, pp_size: int, n_microbatches: int, n_steps: int) -> None:
    """No buffer is overwritten while a microbatch bound to it waits for its backward, and every
    microbatch runs on version (its step − delay), clamped at 0."""
    m = n_microbatches
    for rank in range(pp_size):
        bound: dict[int, int] = {}  # in-flight microbatch → buffer
        for step in range(n_steps):
            for action in order.segment(rank, pp_size, m, step, n_steps):
                j = action.microbatch_index
                version = order.version(rank, pp_size, j, m)
                if version != max(j // m - order.delay(rank, pp_size), 0):
                    raise ScheduleError(f"rank {rank}: microbatch {j} runs on version {version}")
                if action.computation_type == FORWARD:
                    bound[j] = version % order.n_buffers
                elif action.computation_type == FULL_BACKWARD:
                    if bound.pop(j, None) != version % order.n_buffers:
                        raise ScheduleError(f"rank {rank}: backward of {j} is not on its forward's version")
            written = order.buffer_written_after(rank, pp_size, step)
            clash = sorted(j for j, buf in bound.items() if buf == written)
            if clash:
                raise ScheduleError(
                    f"rank {rank}: step {step} overwrites buffer {written} while microbatches {clash} wait for backward"
                )
            # The version made by this step must be the one the buffer is meant to hold next.
            if (step + 1) % order.n_buffers != written:
                raise ScheduleError(f"rank {rank}: step {step} writes version {step + 1} into buffer {written}")
