"""The update itself, one rule for every kind of run: clip to max_grad_norm by the update's norm and step
the optimizer (through Error Feedback, or the emulator's stepper) and the LR schedule; or, when the norm
is non-finite, skip: the weights, the optimizer's and EF's state and the LR schedule stay as they are
(AdamW's moments would decay even on a zero gradient), and the skip is counted."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .gradients import GradNorm
from .report import StepReport

if TYPE_CHECKING:
    from .updater import Updater

__all__ = ["UpdateRule"]


class UpdateRule:
    def __init__(self, max_norm: float, report: StepReport):
        self.max_norm, self.report = max_norm, report

    def apply(self, updater: Updater, norm: GradNorm, stepper=None) -> bool:
        """Clip by `norm` and step through `stepper` (the updater's own by default); a non-finite `norm`
        skips. The run's last update takes Error Feedback's extrapolation back under ef_last_update
        trajectory (the decision: Updater.extrapolates_next_update). Returns whether it was applied."""
        stepper = stepper or updater.stepper
        if not math.isfinite(norm.value):
            for param in updater.params:
                param.grad = None
            updater.skipped_updates += 1
            self.report.record_skip(updater.stages)
            return False
        if self.max_norm > 0:
            # The coefficient max_norm / (norm + 1e-6), clamped to 1, in float32, computed where the norm is.
            torch.nn.utils.clip_grads_with_norm_(updater.params, self.max_norm, norm.on_device.float(), foreach=True)
        if updater.extrapolates_next_update:
            stepper.step()
        else:  # only Error Feedback (through the emulator, when emulating) has an extrapolation to leave out
            stepper.step(extrapolate=False)
        updater.lr_scheduler.step()
        return True
