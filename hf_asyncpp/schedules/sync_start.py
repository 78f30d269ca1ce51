"""Sync start: an asynchronous order whose first N steps are synchronous (`sync_steps: N`).

Steps 0 … N−1 each run one flushing segment: per update unit (the minibatch, or each microbatch for
per-microbatch orders), the forwards of its microbatches over the rank's stages, then their
backwards, then the stages' updates — every gradient is taken at the current weights (delay 0)
and nothing is in flight at a step boundary. From step N the wrapped order runs as it does from
the start of training, shifted by N steps: its warm-up, its versions counted from the N·u updates
already applied (u units a step), so minibatch k of PipeDream-2BW runs on x(max(k − 1, N)) — the
first delayed gradient is step N + 1's, as step 0's is undelayed in a run without sync start.
The optimizer, LR schedule, EF and weight-version buffers simply carry on: the updates are counted
across the switch and a version lives in buffer version mod n_buffers either way.
"""

from __future__ import annotations

from ..torch_internals import FORWARD, FULL_BACKWARD, _Action

from .async_order import AsyncOrder

__all__ = ["SyncStart"]


class SyncStart(AsyncOrder):
    def __init__(self, order: AsyncOrder, sync_steps: int):
        self.order, self.sync_steps = order, sync_steps
        self.name, self.per_microbatch_updates = order.name, order.per_microbatch_updates

    def _shift(self, n_microbatches: int) -> int:
        return self.sync_steps * n_microbatches  # microbatches before the switch

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        m, shift = n_microbatches, self._shift(n_microbatches)
        if step >= self.sync_steps:
            return [_Action(a.stage_index, a.computation_type, a.microbatch_index + shift)
                    for a in self.order.segment(rank, pp_size, m, step - self.sync_steps, n_steps - self.sync_steps)]
        stages = sorted({a.stage_index for a in self.order.segment(rank, pp_size, m, 0, 1)})
        per_unit = 1 if self.per_microbatch_updates else m
        ops = []
        for first in range(step * m, (step + 1) * m, per_unit):
            unit = range(first, first + per_unit)
            ops += [_Action(s, FORWARD, j) for s in stages for j in unit]
            ops += [_Action(s, FULL_BACKWARD, j) for s in reversed(stages) for j in unit]
        return ops

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        return self.order.delay(stage, pp_size, n_microbatches)

    def delay_at(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        return 0 if j < self._shift(n_microbatches) else self.delay(stage, pp_size, n_microbatches)

    def first_version(self, j: int, n_microbatches: int) -> int:
        return self.unit(min(j, self._shift(n_microbatches)), n_microbatches)

    def version(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        shift = self._shift(n_microbatches)
        if j < shift:
            return self.unit(j, n_microbatches)  # the updates before it: delay 0
        return self.unit(shift, n_microbatches) + self.order.version(stage, pp_size, j - shift, n_microbatches)

    def cache_key(self) -> tuple:
        return (*self.order.cache_key(), min(self.sync_steps, 2))

    def span_plays(self, pp_size: int, n_microbatches: int) -> tuple[AsyncOrder, int, list[int]]:
        """A synchronous step flushes, so its play is its predecessor's shifted by m: two of them
        hold what any number does, and the switch to the order is the same after two as after N.
        Then the order's own plays, and resumes in the synchronous steps, at the switch and after it."""
        head = min(self.sync_steps, 2)
        _, n_steps, resumes = self.order.span_plays(pp_size, n_microbatches)
        return SyncStart(self.order, head), head + n_steps, sorted({1, head, *(head + k for k in resumes)} - {0})
