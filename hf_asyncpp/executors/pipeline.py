"""What the two pipeline executors share: torch stages told their inputs and outputs, compute timing,
and an evaluation through a forward-only program."""

from __future__ import annotations

import torch
from ..metrics import ComputeTimer
from ..models.stage_io import stage_io
from ..schedules.stage_hooks import HookedStage
from .base import Executor

__all__ = ["PipelineExecutor"]


class PipelineExecutor(Executor):
    """A rank's stages of a real pipeline (pp ranks, P2P between them)."""

    def _build_stages(self, model_config, stage_modules: list[torch.nn.Module]) -> None:
        """torch's PipelineStage of each local stage, with every stage's inputs and outputs known up front
        (models/stage_io.py: no metadata round), and the compute timer."""
        self._stage_io = stage_io(model_config, self.plan, self.config.micro_batch_size, self.config.seq_len,
                                  self.dtype)
        self._stage_modules = stage_modules
        self.stages = self._pipeline_stages(self.layout.pp_group)
        self.timer = ComputeTimer(self.stages, self.layout.device)

    def _pipeline_stages(self, group) -> list[HookedStage]:
        """torch's PipelineStage of each local stage on `group`, told its inputs and outputs; what runs
        around its compute subscribes to its hooks (schedules/stage_hooks.py)."""
        return [HookedStage(submod, s, len(self.plan), self.layout.device, *self._stage_io[s], group=group)
                for submod, s in zip(self._stage_modules, self.stage_ids)]

    def _evaluate_through(self, schedule, loss_fn, rows: torch.Tensor, return_logits: bool):
        for module in self.modules:
            module.eval()
        try:
            args = (rows,) if self.holds_first_stage else ()
            with self.timer.paused():  # not a training step's compute
                output = schedule.eval(*args, target=rows if self.holds_last_stage else None,
                                       return_outputs=return_logits)
        finally:
            for module in self.modules:
                module.train()
        logits = output[0] if isinstance(output, tuple) else output
        return loss_fn.take(self.config.n_microbatches), logits

    def torch_stages(self) -> list[HookedStage]:
        return self.stages
