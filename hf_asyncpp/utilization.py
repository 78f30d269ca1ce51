"""How well a run uses its devices: achieved TFLOP/s and MFU, and each rank's peak memory.

Per token of training (forward and backward), PaLM's count: 6 × the parameters a token touches, plus
12 × layers × attention width (heads × head dim) × sequence length for the attention scores and values
(causal attention counted whole, recomputation not counted). The parameters a token touches: every
weight it is multiplied by — attention, routers, norms, dense MLPs, the LM head — and of each MoE
layer's routed experts top-k / n_experts of them; the embedding lookup is no product. MFU is model
FLOPs over time over the device's peak: bf16 dense tensor-core peaks of known GPUs, or `peak_tflops`.
Memory per rank: on a GPU the caching allocator's `max_memory_allocated` and `max_memory_reserved`, on a
CPU the peak resident set size (metrics.memory_peaks, gathered with the step's statistics).
"""

from __future__ import annotations

import torch

__all__ = ["FIELDS", "PEAK_TFLOPS", "Utilization", "active_parameters", "attention_flops_per_token", "model_flops_per_token",
           "peak_tflops"]

# The keys a step record gets from here (`Utilization.fields`): measurements of the machine, which differ
# between runs of the same numerics.
FIELDS = ("train_tflops_per_device", "mfu", "max_memory_gib", "peak_rss_gib_per_rank",
          "max_memory_allocated_gib_per_rank", "max_memory_reserved_gib_per_rank")

# bf16 dense tensor-core peaks (TFLOP/s), by a name the device reports (SXM parts; a PCIe card's is lower:
# pass `peak_tflops`). Checked in order: "GH200" before "H200".
PEAK_TFLOPS = {"GH200": 989.0, "H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0}


def _expert_share(model_config) -> float:
    experts = getattr(model_config, "num_experts", None) or getattr(model_config, "num_local_experts", None) \
        or getattr(model_config, "n_routed_experts", None)
    top_k = getattr(model_config, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0


def active_parameters(named_parameters, model_config) -> float:
    """The parameters among `named_parameters` a token is multiplied by (routed experts scaled by top-k /
    n_experts, the embedding table left out)."""
    share = _expert_share(model_config)
    total = 0.0
    for name, param in named_parameters:
        if "embed_tokens" in name:
            continue
        routed = ".experts." in name and "shared_expert" not in name
        total += param.numel() * (share if routed else 1.0)
    return total


def attention_flops_per_token(model_config, n_layers: int, seq_len: int) -> float:
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 12.0 * n_layers * heads * head_dim * seq_len


def model_flops_per_token(model_config, seq_len: int) -> float:
    """Training FLOPs per token of the whole model (built on the meta device: nothing is allocated)."""
    from .models.construct import meta_model

    model = meta_model(model_config)
    touched = active_parameters(model.named_parameters(), model_config)
    if not any("lm_head" in name for name, _ in model.named_parameters()):  # tied: the table is the LM head too
        touched += model_config.vocab_size * model_config.hidden_size
    return 6.0 * touched + attention_flops_per_token(model_config, model_config.num_hidden_layers, seq_len)


def peak_tflops(device: torch.device, configured: float | None = None) -> float | None:
    """The device's peak TFLOP/s for MFU: `configured` if given, else a known GPU's bf16 dense peak;
    None on a CPU or an unknown GPU (MFU is then not reported)."""
    if configured:
        return configured
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


class Utilization:
    """What a run's logged records say of its devices, from its model and layout."""

    def __init__(self, model_config, seq_len: int, world_size: int, device: torch.device, configured_peak: float = 0.0):
        self.flops_per_token = model_flops_per_token(model_config, seq_len)
        self.world_size, self.on_gpu = world_size, device.type == "cuda"
        self.peak = peak_tflops(device, configured_peak)

    def fields(self, result, tokens_per_second: float) -> dict:
        """`train_tflops_per_device` (model FLOPs of the tokens per second, over the devices), `mfu` (None
        without a peak), and the memory per rank in GiB."""
        tflops = self.flops_per_token * tokens_per_second / self.world_size / 1e12
        memory = ({"max_memory_allocated_gib_per_rank": result.peak_memory_gib_per_rank,
                   "max_memory_reserved_gib_per_rank": result.reserved_memory_gib_per_rank} if self.on_gpu
                  else {"peak_rss_gib_per_rank": result.peak_memory_gib_per_rank})
        return {"train_tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                "max_memory_gib": max(result.peak_memory_gib_per_rank), **memory}
