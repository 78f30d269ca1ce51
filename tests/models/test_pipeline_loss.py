"""The last stage's causal-LM loss: HF's (transformers' ForCausalLMLoss, the reference), and in row chunks
for large microbatches, with the same value and gradient and a smaller peak."""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_asyncpp.models.pipeline_loss import causal_lm_loss
from hf_asyncpp.planning.memory_tracker import MemoryTracker

VOCAB = 512


def _batch(dtype, rows=4, seq=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, VOCAB, generator=gen).mul(3).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    target[1, 10:30] = -100  # padding, ignored as HF ignores it
    return logits, target


def _value_and_grad(loss_fn, logits, target, **kwargs):
    loss = loss_fn(logits, target, VOCAB, **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_is_hf_s_per_row_and_sums_them_in_another_order(dtype):
    logits, target = _batch(dtype)
    reference, reference_grad = _value_and_grad(ForCausalLMLoss, logits, target)
    chunked, chunked_grad = _value_and_grad(causal_lm_loss, logits, target, chunk_elements=37 * VOCAB)  # 11 chunks
    # The same per-token terms summed in another order: fp32 rounding of a sum of 384 terms near 10.
    assert chunked.item() == pytest.approx(reference.item(), rel=1e-6)
    # Each row's gradient is the same softmax − one-hot over the same count of predicted tokens, computed
    # by the same kernels row by row: bit for bit.
    assert torch.equal(chunked_grad, reference_grad)


def test_below_the_threshold_the_loss_is_hf_s_bit_for_bit():
    logits, target = _batch(torch.float32)
    reference, reference_grad = _value_and_grad(ForCausalLMLoss, logits, target)
    loss, grad = _value_and_grad(causal_lm_loss, logits, target, chunk_elements=logits.numel())
    assert torch.equal(loss, reference) and torch.equal(grad, reference_grad)


def _backward_peak(chunk_elements):
    logits, target = _batch(torch.float32, rows=8, seq=128)
    tracker = MemoryTracker()
    with tracker:
        tracker.track([logits], "logits")
        loss = causal_lm_loss(logits, target, VOCAB, chunk_elements=chunk_elements)
        loss.backward()
    return tracker.peak_parts().get("temporary", 0) + tracker.peak_parts().get("activation", 0), logits.numel() * 4


def test_chunks_keep_one_logits_sized_tensor_at_the_peak_where_hf_s_loss_keeps_three():
    whole, logits_bytes = _backward_peak(chunk_elements=2**40)
    chunked, _ = _backward_peak(chunk_elements=logits_bytes // 4 // 16)  # 16 chunks
    assert whole >= 3 * logits_bytes  # log-probabilities, their gradient, the logits' gradient
    assert chunked <= 1.5 * logits_bytes  # the logits' gradient, and one chunk's three
