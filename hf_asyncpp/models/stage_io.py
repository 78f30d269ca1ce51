"""What each pipeline stage receives and sends, known before any message is exchanged.

torch's PipelineStage learns the shapes of its inputs and outputs either from the caller (static) or
by a round of metadata messages through the whole pipeline at the first step (dynamic), after a vote
over all stages that reads its result on the host. Given them at construction, every rank knows its
receive buffers at once: no metadata round, no host read at the start, nothing to receive from a peer
that a one-rank memory plan (plan.py) does not have. They are computed here by running all stages of
the model in sequence on fake CPU tensors (no memory, no initialization; the meta device would send
MoE experts down another path than a CPU or a GPU takes): the same modules and forward the pipeline
runs, with the parameters in the compute dtype, as FSDP2 or the version store casts them.
"""

from __future__ import annotations

import torch
from ..torch_internals import FakeTensorMode, unset_fake_temporarily

from ..parallel.fsdp import keeps_fp32
from .construct import meta_model
from .fake_kernels import register_fake_kernels
from .split import StagePlan, build_stage_modules

__all__ = ["stage_io"]


def _as_tuple(output) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@torch.no_grad()
def _cast(stage: torch.nn.Module, dtype: torch.dtype) -> None:
    for name, param in stage.named_parameters():
        if not keeps_fp32(name, stage.fp32_patterns):
            param.data = param.data.to(dtype)


def stage_io(model_config, plan: StagePlan, micro_batch_size: int, seq_len: int,
             dtype: torch.dtype | None) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Per stage of `plan`, (example inputs, example outputs) as meta tensors: the token ids (first
    stage) or the previous stage's outputs, and what the stage returns, for one microbatch of
    `micro_batch_size` × `seq_len` tokens computed in `dtype` (None: fp32)."""
    register_fake_kernels()
    with unset_fake_temporarily():  # a mode of its own, whether or not the caller runs under one
        stages = build_stage_modules(meta_model(model_config), plan, list(range(len(plan))))
        io = []
        with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad():  # meta modules move in
            inputs: tuple[torch.Tensor, ...] = (torch.zeros(micro_batch_size, seq_len, dtype=torch.long),)
            for stage in stages:
                stage.to_empty(device="cpu")
                if dtype is not None:
                    _cast(stage, dtype)
                outputs = _as_tuple(stage(*inputs))
                io.append((inputs, outputs))
                # What the next stage receives: a leaf that requires grad where this stage's output does.
                inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)
        return [tuple(tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                            .requires_grad_(t.requires_grad) for t in ts) for ts in pair) for pair in io]
