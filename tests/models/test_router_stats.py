"""The load-balancing loss assembled from per-stage sums equals HF's function over all layers."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from hf_asyncpp.models.router_stats import add_router_logits, empty_router_stats, load_balancing_loss


@pytest.mark.parametrize("cuts", [[4], [1, 3], [2, 1, 1], [1, 1, 1, 1]])
def test_any_split_of_the_layers_gives_hf_loss(cuts):
    num_experts, top_k, tokens = 8, 2, 24
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(tokens, num_experts, generator=gen) * 3 for _ in range(sum(cuts))]
    stats, start = empty_router_stats(num_experts), 0
    for size in cuts:
        stats = add_router_logits(stats, logits[start:start + size], top_k)
        start += size
    expected = load_balancing_loss_func(tuple(logits), num_experts, top_k)
    torch.testing.assert_close(load_balancing_loss(stats), expected, rtol=0, atol=1e-6)


def test_summing_per_stage_losses_would_be_a_different_loss():
    """Why statistics, not losses, travel between stages."""
    num_experts, top_k = 4, 1
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(16, num_experts, generator=gen) * 4 for _ in range(2)]
    whole = load_balancing_loss_func(tuple(logits), num_experts, top_k)
    per_stage = sum(load_balancing_loss_func((layer,), num_experts, top_k) for layer in logits) / 2
    assert abs(whole - per_stage) > 1e-3


def test_gradient_flows_through_router_probabilities_like_hf():
    num_experts, top_k = 4, 2
    base = torch.randn(3, 10, num_experts, generator=torch.Generator().manual_seed(2))
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    load_balancing_loss(add_router_logits(empty_router_stats(num_experts), list(ours), top_k)).backward()
    load_balancing_loss_func(tuple(theirs), num_experts, top_k).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-7)


def test_folding_a_stages_logits_copies_nothing_from_the_host(monkeypatch):
    """A copy from the host waits for the device on a GPU (pageable memory): the row count, known from
    shapes, is filled on the device instead."""
    copies = []
    new_tensor, tensor = torch.Tensor.new_tensor, torch.tensor
    monkeypatch.setattr(torch.Tensor, "new_tensor", lambda *a, **k: copies.append("new_tensor") or new_tensor(*a, **k))
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: copies.append("tensor") or tensor(*a, **k))
    stats = add_router_logits(empty_router_stats(4), [torch.randn(6, 4) for _ in range(2)], 2)
    assert copies == [] and stats[-1] == 12
