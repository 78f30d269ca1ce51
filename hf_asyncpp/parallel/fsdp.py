"""Sharding a stage over its data-parallel replicas (FSDP2 on the "dp" dimension of the mesh).

Synchronous schedules: `fully_shard` on every decoder layer, then on the stage (embeddings, norm,
lm_head), with `reshard_after_forward=False`: a pipeline runs several microbatches' forwards before
their backwards, and re-gathering a layer for each would multiply the all-gathers. torch's pipeline
runtime recognises the FSDP stage: it gathers before the first compute, accumulates unsharded
gradients over the microbatches and reduce-scatters them (averaged over dp) once per step.

Asynchronous schedules stash weight versions, and a microbatch must run on its own version while
others run on another; fully_shard keeps one unsharded copy per parameter, so those stages are
sharded by `shard_parameters` instead: the same Shard(0) layout over dp, with gathering done by
the version store (update/versions.py). Either way, every parameter is then a DTensor
holding 1/dp of the rows, and so are its gradient, optimizer state (zeros_like) and EF buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ..torch_internals import all_gather_flat, reduce_scatter_flat

__all__ = ["compute_dtype", "fully_shard_stage", "gather_whole", "keeps_fp32", "reduce_dtype",
           "reduce_scatter_rows", "shard_parameters", "unshard_parameters"]

_DTYPES = {"no": None, "bf16": torch.bfloat16}


def compute_dtype(mixed_precision: str, device: torch.device, fsdp: bool) -> torch.dtype | None:
    """The dtype forward/backward run in (None: the parameters' fp32). `auto`: bf16 on GPUs under FSDP2,
    which applies it to synchronous stages; without FSDP2 every stage, versioned or not, stays fp32, so
    synchronous and asynchronous runs differ in delay only (config checks refuse bf16 without FSDP2)."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and fsdp else None
    return _DTYPES[mixed_precision]


def keeps_fp32(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether parameter `name` is one the model class keeps in fp32 (`_keep_in_fp32_modules_strict`
    entries name a module or a parameter by suffix)."""
    module = name.rpartition(".")[0]
    return any(name.endswith(p) or module.endswith(p) for p in patterns)


def reduce_dtype(grad_reduce_dtype: str, compute: torch.dtype | None) -> torch.dtype:
    """The dtype gradients are averaged over dp in (`grad_reduce_dtype`). fp32 by default: each
    replica's sum over its microbatches is fp32 already, and rounding it to bf16 before averaging adds
    an error of bf16 compute's own size to every update; "compute" halves the bytes moved."""
    return compute if grad_reduce_dtype == "compute" and compute is not None else torch.float32


def fully_shard_stage(stage: nn.Module, dp_mesh: DeviceMesh, dtype: torch.dtype | None = None,
                      reduce: torch.dtype = torch.float32) -> nn.Module:
    """FSDP2 per decoder layer and on the stage root; gradients are reduced in `reduce` (`reduce_dtype`).
    Modules whose parameters the model keeps in fp32 get their own FSDP unit with an fp32 policy."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce if dtype else None)
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in stage.model.layers.values():
        if dtype is not None:
            for name, module in layer.named_modules():
                params = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
                if name and any(keeps_fp32(p, stage.fp32_patterns) for p in params):
                    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=fp32_policy)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    # The stage's own inputs are not cast: token ids, activations already in the compute dtype, and the
    # fp32 router statistics carried from stage to stage, which bf16 would round (counts above 256) where
    # a versioned stage keeps them exact. Each decoder layer's unit still casts what enters it.
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False, mp_policy=replace(policy, cast_forward_inputs=False))
    return stage


@torch.no_grad()
def shard_parameters(module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replace each parameter by a DTensor holding this rank's rows (Shard(0); 0-d ones replicated).
    Every rank holds the same full values before, so no data moves (src_data_rank=None). Parameters
    that are DTensors already (loaded as shards) stay as they are."""
    for submodule in module.modules():
        for name, param in list(submodule.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            placements = [Shard(0)] if param.ndim > 0 else [Replicate()]
            sharded = distribute_tensor(param.detach(), dp_mesh, placements, src_data_rank=None)
            setattr(submodule, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return module


@torch.no_grad()
def unshard_parameters(module: nn.Module) -> nn.Module:
    """The inverse of `shard_parameters`: every DTensor parameter made whole again (bucketed
    all-gathers), as `fully_shard` wants its parameters."""
    sharded = {name: p for name, p in module.named_parameters() if isinstance(p, DTensor)}
    for name, whole in gather_whole(sharded, lambda _, t: t.dtype).items():
        owner, _, attr = name.rpartition(".")
        param = sharded[name]
        setattr(module.get_submodule(owner), attr, nn.Parameter(whole, requires_grad=param.requires_grad))
    return module


def gather_whole(tensors: dict[str, torch.Tensor], dtype_of: Callable[[str, torch.Tensor], torch.dtype]
                 ) -> dict[str, torch.Tensor]:
    """Whole, detached copies of `tensors` in the dtype `dtype_of(name, tensor)` names. The row shards
    (Shard(0) DTensors over one dp mesh, `shard_parameters`) are cast first and gathered by dtype in
    buckets of about BUCKET_BYTES, one all-gather each: a bf16 compute copy moves half the bytes of an
    fp32 gather, in a few collectives instead of one per parameter. Casting before the gather gives
    the same values as after it."""
    whole: dict[str, torch.Tensor] = {}
    rows = []
    for name, tensor in tensors.items():
        dtype = dtype_of(name, tensor)
        if _is_row_shard(tensor):
            rows.append((name, tensor, dtype))
        else:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # replicated (0-d)
            whole[name] = local.detach().to(dtype)
    for dtype, bucket in _buckets(rows):
        whole.update(_gather_rows(bucket, dtype))
    return {name: whole[name] for name in tensors}


@torch.no_grad()
def reduce_scatter_rows(sums: dict[str, torch.Tensor], like: dict[str, DTensor], scale: float,
                        dtype_of: Callable[[str], torch.dtype] = lambda _: torch.float32) -> dict[str, DTensor]:
    """Gradients of the sharded parameters `like`: scale × the average over dp of each replica's whole
    `sums[name]`, as fp32 DTensors placed like `like[name]`. Reduced in `dtype_of(name)` (fp32 unless
    `reduce_dtype` says otherwise, as the synchronous stages' FSDP2 policy), by dtype in buckets of
    about BUCKET_BYTES, one reduce-scatter each. Row shards only; anything else is all-reduced by DTensor."""
    reduced: dict[str, DTensor] = {}
    rows = [(name, like[name], dtype_of(name)) for name in sums if _is_row_shard(like[name])]
    for dtype, bucket in _buckets(rows):
        reduced.update(_reduce_scatter_rows(bucket, sums, scale, dtype))
    for name in sums:
        if name not in reduced:  # replicated (0-d): an all-reduce
            param = like[name]
            partial = DTensor.from_local(sums[name].float(), param.device_mesh, [Partial("sum")], run_check=False)
            reduced[name] = partial.redistribute(param.device_mesh, param.placements).mul_(
                scale / param.device_mesh.size())
    return reduced


BUCKET_BYTES = 128 << 20  # whole bytes per collective: amortises its latency, bounds its flat copy


def _is_row_shard(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and tensor.placements[0].is_shard(0)


def _buckets(rows: list[tuple[str, DTensor, torch.dtype]]) -> list[tuple[torch.dtype, list[tuple[str, DTensor]]]]:
    """(dtype, bucket) of the row shards `rows` (name, tensor, the dtype it moves in): grouped by dtype,
    in order, each group cut where a bucket's whole bytes would pass BUCKET_BYTES (a larger tensor is
    a bucket of its own)."""
    by_dtype: dict[torch.dtype, list[tuple[str, DTensor]]] = {}
    for name, tensor, dtype in rows:
        by_dtype.setdefault(dtype, []).append((name, tensor))
    buckets: list[tuple[torch.dtype, list[tuple[str, DTensor]]]] = []
    for dtype, group in by_dtype.items():
        size = BUCKET_BYTES
        for name, tensor in group:
            nbytes = tensor.numel() * dtype.itemsize
            if size + nbytes > BUCKET_BYTES:
                buckets.append((dtype, []))
                size = 0
            buckets[-1][1].append((name, tensor))
            size += nbytes
    return buckets


def _padded_rows(tensor: DTensor) -> tuple[int, int]:
    """(r, elements per row): Shard(0) gives rank i the rows [i·r, min((i+1)·r, n)) with r = ⌈n / dp⌉,
    so rank i's block padded to r rows is rows [i·r, (i+1)·r) of the whole tensor, and the padding all
    lies beyond row n. Flat buffers hold these blocks side by side."""
    return math.ceil(tensor.shape[0] / tensor.device_mesh.size()), math.prod(tensor.shape[1:])


def _gather_rows(sharded: list[tuple[str, DTensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One all-gather of row shards."""
    mesh = sharded[0][1].device_mesh
    dp = mesh.size()
    blocks = []
    for _, tensor in sharded:
        r, per_row = _padded_rows(tensor)
        local = tensor.to_local().detach().to(dtype)
        blocks.append(torch.nn.functional.pad(local.reshape(-1), (0, (r - local.shape[0]) * per_row)))
    mine = torch.cat(blocks)
    everyone = torch.empty(dp * mine.numel(), dtype=dtype, device=mine.device)
    all_gather_flat(everyone, mine, group=mesh.get_group())
    everyone = everyone.view(dp, -1)
    whole, offset = {}, 0
    for name, tensor in sharded:
        r, per_row = _padded_rows(tensor)
        padded = everyone[:, offset:offset + r * per_row].reshape(dp * r, *tensor.shape[1:])
        whole[name] = padded[: tensor.shape[0]].clone()
        offset += r * per_row
    return whole


def _reduce_scatter_rows(sharded: list[tuple[str, DTensor]], sums: dict[str, torch.Tensor], scale: float,
                         dtype: torch.dtype) -> dict[str, DTensor]:
    """One reduce-scatter in `dtype`: every replica lays its whole tensors out as dp blocks of padded
    rows (block i: each tensor's rows [i·r, (i+1)·r)), and block i's sum over dp arrives at rank i."""
    mesh = sharded[0][1].device_mesh
    dp, me = mesh.size(), mesh.get_local_rank()
    blocks = []
    for name, tensor in sharded:
        r, per_row = _padded_rows(tensor)
        flat = sums[name].detach().to(dtype).reshape(-1)
        blocks.append(torch.nn.functional.pad(flat, (0, (dp * r - tensor.shape[0]) * per_row)).view(dp, -1))
    everyone = torch.cat(blocks, dim=1).reshape(-1)
    mine = torch.empty(everyone.numel() // dp, dtype=dtype, device=everyone.device)
    reduce_scatter_flat(mine, everyone, group=mesh.get_group())
    mine = mine.float().mul_(scale / dp)
    reduced, offset = {}, 0
    for name, tensor in sharded:
        r, per_row = _padded_rows(tensor)
        rows = max(0, min(r, tensor.shape[0] - me * r))
        local = mine[offset:offset + rows * per_row].view(rows, *tensor.shape[1:])
        reduced[name] = DTensor.from_local(local, mesh, tensor.placements, run_check=False,
                                           shape=tensor.shape, stride=tensor.stride())
        offset += r * per_row
    return reduced
