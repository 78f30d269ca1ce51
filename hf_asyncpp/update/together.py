"""Updates of stages that step together: a synchronous pipeline's local stages after its flush, and the
emulator's stages (one process, each its own delay) after each unit. Both clip by the norm over every
stage of the pipeline (`grad_clip_scope: global`); the emulator may clip each stage by its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .gradients import GradientNorms, GradNorm, read_norm
from .rule import UpdateRule

if TYPE_CHECKING:
    from .updater import Updater

__all__ = ["EmulatedUpdates", "SynchronousUpdate"]


class SynchronousUpdate:
    """A synchronous step's one update of this rank's stages: the norm over them and, all-reduced, the
    pipeline's; its host read carries the previous step's statistics (the step's one read)."""

    def __init__(self, norms: GradientNorms, rule: UpdateRule):
        self.norms, self.rule, self.layout = norms, rule, norms.layout

    def apply(self, updater: Updater, read_along=None) -> bool:
        squared = self.norms.prepare(updater)
        if self.layout.pp_size > 1:
            squared = squared.to(self.layout.device, copy=True)  # the recorded value stays this rank's
            dist.all_reduce(squared, group=self.layout.pp_group)
        return self.rule.apply(updater, read_norm(squared, read_along))


class EmulatedUpdates:
    """The emulated stages' updates after a unit, each through its staleness emulator (optim/delay.py),
    read once for all of them."""

    def __init__(self, norms: GradientNorms, rule: UpdateRule, global_norm: bool):
        self.norms, self.rule, self.global_norm = norms, rule, global_norm

    def apply(self, updaters: list[Updater], emulators: list) -> list[bool]:
        """Clipped by the norm of all of them (or each by its own); returns which were applied. A skipped
        update still counts a unit in its emulator (the delay's history moves on)."""
        squared = [self.norms.prepare(updater) for updater in updaters]
        if self.global_norm:  # added in order, as a sum of the values on the host adds them
            total = squared[0]
            for s in squared[1:]:
                total = total + s
            squared = [total] * len(updaters)
        norms = torch.stack([s.sqrt() for s in squared])
        values = norms.tolist()
        applied = []
        for updater, value, norm, emulator in zip(updaters, values, norms, emulators):
            applied.append(self.rule.apply(updater, GradNorm(value, norm), emulator))
            if not applied[-1]:
                emulator.skip()
        return applied
