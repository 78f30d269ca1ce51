"""Fake-tensor kernels that accept what the CPU's kernels accept.

Stages run on fake tensors to learn their inputs and outputs (stage_io.py) and to plan a rank's memory
(plan.py). torch's shape function for `_grouped_mm` (the MoE experts' kernel transformers picks) checks
its inputs as CUDA's kernel does, bf16 only, while the CPU kernel also takes fp32: for fp32 CPU inputs
the shape is computed as for bf16 and the result has their dtype. Registered in fake tensor mode's own
table, so real and meta tensors are untouched.
"""

from __future__ import annotations

import torch
from ..torch_internals import FakeTensor, fake_impls

__all__ = ["register_fake_kernels"]

_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _grouped_mm(fake_mode, func, a, b, *args, **kwargs):
    fp32_on_cpu = a.dtype == b.dtype == torch.float32 and a.fake_device.type == "cpu"
    with fake_impls.in_kernel_invocation_manager(fake_mode):  # fake tensors act as meta ones in here
        out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args, **kwargs) if fp32_on_cpu else func(a, b, *args, **kwargs)
        if fp32_on_cpu:
            out = torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device="meta")
    return FakeTensor(fake_mode, out, a.fake_device)


def register_fake_kernels() -> None:
    """Make fake tensors take what the CPU's kernels take (once per process)."""
    if _GROUPED_MM not in fake_impls.op_implementations_dict:
        fake_impls.register_op_impl(_GROUPED_MM)(_grouped_mm)
