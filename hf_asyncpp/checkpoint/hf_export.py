"""Export the pipelined model as an ordinary HF model directory (`from_pretrained` loads it).

Each pipeline stage holds its parameters under their HF names. `export_hf_model` has the
first data-parallel replica of every stage convert its own part to the names `save_pretrained`
writes on disk (transformers' `revert_weight_conversion`: fused expert tensors become per-expert
weights) and write it: below `max_shard_size` in all, the parts go to global rank 0, which writes
one `model.safetensors`; above it, every stage writes its own shard files in parallel
(`model-0000i-of-0000N.safetensors`) and rank 0 writes `model.safetensors.index.json`, so no rank
ever holds more than its stages. Rank 0 adds config.json, generation_config.json and the tokenizer.
The directory is written under a temporary name and renamed at the end, so a crash never leaves a
complete-looking export; weights holding a NaN or an infinity are refused before anything is
written. What is exported is each stage's master copy: the newest weights, with
Error Feedback's correction applied (the extrapolated point, not a stashed version).

The weights are written in `export_dtype` (float32, or bfloat16 cast from the fp32 masters except
what transformers itself keeps in fp32 at that dtype). `checkpoint_export.py` writes the same files
from a training checkpoint on one process, through the same conversion and file writers.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.core_model_loading import build_glob_alternation, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from ..resilience import NonFiniteError, first_nonfinite

__all__ = ["EXPORT_DTYPES", "export_dtype", "export_hf_model", "gather_full_state_dict", "on_disk_state",
           "write_model_files"]

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def export_dtype(name: str) -> torch.dtype:
    """The dtype an export writes its weights in: float32 or bfloat16 (fp32, bf16); ValueError otherwise."""
    dtype = EXPORT_DTYPES.get(_SHORT_NAMES.get(name, name))
    if dtype is None:
        raise ValueError(f"unknown export dtype '{name}'; choose float32 (fp32) or bfloat16 (bf16)")
    return dtype


def gather_full_state_dict(stage_state: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on global rank 0 (None elsewhere)."""
    if layout.dp_rank != 0:
        return None
    parts = [None] * layout.pp_size if layout.rank == 0 else None
    dist.gather_object(stage_state, parts, group=layout.io_pp_group, group_dst=0)
    if parts is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part)
    return full


