"""Achieved TFLOP/s, MFU and memory per rank (hf_asyncpp/utilization.py): model FLOPs per token counted
as PaLM does, against a count written out by hand from a config's numbers."""

from __future__ import annotations

import types

import pytest
import torch

from hf_asyncpp.models.presets import build_config
from hf_asyncpp.utilization import Utilization, model_flops_per_token, peak_tflops


def test_model_flops_per_token_of_a_moe_written_out_from_its_config():
    c = build_config("tiny-qwen3-moe")
    h, heads, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attention = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q, k, v, o; q and k norms
    experts = c.num_experts * (2 * c.moe_intermediate_size * h + h * c.moe_intermediate_size)
    per_layer = attention + c.num_experts * h + 2 * h + experts * c.num_experts_per_tok / c.num_experts
    touched = c.num_hidden_layers * per_layer + h + c.vocab_size * h  # + final norm, LM head (no embedding)
    seq = 128
    expected = 6 * touched + 12 * c.num_hidden_layers * heads * d * seq
    assert model_flops_per_token(c, seq) == pytest.approx(expected, rel=1e-12)


def test_a_tied_lm_head_counts_once_as_a_product():
    c = build_config("tiny-qwen3-moe")
    untied = model_flops_per_token(c, 64)
    c.tie_word_embeddings = True
    assert model_flops_per_token(c, 64) == pytest.approx(untied)


def test_mfu_needs_a_peak_and_memory_is_reported_per_rank_by_kind_of_device():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), 50.0) == 50.0
    result = types.SimpleNamespace(peak_memory_gib_per_rank=[1.5, 2.5], reserved_memory_gib_per_rank=[0.0, 0.0])
    cpu = Utilization(build_config("tiny-moe"), 32, 2, torch.device("cpu"))
    fields = cpu.fields(result, tokens_per_second=1000.0)
    assert fields["train_tflops_per_device"] == pytest.approx(cpu.flops_per_token * 1000 / 2 / 1e12)
    assert fields["mfu"] is None and fields["peak_rss_gib_per_rank"] == [1.5, 2.5] and fields["max_memory_gib"] == 2.5
    with_peak = Utilization(build_config("tiny-moe"), 32, 2, torch.device("cpu"), configured_peak=1e-6)
    assert with_peak.fields(result, 1000.0)["mfu"] == pytest.approx(fields["train_tflops_per_device"] / 1e-6)
