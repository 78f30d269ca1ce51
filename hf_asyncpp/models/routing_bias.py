"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert routing bias nudged after each step.

DeepSeek-V3's router picks experts by `sigmoid(logits) + e_score_correction_bias`; the bias only
steers selection, not the gating weights. After every optimizer step each expert's bias moves by
the update rate γ toward balance: +γ if the expert received fewer tokens than the mean over experts
in that step, −γ if more (DeepSeek-V3 report, §2.1.2; γ = 0.001 for most of its training).
transformers runs the biased routing but never updates the bias; this module does, counting the
tokens each router sends to each expert over the step's microbatches and all dp replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RoutingLoadCounter"]


class RoutingLoadCounter:
    """Per-expert token counts of every bias-balanced router inside `module`, per forward call."""

    def __init__(self, module: nn.Module, router_class: type):
        self.routers = [
            m for m in module.modules() if isinstance(m, router_class) and hasattr(m, "e_score_correction_bias")
        ]
        self._calls: dict[int, list[torch.Tensor]] = {id(r): [] for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, router, args, output):
        top_k_indices = output[2]
        counts = torch.bincount(top_k_indices.reshape(-1), minlength=router.num_experts)
        self._calls[id(router)].append(counts.to(torch.float64))

    def reset(self) -> None:
        for calls in self._calls.values():
            calls.clear()

    @torch.no_grad()
    def update_biases(self, rate: float, n_microbatches: int, dp_group) -> None:
        """Apply one step's update from the last n_microbatches forward calls of each router.

        (torch's stage runs one extra forward on its first step to infer shapes; counting only the
        last n calls keeps that out.)"""
        if not self.routers:
            return
        loads = torch.stack([sum(self._calls[id(r)][-n_microbatches:]) for r in self.routers])
        if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(loads, group=dp_group)
        for router, load in zip(self.routers, loads):
            bias = router.e_score_correction_bias
            bias += rate * torch.sign(load.mean() - load).to(bias.dtype)
        self.reset()
