"""An asynchronous stage's weight versions (`VersionedStage`), one process, unsharded.

- Gradient accumulation under bf16 compute: each microbatch's bf16 gradient is added into an fp32
  sum per buffer (accumulation across microbatches stays fp32, as FSDP2 keeps it), which becomes
  the master's gradient.
- Two buffers are all PipeDream-2BW holds: the master is the newest of them, an update is written
  into the other, and a microbatch in flight on the previous version keeps its weights."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.func import functional_call

from hf_asyncpp.update.versions import VersionedStage

M = 8  # microbatches accumulated on one buffer before the move to the master
SCALE = 1.0 / M  # what the engine passes for a once-per-minibatch update
# Tolerances, relative to the largest entry of the reference gradient. The reference adds the 8
# per-microbatch bf16 gradients in fp32, in microbatch order, as the accumulator should: the result
# is then bitwise equal, and an fp32 sum in another order would differ by at most ~8 · 2^-24 ≈ 5e-7.
# A bf16 accumulator rounds every partial sum to 8 mantissa bits (2^-9 ≈ 2e-3 relative per add),
# so its error is orders of magnitude above OURS; FLOOR_BF16 (100 × OURS) keeps the test able to
# tell the two apart (the old code, which accumulated in the bf16 `.grad`, fails the first assert).
OURS, FLOOR_BF16 = 1e-6, 1e-4


class SmallMLP(nn.Module):
    fp32_patterns = ("norm",)  # like HF's `_keep_in_fp32_modules_strict`: stays fp32 under bf16 compute

    def __init__(self, width: int = 64, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        h = self.down(nn.functional.gelu(self.up(x.to(self.up.weight.dtype))))
        return self.norm(h.to(self.norm.weight.dtype))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _microbatches(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 64, generator=gen) for _ in range(n)]


def _per_microbatch_grads(module: nn.Module, xs, dtype) -> list[dict[str, torch.Tensor]]:
    """Each microbatch's gradient on its own, computed on `dtype` copies of the weights (fp32 kept
    where the module says so), independently of VersionedStage."""
    grads = []
    for x in xs:
        weights = {n: p.detach().to(torch.float32 if "norm" in n else dtype).requires_grad_()
                   for n, p in module.named_parameters()}
        _loss(functional_call(module, weights, (x,))).backward()
        grads.append({n: w.grad for n, w in weights.items()})
    return grads


def _accumulated(grads, dtype) -> dict[str, torch.Tensor]:
    """Sum in `dtype`, microbatch by microbatch (what an accumulator of that dtype holds), × SCALE."""
    out = {}
    for name in grads[0]:
        total = grads[0][name].to(dtype)
        for g in grads[1:]:
            total = total + g[name].to(dtype)
        out[name] = total.float() * SCALE
    return out


def _run(stage: VersionedStage, buffer: int, xs) -> None:
    stage.active = buffer
    for x in xs:
        _loss(stage(x)).backward()


def _relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(((grads[n] - r).abs().max() / r.abs().max()).item() for n, r in reference.items())


def test_bf16_microbatch_gradients_accumulate_in_fp32_and_become_the_masters_gradient():
    torch.manual_seed(0)
    module = SmallMLP()
    stage = VersionedStage(module, n_buffers=2, compute_dtype=torch.bfloat16)
    xs = _microbatches(M)
    _run(stage, 0, xs[:3])
    _run(stage, 1, _microbatches(2, seed=1))  # another buffer's microbatches in between (2BW at a step edge)
    _run(stage, 0, xs[3:])

    sums, computed = stage.gradient_sums(0), stage.compute_copy(0)
    assert computed["up.weight"].dtype == torch.bfloat16 and computed["norm.weight"].dtype == torch.float32
    assert {t.dtype for t in sums.values()} == {torch.float32}
    bf16_names = {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert set(sums) == bf16_names  # norm.weight/bias stay fp32 and sum in their own .grad
    assert all(computed[n].grad is None for n in bf16_names)  # no bf16 gradient outlives its backward

    stage.move_gradients_to_master(0, SCALE)
    moved = {n: p.grad for n, p in module.named_parameters()}
    assert {g.dtype for g in moved.values()} == {torch.float32}
    assert stage.gradient_sums(0) == {} and all(t.grad is None for t in computed.values())  # cleared
    assert set(stage.gradient_sums(1)) == bf16_names  # buffer 1's sums are its own, still there

    per_microbatch = _per_microbatch_grads(module, xs, torch.bfloat16)
    reference = _accumulated(per_microbatch, torch.float32)
    ours = _relative_error(moved, reference)
    bf16 = _relative_error(_accumulated(per_microbatch, torch.bfloat16), reference)
    assert ours <= OURS, ours
    assert bf16 >= FLOOR_BF16, bf16  # bf16 accumulation really is that much worse here


def test_fp32_compute_accumulates_in_grad_as_before():
    torch.manual_seed(0)
    module = SmallMLP()
    stage = VersionedStage(module, n_buffers=1)
    xs = _microbatches(M)
    _run(stage, 0, xs)
    assert stage.gradient_sums(0) == {}
    stage.move_gradients_to_master(0, SCALE)
    reference = _accumulated(_per_microbatch_grads(module, xs, torch.float32), torch.float32)
    assert _relative_error({n: p.grad for n, p in module.named_parameters()}, reference) <= OURS


def test_a_published_buffers_compute_copy_is_freed_without_waiting_for_the_garbage_collector():
    """The hooks hold the sums dict only, so a dropped bf16 compute copy (a whole stage's weights)
    is freed by reference counting as soon as the buffer is overwritten."""
    stage = VersionedStage(SmallMLP(), n_buffers=2, compute_dtype=torch.bfloat16)
    _run(stage, 1, _microbatches(2))
    stage.move_gradients_to_master(1, 0.5)
    copy = weakref.ref(stage.compute_copy(1)["up.weight"])
    gc.disable()
    try:
        stage.bind_master(1)
        stage.publish_master(1)
        assert copy() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sums_are_dropped_with_the_compute_copies(dtype):
    stage = VersionedStage(SmallMLP(), n_buffers=1, compute_dtype=dtype)
    _run(stage, 0, _microbatches(2))
    assert {t.dtype for t in stage.gradient_sums(0).values()} == {torch.float32}
    stage.drop_compute_copies()  # a checkpoint load overwrote the buffers
    assert stage.gradient_sums(0) == {}


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_two_buffers_hold_every_weight_and_an_update_leaves_the_version_in_flight_untouched():
    torch.manual_seed(0)
    module = SmallMLP()
    original = {n: p.detach().clone() for n, p in module.named_parameters()}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    stage = VersionedStage(module, n_buffers=2)
    params = list(module.parameters())
    # The master holds no storage of its own: two stage copies in all, parameters included.
    assert _storages(params) == _storages(stage.buffers_[0].values())
    assert len(_storages([*params, *(t for b in stage.buffers_ for t in b.values())])) == 2 * len(params)

    x, = _microbatches(1)
    stage.active = 0
    in_flight = _loss(stage(x))  # forwarded on version 0, its backward comes after the update
    for p in params:
        p.grad = torch.ones_like(p)
    stage.bind_master(1)
    optimizer.step()  # the optimizer's own parameter objects, now on buffer 1's storage
    stage.publish_master(1)
    assert stage.master_version == 1 and all(p is q for p, q in zip(params, module.parameters()))
    assert _storages(params) == _storages(stage.buffers_[1].values())
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), original[name] - 0.1), name  # updated in buffer 1
        assert torch.equal(stage.buffers_[0][name], original[name]), name  # version 0 untouched
    in_flight.backward()  # no in-place error: nothing it saved was written
    reference = {n: w.detach().clone().requires_grad_() for n, w in original.items()}
    _loss(functional_call(module, reference, (x,))).backward()
    for name, grad in ((n, stage.buffers_[0][n].grad) for n in original):
        assert torch.equal(grad, reference[name].grad), name
