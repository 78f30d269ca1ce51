"""A training checkpoint as an HF model directory, on one process (`hf-asyncpp export`).

A checkpoint of any pp × dp layout (FSDP2 shards included) holds the master weights as whole HF
names, `model.<name>` (training_state.py), beside the model's config.json and tokenizer.
torch.distributed.checkpoint reads any subset of its entries into whole tensors without a process
group, so the export needs no pipeline: it reads the weights a group of whole decoder layers at a
time (up to max_shard_size of them, or one layer if that is larger), converts each group with
hf_export's conversion (the names save_pretrained writes, in the export dtype) and writes its files
through hf_export's writers. The file layout is planned first on meta tensors (sizes and names
only), so each group is read once and memory holds one group: a model below max_shard_size is one
model.safetensors, as save_pretrained writes it, a larger one shards and an index. Before that, the
manifest's sizes and checksums are checked (every file read once), as a resume checks them.

The weights are the stages' master weights at the checkpoint's step, the same tensors the run's own
export writes from its stages (bit for bit for a synchronous run saved at its last step; an
asynchronous run's export also applies the update still pending at the end).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from ..resilience import NonFiniteError, first_nonfinite
from .checkpoints import CheckpointError, find_checkpoint, verify_checkpoint, verify_checksums
from .hf_export import (coverage_problem, export_dtype, meta_model, on_disk_state, size_limit, tensor_bytes,
                        write_index, write_model_files, write_one_file, write_shards)

__all__ = ["export_checkpoint", "write_hf_weights"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _layer_units(names: list[str], model) -> list[list[str]]:
    """The names in the model's order, cut into units that convert on their own: a decoder layer's
    tensors together (fused experts), every other tensor alone."""
    order = {n: i for i, n in enumerate(model.state_dict())}
    units: list[list[str]] = []
    previous = None
    for name in sorted(names, key=lambda n: (order.get(n, len(order)), n)):
        layer = _LAYER.match(name)
        key = layer.group(1) if layer else name
        if units and key == previous and layer:
            units[-1].append(name)
        else:
            units.append([name])
        previous = key
    return units


def _plan(saved: dict, model, dtype: torch.dtype, limit: int) -> list[tuple[list[str], object]]:
    """Groups of names to read together, each with its on-disk shard plan, from the metadata alone."""
    def meta(names):
        return {n: torch.empty(saved[n].size, dtype=saved[n].properties.dtype, device="meta") for n in names}

    groups: list[list[str]] = []
    size = 0
    for unit in _layer_units(list(saved), model):
        unit_size = tensor_bytes(on_disk_state(meta(unit), model, dtype))
        if groups and size + unit_size <= limit:
            groups[-1] += unit
            size += unit_size
        else:
            groups.append(list(unit))
            size = unit_size
    plans = [(names, split_torch_state_dict_into_shards(on_disk_state(meta(names), model, dtype), max_shard_size=limit))
             for names in groups]
    problem = coverage_problem(model, {k for _, plan in plans for k in plan.tensor_to_filename})
    if problem:
        raise CheckpointError(problem)
    return plans


def _read(reader: FileSystemReader, saved: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """Whole tensors of `names` (assembled from however many shards the ranks wrote)."""
    state = {f"model.{n}": torch.empty(saved[n].size, dtype=saved[n].properties.dtype) for n in names}
    with warnings.catch_warnings():  # that one process reads it is the point, not a mistake to warn of
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
    return {k[len("model."):]: v for k, v in state.items()}


def _checked_output(out_dir: Path) -> Path:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty directory: choose a new OUT_DIR (nothing is replaced)")
    return out_dir


def write_hf_weights(checkpoint: Path, out_dir: Path, model_config, dtype: torch.dtype, limit: int) -> None:
    """The master weights the distributed checkpoint files in `checkpoint` hold, written to `out_dir` as
    `save_pretrained` writes them (one model.safetensors below `limit` bytes, shards and an index above),
    a group of layers at a time. NonFiniteError for a tensor holding a NaN or an infinity."""
    reader = FileSystemReader(checkpoint)
    saved = {k[len("model."):]: v for k, v in reader.read_metadata().state_dict_metadata.items()
             if k.startswith("model.")}
    model = meta_model(model_config)
    plans = _plan(saved, model, dtype, limit)
    n_files = sum(len(plan.filename_to_tensors) for _, plan in plans)
    one_file = len(plans) == 1 and n_files == 1
    weight_map, first, total = {}, 0, 0
    for names, plan in plans:
        state = _read(reader, saved, names)
        bad = first_nonfinite(state.items())
        if bad is not None:
            raise NonFiniteError(f"not exporting {checkpoint}: {bad} holds non-finite values")
        disk = on_disk_state(state, model, dtype)
        del state
        total += tensor_bytes(disk)
        if one_file:
            write_one_file(disk, out_dir)
        else:
            weight_map.update(write_shards(disk, first, n_files, out_dir, plan))
            first += len(plan.filename_to_tensors)
    if not one_file:
        write_index(out_dir, total, weight_map)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
                      model_card: Callable[[dict, object], str] | None = None) -> Path:
    """Write `checkpoint`'s weights as an HF model directory in `out_dir` (which must be new or
    empty), in `dtype` (float32 / bfloat16; by default the run's export_dtype), with the run's config,
    generation config, tokenizer and `model_card(pipeline_state, model_config)` as README.md.
    CheckpointError / ValueError before anything is written if the input is unusable."""
    from transformers import AutoConfig, AutoTokenizer

    path = find_checkpoint(str(Path(checkpoint).absolute()), None)  # a directory, even one named "latest"
    run_state = verify_checkpoint(path)
    out_dir = _checked_output(Path(out_dir))
    verify_checksums(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path} holds no config.json (it was saved without the model's config)")
    model_config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").is_file() else None
    weights_dtype = export_dtype(dtype or run_state["config"].get("export_dtype", "float32"))
    limit = size_limit(run_state["config"].get("max_shard_size", "5GB"))
    card = model_card(run_state, model_config) if model_card is not None else None

    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_hf_weights(path, staging, model_config, weights_dtype, limit)
        write_model_files(staging, model_config, tokenizer, weights_dtype, card)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
