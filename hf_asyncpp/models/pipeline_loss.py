"""The loss of the last pipeline stage: HF's causal-LM loss plus the exact load-balancing loss."""

from __future__ import annotations

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from .router_stats import load_balancing_loss

__all__ = ["PipelineLoss"]


class PipelineLoss:
    """Loss of the last stage's output for one microbatch: HF's causal-LM loss + coef × aux loss.

    Records each microbatch's (LM loss, aux loss) so they can be reported separately. torch's
    stage also calls the loss once on its first step to infer gradient shapes (on a placeholder
    target); `take(n)` therefore keeps the last n records, the step's real microbatches.
    """

    def __init__(self, vocab_size: int, aux_coef: float):
        self.vocab_size, self.aux_coef = vocab_size, aux_coef
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        logits, router_stats = output if isinstance(output, tuple) else (output, None)
        lm_loss = ForCausalLMLoss(logits, target, self.vocab_size)
        if router_stats is None:
            self.records.append((lm_loss.detach(), torch.zeros((), device=lm_loss.device)))
            return lm_loss
        aux_loss = load_balancing_loss(router_stats)
        self.records.append((lm_loss.detach(), aux_loss.detach()))
        return lm_loss + self.aux_coef * aux_loss

    def take(self, n_microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        records, self.records = self.records[-n_microbatches:], []
        return records
