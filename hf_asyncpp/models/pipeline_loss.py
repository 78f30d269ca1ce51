"""The loss of the last pipeline stage: HF's causal-LM loss plus the exact load-balancing loss.

Large microbatches take the causal-LM loss in row chunks (`causal_lm_loss`). HF's loss holds three
fp32 tensors of the logits' size at the last stage's peak, in its backward: the log-probabilities saved
for it, their gradient and the logits' gradient (at moe_2b's 16384 tokens × 49152 ids, 3 GiB each).
Chunked, each chunk's loss is recomputed in the backward, and those three are one chunk's: the
logits' gradient (in their dtype) is the only tensor of their size it makes. Per-row values and
gradients are HF's; only the loss's sum runs in another order.
"""

from __future__ import annotations

import torch
from torch.nn import functional
from transformers.loss.loss_utils import ForCausalLMLoss

from .router_stats import load_balancing_loss

__all__ = ["CHUNKED_LOSS_ELEMENTS", "PipelineLoss", "causal_lm_loss"]

# Logits of more elements than this take the loss in chunks of at most this many (512 MiB in fp32);
# below (every CPU run and study here) the loss is HF's as it is, bit for bit.
CHUNKED_LOSS_ELEMENTS = 2**27
IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                   chunk_elements: int = CHUNKED_LOSS_ELEMENTS) -> torch.Tensor:
    """HF's causal-LM loss (the mean over predicted tokens of the next token's cross-entropy, in fp32),
    in row chunks recomputed in the backward when `logits` hold more than `chunk_elements` values."""
    if logits.numel() <= chunk_elements:
        return ForCausalLMLoss(logits, target, vocab_size)
    labels = functional.pad(target, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    rows = max(1, chunk_elements // vocab_size)
    total = _ChunkedCrossEntropy.apply(logits.reshape(-1, vocab_size), labels, rows)
    return total / (labels != IGNORE_INDEX).sum()


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of `rows`-row chunks. The backward recomputes each chunk's with autograd
    (the same kernels as HF's loss) and writes its gradient into one tensor of the logits' size, so a
    chunk's fp32 tensors are all it holds beside that."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        ctx.rows = rows
        return sum(_summed_cross_entropy(chunk, chunk_labels) for chunk, chunk_labels in zip(logits.split(rows),
                                                                                              labels.split(rows)))

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for chunk, chunk_labels, out in zip(logits.split(ctx.rows), labels.split(ctx.rows), grad.split(ctx.rows)):
            with torch.enable_grad():
                leaf = chunk.detach().requires_grad_()
                (chunk_grad,) = torch.autograd.grad(_summed_cross_entropy(leaf, chunk_labels), leaf, grad_total)
            out.copy_(chunk_grad)
        return grad, None, None


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
        lm_loss = causal_lm_loss(logits, target, self.vocab_size)
        if router_stats is None:
            self.records.append((lm_loss.detach(), torch.zeros((), device=lm_loss.device)))
            return lm_loss
        aux_loss = load_balancing_loss(router_stats)
        self.records.append((lm_loss.detach(), aux_loss.detach()))
        return lm_loss + self.aux_coef * aux_loss

    def take(self, n_microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        records, self.records = self.records[-n_microbatches:], []
        return records
