"""One stage of an asynchronous pipeline, and its update from gradient to published weights, owned whole.

The runtime (schedules/async_runtime.py) calls down into it, and it calls down into what it owns:

    REDUCE_GRAD of unit u ──► gradient_ready(u, version)
                                 ├─ VersionedStage.move_gradients_to_master   (weight_versions.py, fsdp.py)
                                 ├─ Updates.post ─► the norm: its own, now, or the pipeline's, held
                                 └─ _apply(norm) once it is known
    before a forward or an update that needs it ──► complete(through_unit)
                                 └─ Updates.complete ─► the held norm ─► _apply(norm)

    _apply: bind the master to the buffer of its next version, step (or skip) through the updater
    (optimizer, Error Feedback, LR schedule), the minibatch's routing-bias update, publish the version.

An update's outcome (applied or skipped) is recorded by Updates with the step of its gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..updates import GradNorm

__all__ = ["StageUpdate"]


class StageUpdate:
    """Local stage `stage` (module `index` of the executor): its versioned module, its updater, its routing-
    load counter (DeepSeek-V3, else None); `updates` clips, steps or skips, and holds the norm."""

    def __init__(self, index: int, stage: int, versioned, updater, routing_load, updates, spec, config, pp_size: int):
        self.index, self.stage, self.versioned, self.updater = index, stage, versioned, updater
        self.routing_load, self.updates, self.config = routing_load, updates, config
        self._order, self._pp_size = spec.order, pp_size

    def buffer(self, version: int) -> int:
        """The buffer that holds this stage's weight version `version`."""
        return self._order.buffer(self.stage, self._pp_size, version, self.config.n_microbatches)

    def gradient_ready(self, unit: int, version: int, grad_scale: float, carry=None) -> None:
        """The stage has the gradient of update unit `unit`, taken at weight version `version`: it moves to
        the master, and the update is applied now or once the pipeline's norm is in. `carry`: statistics
        the norm's host read also reads (updates.Updates.carry)."""
        self.versioned.move_gradients_to_master(self.buffer(version), grad_scale)
        ages = self.updates.ages
        ages[self.stage] = max(ages.get(self.stage, 0), self.versioned.master_version - version)
        norm = self.updates.post(self.index, unit, self.updater, carry)
        if norm is not None:
            self._apply(norm)

    def complete(self, through_unit: int | None = None, carry=None) -> bool:
        """The stage's update held for its norm, if of a unit <= `through_unit`, is needed now: applied
        (returns whether there was one)."""
        norm = self.updates.complete(self.index, through_unit, carry)
        if norm is not None:
            self._apply(norm)
        return norm is not None

    def _apply(self, norm: GradNorm) -> None:
        """Step clipped by `norm` into the buffer of the next version (written there, weight_versions.py),
        with the minibatch's routing-bias update; the gradient is freed."""
        next_buffer = self.buffer(self.versioned.master_version + 1)
        self.versioned.bind_master(next_buffer)
        applied = self.updates.step(self.updater, norm)
        if self.routing_load is not None:
            m, unit = self.config.n_microbatches, self.versioned.master_version
            ends_minibatch = not self._order.per_microbatch_updates or unit % m == m - 1
            self.routing_load.after_update(applied, ends_minibatch, m, self.config.router_bias_update_rate,
                                           self.updates.layout.dp_group)
        self.versioned.publish_master(next_buffer)
        self.updater.optimizer.zero_grad(set_to_none=True)
