"""SOAP: equal to pytorch_optimizer's SOAP (an independent implementation) on matrices and vectors,
fused expert tensors as independent matrices, the same on FSDP2 DTensor shards as on whole tensors,
and wired into build_optimizer."""

from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import SOAP as ReferenceSOAP
from transformers import AutoModelForCausalLM

from hf_asyncpp.models.presets import build_config
from hf_asyncpp.optim import build_optimizer
from hf_asyncpp.optim.soap import SOAP
from tests.ranks import run_ranks

from .sharded_vs_whole import compare_sharded_to_whole

# We keep the first moment in the rotated basis (rotated again on each basis refresh); the reference
# keeps it in the parameter's basis and rotates it every step. Equal in exact arithmetic (the bases
# are orthogonal); in float32 the two orders of rounding differ by a few ulps. Everything else (factors,
# eigh, power step + QR, the second moment's permutation) is the reference's operations in its order:
# keeping the first moment its way makes the two bitwise equal. Parameters are O(1): 1e-6 is ~10 ulps.
TOL = 1e-6


def _step_both(shape, steps, ours_options, theirs_options, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=gen)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours, opt_theirs = SOAP([ours], **ours_options), ReferenceSOAP([theirs], **theirs_options)
    for _ in range(steps):
        grad = torch.randn(shape, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    return start, ours, theirs


@pytest.mark.parametrize("shape", [(8, 4), (4, 8), (6, 6), (16,)])
def test_default_soap_equals_the_reference(shape):
    # 12 steps: the first initialises, the 10th update (11th step) refreshes the bases by QR.
    start, ours, theirs = _step_both(shape, 12, {}, {})
    assert (ours - theirs).abs().max() < TOL
    assert (ours - start).abs().max() > 1e-2  # it really moved
    if len(shape) == 1:
        assert torch.equal(ours, theirs)  # plain Adam: the same elementwise operations


@pytest.mark.parametrize("max_dim", [8, 4])  # 12 rows > 8: left side unrotated; 4: both sides unrotated
def test_sides_over_max_precond_dim_keep_the_identity_basis_as_in_the_reference(max_dim):
    options = dict(lr=0.01, betas=(0.9, 0.95), shampoo_beta=0.9, weight_decay=0.1, precondition_frequency=3)
    start, ours, theirs = _step_both((12, 5), 10, dict(options, max_precond_dim=max_dim),
                                     dict(options, max_precondition_dim=max_dim))
    assert (ours - theirs).abs().max() < TOL


def test_the_first_step_only_initialises_the_preconditioner():
    p = torch.nn.Parameter(torch.randn(6, 4))
    before = p.detach().clone()
    opt = SOAP([p], weight_decay=0.1)
    p.grad = torch.randn(6, 4)
    opt.step()
    assert torch.equal(p, before)
    state = opt.state[p]
    assert state["step"] == 0 and state["left_factor"].shape == (6, 6) and state["right_basis"].shape == (4, 4)


def test_fused_experts_are_independent_matrices():
    # Square experts: batched and single matrix products round differently, and a rank-deficient
    # factor (a non-square matrix after one gradient) has a null space whose basis is arbitrary, so
    # only full-rank factors make the two paths comparable; then they agree to float32 rounding.
    gen = torch.Generator().manual_seed(1)
    stack = torch.randn(3, 5, 5, generator=gen)
    fused = torch.nn.Parameter(stack.clone())
    experts = [torch.nn.Parameter(m.clone()) for m in stack]
    opt_fused, opt_experts = SOAP([fused], precondition_frequency=3), SOAP(experts, precondition_frequency=3)
    for _ in range(8):
        grad = torch.randn(3, 5, 5, generator=gen)
        fused.grad = grad.clone()
        for e, p in enumerate(experts):
            p.grad = grad[e].clone()
        opt_fused.step()
        opt_experts.step()
    assert opt_fused.state[fused]["left_factor"].shape == (3, 5, 5)
    assert max((fused[e] - p).abs().max().item() for e, p in enumerate(experts)) < TOL


def test_build_optimizer_passes_the_soap_knobs_and_the_whole_model_steps():
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3-moe", num_hidden_layers=2, vocab_size=64))
    opt = build_optimizer("soap", model.named_parameters(), 0.01, 0.95, 0.95, 0.1,
                          soap_precondition_frequency=2, soap_max_precond_dim=48)
    assert isinstance(opt, SOAP)
    assert opt.defaults["precondition_frequency"] == 2 and opt.defaults["max_precond_dim"] == 48
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 64, (2, 8))
    for _ in range(3):  # the first step initialises; the third refreshes the bases
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)


@pytest.mark.multirank
def test_soap_on_dtensor_shards_equals_soap_on_whole_tensors():
    # Every rank builds the factors and bases from the same gathered gradient with the same
    # operations; only the elementwise Adam moments are computed on slices, where a vectorised and
    # a scalar tail may round differently: agreement to float32 rounding (observed: bitwise).
    shapes = [(8, 6), (4, 6, 6), (10,)]
    options = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, precondition_frequency=2)
    for reports in run_ranks(2, compare_sharded_to_whole, "soap", options, shapes, 6, timeout_s=120):
        for report in reports:
            assert report["max_diff"] < TOL, report
            assert report["moved"] > 0.01, report
            assert report["exp_avg_is_dtensor"] and 2 * report["exp_avg_local"] == report["numel"], report
