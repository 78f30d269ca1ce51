"""Muon: torch.optim.Muon's update for matrices, per-expert orthogonalisation for fused expert
tensors, AdamW for the rest, chosen by name."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
from transformers import AutoModelForCausalLM

from hf_asyncpp.models.presets import build_config
from hf_asyncpp.optim import build_optimizer
from hf_asyncpp.optim.muon import Muon, orthogonalize
from tests.ranks import run_ranks
from tests.optim.model_sharded_vs_whole import compare_model_sharded_to_whole
from tests.optim.sharded_vs_whole import compare_sharded_to_whole


@pytest.mark.parametrize("shape", [(8, 4), (4, 8)])
@pytest.mark.parametrize("nesterov, scale", [(True, "original"), (False, "match_rms_adamw")])
def test_a_matrix_gets_exactly_torch_optim_muons_update(shape, nesterov, scale):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=gen)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours = Muon([dict(params=[ours], use_muon=True)], lr=0.02, weight_decay=0.1, momentum=0.9,
                    nesterov=nesterov, adjust_lr_fn=scale)
    opt_theirs = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                                  adjust_lr_fn=scale)
    for _ in range(5):
        grad = torch.randn(shape, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", [(3, 6, 4), (3, 4, 6), (8, 192, 48), (8, 48, 96), (2, 64, 64)])
def test_fused_experts_are_each_orthogonalised_exactly_as_torch_orthogonalises_one_matrix(shape):
    """The stack's batched iteration against torch.optim.Muon's own, matrix by matrix: bitwise on a CPU
    (the same bf16 products, batched or not). Shapes: tall and wide, the study model's experts, square."""
    stack = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    together = orthogonalize(stack)
    for e in range(shape[0]):
        assert torch.equal(together[e], _zeropower_via_newtonschulz(stack[e], (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                                                                      5, EPS))
    # Each expert's result is near-orthogonal (bf16 Newton–Schulz: singular values in ~[0.5, 1.5]).
    singular = torch.linalg.svdvals(together[0].float())
    assert singular.min() > 0.3 and singular.max() < 1.7


def test_a_rank_holding_no_expert_orthogonalises_an_empty_stack():
    """With fewer experts than dp ranks, some ranks' Shard(0) of a fused expert tensor is (0, A, B)."""
    empty = orthogonalize(torch.zeros(0, 6, 4))
    assert empty.shape == (0, 6, 4) and empty.dtype == orthogonalize(torch.ones(1, 6, 4)).dtype


def test_the_whole_model_steps_with_muon():
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3-moe", num_hidden_layers=2, vocab_size=64))
    opt = build_optimizer("muon", model.named_parameters(), 0.02, 0.95, 0.95, 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)


@pytest.mark.multirank
def test_on_dp_shards_muon_orthogonalises_the_whole_matrix_and_keeps_its_momentum_sharded():
    """Shard(0) over 2 ranks vs the whole tensor, same gradients, 6 steps: every rank orthogonalises
    the gathered matrix (identical input, identical bf16 iteration), so the result is bitwise equal;
    the momentum buffer stays a DTensor holding half the elements."""
    shapes = [(8, 6), (4, 6, 6)]  # a matrix and a stack of expert matrices (sharded over experts)
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
    for reports in run_ranks(2, compare_sharded_to_whole, "muon", options, shapes, 6, timeout_s=120):
        for report in reports:
            assert report["max_diff"] == 0.0 and report["moved"] > 0.01, report
            assert report["exp_avg_is_dtensor"] and 2 * report["exp_avg_local"] == report["numel"], report


@pytest.mark.multirank
def test_with_fewer_experts_than_dp_ranks_every_rank_steps_like_the_unsharded_model():
    """GPT-OSS with one expert on 2 dp ranks: rank 1 holds no expert rows (nor router or expert-bias
    rows). FSDP2 and shard_parameters, 3 Muon steps, must equal the unsharded model bitwise: both
    ranks see the same batch, so FSDP2's dp mean (g/2 + g/2) is exactly the whole gradient; momentum
    and AdamW are elementwise on slices; each expert's bf16 Newton–Schulz is the same computation on
    the same input whichever rank runs it."""
    overrides = dict(num_hidden_layers=1, vocab_size=64, hidden_size=32, intermediate_size=48, head_dim=8,
                     num_local_experts=1, num_experts_per_tok=1)
    reports = run_ranks(2, compare_model_sharded_to_whole, "muon", "tiny-gpt-oss", overrides, 3, timeout_s=300)
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert [r[experts]["local_rows"] for r in reports] == [1, 0]
    for report in reports:
        for name, diffs in report.items():
            assert diffs["fsdp"] == 0.0 and diffs["shard_parameters"] == 0.0, (name, diffs)
        assert report[experts]["moved"] > 0.01


def test_orthogonalising_a_row_shard_instead_of_the_whole_matrix_is_wrong():
    """Why Muon gathers: Newton–Schulz of each half of the rows is not the halves of Newton–Schulz."""
    matrix = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    whole = orthogonalize(matrix)
    by_shard = torch.cat([orthogonalize(half) for half in matrix.chunk(2)])
    assert (whole - by_shard).abs().max() > 0.1


def test_adamw_name_patterns_are_configurable():
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3-moe", num_hidden_layers=1, vocab_size=64))
    opt = build_optimizer("muon", model.named_parameters(), 0.02, 0.95, 0.95, 0.1,
                          muon_adamw_patterns=[r"embed_tokens", r"lm_head", r"norm", r"self_attn\."])
    names = {id(p): n for n, p in model.named_parameters()}
    adamw = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
    assert "model.layers.0.self_attn.q_proj.weight" in adamw
    assert "model.layers.0.mlp.gate.weight" not in adamw  # the router is Muon's once the pattern is dropped
