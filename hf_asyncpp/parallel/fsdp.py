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

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["compute_dtype", "fully_shard_stage", "gather_whole", "keeps_fp32", "shard_parameters"]

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


def gather_whole(tensors: dict[str, torch.Tensor], dtype_of: Callable[[str, torch.Tensor], torch.dtype]
                 ) -> dict[str, torch.Tensor]:
    """Whole, detached copies of `tensors` in the dtype `dtype_of(name, tensor)` names. The row shards
    (Shard(0) DTensors over one dp mesh, `shard_parameters`) are cast first and gathered in one
    all-gather per dtype: a bf16 compute copy moves half the bytes of an fp32 gather, in one collective
    instead of one per parameter. Casting before the gather gives the same values as after it."""
    whole: dict[str, torch.Tensor] = {}
    buckets: dict[torch.dtype, list[tuple[str, DTensor]]] = {}
    for name, tensor in tensors.items():
        dtype = dtype_of(name, tensor)
        if isinstance(tensor, DTensor) and tensor.placements[0].is_shard(0):
            buckets.setdefault(dtype, []).append((name, tensor))
        else:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # replicated (0-d)
            whole[name] = local.detach().to(dtype)
    for dtype, sharded in buckets.items():
        whole.update(_gather_rows(sharded, dtype))
    return {name: whole[name] for name in tensors}


def _gather_rows(sharded: list[tuple[str, DTensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One all-gather of row shards. Shard(0) gives rank i the rows [i·r, min((i+1)·r, n)) with
    r = ⌈n / dp⌉, so each rank pads its rows to r: rank i's padded block is then rows [i·r, (i+1)·r)
    of the whole tensor and the padding all lies beyond row n."""
    mesh = sharded[0][1].device_mesh
    dp = mesh.size()
    rows = [math.ceil(t.shape[0] / dp) for _, t in sharded]
    blocks = []
    for (_, tensor), r in zip(sharded, rows):
        local = tensor.to_local().detach().to(dtype)
        missing_rows = r - local.shape[0]
        blocks.append(torch.nn.functional.pad(local.reshape(-1), (0, missing_rows * math.prod(tensor.shape[1:]))))
    mine = torch.cat(blocks)
    everyone = torch.empty(dp * mine.numel(), dtype=dtype, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine, group=mesh.get_group())
    everyone = everyone.view(dp, -1)
    whole, offset = {}, 0
    for (name, tensor), r in zip(sharded, rows):
        size = r * math.prod(tensor.shape[1:])
        padded = everyone[:, offset:offset + size].reshape(dp * r, *tensor.shape[1:])
        whole[name] = padded[: tensor.shape[0]].clone()
        offset += size
    return whole
