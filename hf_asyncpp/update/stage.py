"""One stage of an asynchronous pipeline, and its update from gradient to published weights, owned whole.

The runtime (schedules/async_runtime.py) calls it through `StageUpdater`, and it calls down into what it
owns:

    REDUCE_GRAD of unit u ──► gradient_ready(u, version)
                                 ├─ VersionedStage.move_gradients_to_master   (versions.py)
                                 ├─ HeldNorms.post ─► the norm: its own, now, or the pipeline's, held (held.py)
                                 └─ _apply(norm) once it is known
    before a forward or an update that needs it ──► complete(through_unit)
                                 └─ HeldNorms.complete ─► the held norm ─► _apply(norm)

    _apply: bind the master to the buffer of its next version, step (or skip) by the update rule
    (rule.py: optimizer, Error Feedback, LR schedule), the minibatch's routing-bias update, publish the
    version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .gradients import GradNorm
from .held import HeldNorms
from .rule import UpdateRule
from .versions import VersionedStage

if TYPE_CHECKING:
    from .updater import Updater

__all__ = ["StageUpdate", "StageUpdater"]


class StageUpdater(Protocol):
    """What the asynchronous runtime calls of a stage's update."""

    def gradient_ready(self, unit: int, version: int, grad_scale: float, carry=None) -> None:
        """The stage's update of `unit` is due: after the backward of a minibatch's last microbatch
        (grad_scale 1/m), or of every microbatch with per-microbatch updates (grad_scale 1); the gradient
        was taken at weight version `version`. `carry`: the previous step's statistics, read along with
        the norm where the step's statistics read is."""

    def complete(self, through_unit: int | None = None, carry=None) -> bool:
        """The stage's held update, if of a unit <= `through_unit`, is needed now: applied (returns
        whether there was one)."""

    @property
    def held_unit(self) -> int | None:
        """The unit whose update the stage holds for its norm (None: none)."""


class StageUpdate:
    """Local stage `stage` (module `index` of the executor): its versioned module, its updater, its routing-
    load counter (DeepSeek-V3, else None); `held` holds the norm, `rule` clips, steps or skips."""

    def __init__(self, index: int, stage: int, versioned: VersionedStage, updater: Updater, routing_load,
                 held: HeldNorms, rule: UpdateRule, order, config, pp_size: int):
        self.index, self.stage, self.versioned, self.updater = index, stage, versioned, updater
        self.routing_load, self.held, self.rule, self.config = routing_load, held, rule, config
        self._order, self._pp_size = order, pp_size

    def buffer(self, version: int) -> int:
        """The buffer that holds this stage's weight version `version`."""
        return self._order.buffer(self.stage, self._pp_size, version, self.config.n_microbatches)

    def gradient_ready(self, unit: int, version: int, grad_scale: float, carry=None) -> None:
        self.versioned.move_gradients_to_master(self.buffer(version), grad_scale)
        self.rule.report.record_age(self.stage, self.versioned.master_version - version)
        norm = self.held.post(self.index, unit, self.updater, carry)
        if norm is not None:
            self._apply(norm)

    def complete(self, through_unit: int | None = None, carry=None) -> bool:
        norm = self.held.complete(self.index, through_unit, carry)
        if norm is not None:
            self._apply(norm)
        return norm is not None

    @property
    def held_unit(self) -> int | None:
        return self.held.held_unit(self.index)

    def _apply(self, norm: GradNorm) -> None:
        """Step clipped by `norm` into the buffer of the next version (written there, versions.py), with
        the minibatch's routing-bias update; the gradient is freed."""
        next_buffer = self.buffer(self.versioned.master_version + 1)
        self.versioned.bind_master(next_buffer)
        applied = self.rule.apply(self.updater, norm)
        if self.routing_load is not None:
            m, unit = self.config.n_microbatches, self.versioned.master_version
            ends_minibatch = not self._order.per_microbatch_updates or unit % m == m - 1
            self.routing_load.after_update(applied, ends_minibatch, m, self.config.router_bias_update_rate,
                                           self.held.layout.dp_group)
        self.versioned.publish_master(next_buffer)
        self.updater.optimizer.zero_grad(set_to_none=True)
