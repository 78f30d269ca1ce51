"""An asynchronous schedule emulated on one process: the same update rule, no pipeline.

The model is cut into the stages the schedule would have at depth `emulate_pp_size`, and the stages
run one after another in this process. Each stage's parameters carry that stage's delay in the
staleness emulator (optim/delay.py), each stage has its own optimizer, LR schedule and gradient
clipping, and stages update per minibatch or per microbatch as the schedule does. So a researcher
without a pipeline runs the experiment a pipeline would: PipeDream-2BW (every stage one update
stale), WPipe (first half stale, second half fresh) or PipeDream (stage s p−1−s updates stale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .optim.delay import StalenessEmulator

__all__ = ["EmulatedPipeline"]


class EmulatedPipeline:
    def __init__(self, modules, stage_ids: list[int], order, depth: int, n_microbatches: int, updaters: list):
        self.modules, self.stage_ids, self.order, self.m = modules, stage_ids, order, n_microbatches
        self.updaters = updaters
        self.emulators = [
            StalenessEmulator(updater.stepper, dict.fromkeys(updater.params, order.delay(stage, depth, n_microbatches)))
            for updater, stage in zip(updaters, stage_ids)
        ]

    def forward(self, rows: torch.Tensor):
        """The last stage's output for `rows` (the stages run one after another)."""
        carried = (rows,)
        for module in self.modules:
            out = module(*carried)
            carried = out if isinstance(out, tuple) else (out,)
        return carried if len(carried) > 1 else carried[0]

    def _forward_backward(self, rows: torch.Tensor, loss_fn: Callable, scale: float) -> None:
        (loss_fn(self.forward(rows), rows) * scale).backward()

    def run_step(self, rows: torch.Tensor, loss_fn: Callable, apply_update: Callable) -> dict[int, int]:
        """One minibatch: forward/backward on each stage's stale version, then every stage's update
        (`apply_update(updater, emulator)`, which steps or skips through it), once or after each microbatch. Returns the
        weight-version age per stage."""
        ages = {stage: emulator.version_age() for stage, emulator in zip(self.stage_ids, self.emulators)}
        units = [[mb] for mb in rows.chunk(self.m)] if self.order.per_microbatch_updates else [rows.chunk(self.m)]
        for unit in units:
            for emulator in self.emulators:
                emulator.zero_grad()
            with contextlib.ExitStack() as stack:
                for emulator in self.emulators:
                    stack.enter_context(emulator.stale_weights())
                for microbatch in unit:
                    self._forward_backward(microbatch, loss_fn, 1.0 / len(unit))
            for updater, emulator in zip(self.updaters, self.emulators):
                apply_update(updater, emulator)
        return ages
