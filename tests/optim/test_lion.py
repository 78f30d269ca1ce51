"""Lion: equal to pytorch_optimizer's Lion (an independent implementation), the same on FSDP2 DTensor
shards as on whole tensors, and wired into build_optimizer."""

from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import Lion as ReferenceLion

from hf_asyncpp.optim import build_optimizer
from hf_asyncpp.optim.lion import Lion
from tests.ranks import run_ranks

from .sharded_vs_whole import compare_sharded_to_whole


@pytest.mark.parametrize("shape", [(8, 4), (3, 5, 6), (16,)])
@pytest.mark.parametrize("weight_decay, betas", [(0.0, (0.9, 0.99)), (0.1, (0.95, 0.98))])
@pytest.mark.parametrize("foreach", [False, True])
def test_lion_equals_the_reference_bitwise(shape, weight_decay, betas, foreach):
    # The same elementwise operations in the same order (decay, lerp, sign, lerp, add): bitwise equal.
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=gen)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours = Lion([ours], lr=0.01, betas=betas, weight_decay=weight_decay)
    opt_theirs = ReferenceLion([theirs], lr=0.01, betas=betas, weight_decay=weight_decay, foreach=foreach)
    for _ in range(6):
        grad = torch.randn(shape, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, start)


def test_without_weight_decay_every_element_moves_by_exactly_lr():
    p = torch.nn.Parameter(torch.zeros(32))
    opt = Lion([p], lr=0.125)  # a power of two: the moved distance is exact
    p.grad = torch.randn(32, generator=torch.Generator().manual_seed(2))
    opt.step()
    assert torch.equal(p.abs(), torch.full((32,), 0.125))
    assert torch.equal(p.sign(), -p.grad.sign())


def test_build_optimizer_maps_momentum_to_beta1_and_beta2_to_the_momentum_ema():
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer("lion", model.named_parameters(), 1e-4, 0.9, 0.99, 0.1)
    assert isinstance(opt, Lion)
    assert opt.defaults["betas"] == (0.9, 0.99)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1]  # no decay_names given: every parameter decays


@pytest.mark.multirank
def test_lion_on_dtensor_shards_equals_lion_on_whole_tensors():
    # Elementwise, so each rank's slice sees exactly the operations the whole tensor does: bitwise.
    shapes = [(8, 6), (4, 6, 6), (10,)]
    options = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    for reports in run_ranks(2, compare_sharded_to_whole, "lion", options, shapes, 6, timeout_s=120):
        for report in reports:
            assert report["max_diff"] == 0.0, report
            assert report["moved"] > 0.01, report
            assert report["exp_avg_is_dtensor"] and 2 * report["exp_avg_local"] == report["numel"], report
