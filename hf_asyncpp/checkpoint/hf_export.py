"""Export the pipelined model as an ordinary HF model directory (`from_pretrained` loads it).

Each pipeline stage holds its parameters under their HF names; the first data-parallel replica of
every stage sends them to global rank 0, which assembles the model and writes it with
`save_pretrained` — so the safetensors keys are exactly the ones transformers writes (per-expert
on-disk names included) — plus the tokenizer and generation config. The directory is written under a
temporary name and renamed at the end, so a crash never leaves a complete-looking export.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

__all__ = ["gather_full_state_dict", "export_hf_model"]


def gather_full_state_dict(stage_state: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on global rank 0 (None elsewhere)."""
    if layout.dp_rank != 0:
        return None
    parts = [None] * layout.pp_size if layout.rank == 0 else None
    dist.gather_object(stage_state, parts, group=layout.pp_group, group_dst=0)
    if parts is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part)
    return full


def export_hf_model(full_state: dict[str, torch.Tensor], model_config, tokenizer, out_dir: str | Path) -> Path:
    """Write `full_state` as an HF model directory at out_dir (call on one process)."""
    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(full_state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"stage parameters do not cover the model: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(staging)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir
