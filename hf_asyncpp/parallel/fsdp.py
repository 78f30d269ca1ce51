"""Sharding a stage over its data-parallel replicas (FSDP2 on the "dp" dimension of the mesh).

Synchronous schedules: `fully_shard` on every decoder layer, then on the stage (embeddings, norm,
lm_head), with `reshard_after_forward=False`: a pipeline runs several microbatches' forwards before
their backwards, and re-gathering a layer for each would multiply the all-gathers. torch's pipeline
runtime recognises the FSDP stage: it gathers before the first compute, accumulates unsharded
gradients over the microbatches and reduce-scatters them (averaged over dp) once per step.

Asynchronous schedules stash weight versions, and a microbatch must run on its own version while
others run on another; fully_shard keeps one unsharded copy per parameter, so those stages are
sharded by `shard_parameters` instead: the same Shard(0) layout over dp, with gathering done by
the version store (schedules/weight_versions.py). Either way, every parameter is then a DTensor
holding 1/dp of the rows, and so are its gradient, optimizer state (zeros_like) and EF buffer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

__all__ = ["compute_dtype", "fully_shard_stage", "keeps_fp32", "shard_parameters"]

_DTYPES = {"no": None, "bf16": torch.bfloat16}


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype forward/backward run in (None: the parameters' fp32). `auto`: bf16 on GPUs."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return _DTYPES[mixed_precision]


def keeps_fp32(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether parameter `name` is one the model class keeps in fp32 (`_keep_in_fp32_modules_strict`
    entries name a module or a parameter by suffix)."""
    module = name.rpartition(".")[0]
    return any(name.endswith(p) or module.endswith(p) for p in patterns)


def fully_shard_stage(stage: nn.Module, dp_mesh: DeviceMesh, dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 per decoder layer and on the stage root; gradients are reduced in fp32. Modules whose
    parameters the model keeps in fp32 get their own FSDP unit with an fp32 policy."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in stage.model.layers.values():
        if dtype is not None:
            for name, module in layer.named_modules():
                params = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
                if name and any(keeps_fp32(p, stage.fp32_patterns) for p in params):
                    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=fp32_policy)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    return stage


@torch.no_grad()
def shard_parameters(module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replace each parameter by a DTensor holding this rank's rows (Shard(0); 0-d ones replicated).
    Every rank holds the same full values before, so no data moves (src_data_rank=None)."""
    for submodule in module.modules():
        for name, param in list(submodule.named_parameters(recurse=False)):
            placements = [Shard(0)] if param.ndim > 0 else [Replicate()]
            sharded = distribute_tensor(param.detach(), dp_mesh, placements, src_data_rank=None)
            setattr(submodule, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return module
