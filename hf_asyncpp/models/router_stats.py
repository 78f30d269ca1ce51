"""The Switch-style load-balancing loss, computed exactly across pipeline stages.

HF's `load_balancing_loss_func` (identical in Mixtral, Qwen2/3-MoE, OLMoE and GPT-OSS) sums over
*all* layers before it multiplies:

    aux = E · Σ_e (count_e / rows) · (prob_e / rows)

with count_e the number of top-k assignments to expert e, prob_e the summed softmax router
probability of e, and rows the number of (token, layer) pairs. A product of sums is not a sum of
per-stage products, so each stage adds its layers' three sums into a running statistics vector that
travels with the activations, and the last stage forms the product. Gradients flow back through
prob_e; the counts come from top-k and carry none, exactly as in HF.

Layout of the vector (float32, length 2E + 1): [count_0..count_{E-1}, prob_0..prob_{E-1}, rows].
"""

from __future__ import annotations

import torch

__all__ = ["empty_router_stats", "add_router_logits", "load_balancing_loss"]


def empty_router_stats(num_experts: int, device=None) -> torch.Tensor:
    return torch.zeros(2 * num_experts + 1, dtype=torch.float32, device=device)


def add_router_logits(stats: torch.Tensor, router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Fold a stage's per-layer router logits (each (tokens, E)) into the running statistics."""
    num_experts = (stats.numel() - 1) // 2
    counts = stats.new_zeros(num_experts)
    probs = stats.new_zeros(num_experts)
    rows = 0
    for logits in router_logits:
        routing_weights = torch.softmax(logits.reshape(-1, num_experts).to(stats.device), dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        counts = counts + torch.histc(
            selected.reshape(-1).to(torch.float32), bins=num_experts, min=0, max=num_experts
        )
        probs = probs + routing_weights.float().sum(dim=0)
        rows += routing_weights.shape[0]
    # The row count is known on the host (shapes): filled on the device, not copied there.
    return stats + torch.cat([counts, probs, counts.new_full((1,), float(rows))])


def load_balancing_loss(stats: torch.Tensor) -> torch.Tensor:
    """E · Σ_e (count_e / rows)(prob_e / rows), the value HF's function returns."""
    num_experts = (stats.numel() - 1) // 2
    counts, probs, rows = stats[:num_experts], stats[num_experts:-1], stats[-1]
    return torch.sum((counts / rows) * (probs / rows)) * num_experts