def meta_model(model_config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def _cast(state: dict[str, torch.Tensor], model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in `dtype`, except those from_pretrained keeps in fp32 at that dtype (its
    `dtype_plan`: e.g. DeepSeek-V3's router), so loading the export reads back exactly these values."""
    plan = model._get_dtype_plan(dtype)
    kept = build_glob_alternation(list(plan))[0] if plan else None
    return {k: v.to(torch.float32 if kept is not None and kept.search(k) else dtype) if v.is_floating_point() else v
            for k, v in state.items()}


def on_disk_state(state: dict[str, torch.Tensor], model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`state` (in-memory HF names, whole layers) in `dtype`, under the names and layout save_pretrained writes."""
    disk = revert_weight_conversion(model, remove_tied_weights_from_state_dict(_cast(state, model, dtype), model))
    # Per-expert weights are views of one fused tensor; safetensors stores tensors that own their memory.
    return {k: v.detach().contiguous().clone() for k, v in disk.items()}


def coverage_problem(model, written: set[str]) -> str | None:
    """What is wrong when the written on-disk names are not exactly the model's (None when they are)."""
    expected = set(on_disk_state(model.state_dict(), model))
    if written == expected:
        return None
    return (f"stage parameters do not cover the model: missing {sorted(expected - written)}, "
            f"unexpected {sorted(written - expected)}")


def size_limit(max_shard_size: str | int) -> int:
    return parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size


def tensor_bytes(disk: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in disk.values())


def write_one_file(disk: dict, directory: Path) -> None:
    """The whole model in model.safetensors, as save_pretrained writes a model below max_shard_size."""
    save_file(disk, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_index(directory: Path, total: int, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_shards(disk: dict, first_index: int, n_files: int, directory: Path, plan) -> dict[str, str]:
    weight_map = {}
    for i, names in enumerate(plan.filename_to_tensors.values()):
        filename = f"model-{first_index + i + 1:05d}-of-{n_files:05d}.safetensors"
        save_file({n: disk[n] for n in names}, str(directory / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    return weight_map


def write_model_files(directory: Path, model_config, tokenizer, dtype: torch.dtype | None = None,
                      model_card: str | None = None) -> None:
    """config.json (stating `dtype` when given), generation_config.json, the tokenizer's files (when
    there is one) and the card as README.md: everything of an HF model directory but its weights."""
    if dtype is not None:
        model_config = copy.deepcopy(model_config)
        model_config.dtype = dtype
    model_config.save_pretrained(directory)
    generation = GenerationConfig.from_model_config(model_config)
    if generation is not None:
        generation.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if model_card is not None:
        (directory / "README.md").write_text(model_card)


def _write_stage_files(stage_state, layout, model_config, staging: Path, max_shard_size, dtype) -> str | None:
    """This stage's part of the weights files (dp rank 0 of every stage); a message if the stages do
    not cover the model (then nothing is written)."""
    model = meta_model(model_config)
    disk = on_disk_state(stage_state, model, dtype)
    plan = split_torch_state_dict_into_shards(disk, max_shard_size=max_shard_size)
    parts = [None] * layout.pp_size
    dist.all_gather_object(parts, (sorted(disk), tensor_bytes(disk), len(plan.filename_to_tensors)), group=layout.io_pp_group)
    problem = coverage_problem(model, {k for keys, _, _ in parts for k in keys})
    if problem:
        return problem
    total = sum(size for _, size, _ in parts)
    if total <= size_limit(max_shard_size):
        gathered = [None] * layout.pp_size if layout.rank == 0 else None
        dist.gather_object(disk, gathered, group=layout.io_pp_group, group_dst=0)
        if layout.rank == 0:
            write_one_file({k: v for part in gathered for k, v in part.items()}, staging)
        return None
    first = sum(n for _, _, n in parts[:layout.pp_rank])
    weight_map = write_shards(disk, first, sum(n for _, _, n in parts), staging, plan)
    maps = [None] * layout.pp_size if layout.rank == 0 else None
    dist.gather_object(weight_map, maps, group=layout.io_pp_group, group_dst=0)
    if layout.rank == 0:
        write_index(staging, total, {k: v for m in maps for k, v in m.items()})
    return None


def export_hf_model(stage_state: dict[str, torch.Tensor], layout, model_config, tokenizer, out_dir,
                    max_shard_size: str | int = "5GB", model_card: str | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the whole model from the stages (collective: every rank calls it with its stages' whole
    tensors, `PipelineEngine.stage_state_dict()`), with `model_card` (rank 0's) as README.md and the
    weights in `dtype`. Returns the directory."""
    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    found = [None] * layout.world_size
    dist.all_gather_object(found, first_nonfinite(stage_state.items()), group=layout.io_group)
    if any(found):
        raise NonFiniteError(f"not exporting to {out_dir}: {next(f for f in found if f)} holds non-finite values")
    if layout.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier(group=layout.io_group)
    problem = [None]
    if layout.dp_rank == 0:  # one writer per stage; the pp group of dp rank 0 holds every stage once
        problem = [_write_stage_files(stage_state, layout, model_config, staging, max_shard_size, dtype)]
    dist.broadcast_object_list(problem, src=0, group=layout.io_group)  # every rank stops, or goes on, together
    if problem[0]:
        if layout.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(problem[0])
    if layout.is_main:
        write_model_files(staging, model_config, tokenizer, dtype, model_card)
    dist.barrier(group=layout.io_group)
    if layout.is_main:
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    dist.barrier(group=layout.io_group)
    return out_dir
