"""Activation checkpointing recomputes exactly what the forward computed, and keeps less.

Specification, for a whole model as one stage and for MoE, DeepSeek-V3 and dense families:
  - "full" (every decoder layer) and "selective" (each layer's MLP / MoE block) give bitwise the
    losses and gradients of "none": the recomputation runs the same kernels on the same inputs;
  - the tensors autograd keeps for the backward shrink: full < selective < none;
  - under weight stashing the recomputation runs on the weight version the forward ran on, even
    when the master weights changed in between (an update landed);
  - a recomputation is not counted as a forward (router statistics, DeepSeek-V3 routing loads).
"""

from __future__ import annotations

import pytest
import torch

from hf_asyncpp.models import build_stages, plan_stages
from hf_asyncpp.models.recompute import apply_activation_checkpointing
from hf_asyncpp.update.versions import VersionedStage
from tests.test_engine import small_model_config

FAMILIES = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-llama"]


def _stage(preset: str, mode: str):
    config = small_model_config(preset)
    (stage,) = build_stages(config, plan_stages(config, 1), [0], "cpu", seed=2)
    apply_activation_checkpointing(stage, mode)
    return config, stage


def _loss(stage, rows):
    out = stage(rows)
    logits, stats = out if isinstance(out, tuple) else (out, None)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())
    return loss + (stats.sum() * 1e-3 if stats is not None else 0)


def _saved_bytes(fn) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


@pytest.mark.parametrize("preset", FAMILIES)
def test_checkpointed_losses_and_gradients_equal_the_plain_ones_bitwise(preset):
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("none", "full", "selective"):
        _, stage = _stage(preset, mode)
        loss = _loss(stage, rows)
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None})
    for mode in ("full", "selective"):
        assert torch.equal(results[mode][0], results["none"][0]), mode
        assert results[mode][1].keys() == results["none"][1].keys()
        for name, grad in results["none"][1].items():
            assert torch.equal(results[mode][1][name], grad), f"{mode}: {name}"


def test_checkpointing_keeps_fewer_activations_full_fewest():
    rows = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    saved = {mode: _saved_bytes(lambda: _loss(_stage("tiny-qwen3-moe", mode)[1], rows))
             for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_recomputation_runs_on_the_weight_version_of_its_forward(mode):
    """Forward on version 0, then the master changes (an update) before the backward."""
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for m in ("none", mode):
        _, stage = _stage("tiny-qwen3-moe", m)
        versioned = VersionedStage(stage, n_buffers=2)
        versioned.active = 0
        loss = _loss(versioned, rows)
        versioned.bind_master(1)  # an update lands in the next version's buffer, as the engine does it
        with torch.no_grad():
            for p in stage.parameters():
                p.mul_(1.5)  # the master moves on; version 0 must not
        loss.backward()
        grads[m] = {n: t.grad.clone() for n, t in versioned.compute_copy(0).items() if t.grad is not None}
    assert grads[mode] and grads[mode].keys() == grads["none"].keys()
    for name, grad in grads["none"].items():
        assert torch.equal(grads[mode][name], grad), name


def test_a_recomputation_is_not_counted_as_a_forward():
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    _, stage = _stage("tiny-deepseek-v3", "full")
    _loss(stage, rows).backward()
    assert stage.routing_load.n_recorded() == 1  # one forward; its recomputation in the backward not counted
    _, stage = _stage("tiny-qwen3-moe", "full")
    loss = _loss(stage, rows)
    recorded = len(stage._router_logits)
    loss.backward()
    assert len(stage._router_logits) == recorded
