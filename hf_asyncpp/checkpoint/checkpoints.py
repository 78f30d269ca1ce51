"""Training checkpoints on disk: `<output_dir>/checkpoint-<step>/`, written atomically, verified on load.

A checkpoint is written by all ranks (saving.py: in the background while training goes on) into
`checkpoint-<step>.partial/` with torch.distributed.checkpoint (each rank its own shards, in parallel), beside the model's config.json,
generation_config.json and tokenizer files (rank 0); the ranks then hash the files between them
(each file once, in parallel), and rank 0 adds `trainer_state.json` (transformers' `TrainerState`:
`TrainerState.load_from_json` reads it), `pipeline_state.json` (what this library resumes from: the
step, the pipeline layout, the config, the front end's own state), `data_positions.json` (where each
dp rank's streamed dataset continues, one entry per dp rank, from the ranks that read data; absent for
data in memory) and `manifest.json` (every file's size and SHA-256), and renames the directory. Only a
directory without the `.partial` suffix and with a manifest counts as a checkpoint: a crash at any
point before the rename leaves nothing that looks complete, and the previous checkpoints are
untouched (the oldest are removed only after the new one is complete, `save_total_limit`).

Before any process group starts, a resume checks the manifest: every file present with its size
(`verify_checkpoint`, no file read). Checksums are checked at load, by the ranks between them
(`verify_checksums`): no rank reads the whole checkpoint to verify it. Both name the bad file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from ..resilience import RunFailure
from .training_state import load_training_state

__all__ = ["CheckpointError", "digest", "find_checkpoint", "list_checkpoints", "load_checkpoint", "read_data_positions",
           "share_of", "verify_checkpoint", "verify_checksums"]

PREFIX = "checkpoint-"
MANIFEST, TRAINER_STATE, PIPELINE_STATE = "manifest.json", "trainer_state.json", "pipeline_state.json"
DATA_POSITIONS = "data_positions.json"
# pipeline_state.json's layout; a checkpoint of another format is refused, not misread.
FORMAT = 1


class CheckpointError(RunFailure):
    """A checkpoint that cannot be used (missing, incomplete, damaged, or from an incompatible run)."""


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under output_dir, oldest first (by step)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := re.fullmatch(rf"{PREFIX}(\d+)", p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def find_checkpoint(resume_from: str, output_dir: str | Path) -> Path | None:
    """`latest`: the newest complete checkpoint in output_dir, None while there is none (so one
    command serves the first launch and every restart or rerun after it); or a checkpoint directory,
    which must be complete."""
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no {MANIFEST}; an interrupted save "
                              f"leaves a '.partial' directory, which is never loaded)")
    return path


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def share_of(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files `rank` hashes: every file is hashed by one rank, the ranks in parallel."""
    return sorted(names)[rank::world_size]


def verify_checkpoint(path: Path) -> dict:
    """The pipeline state of a complete checkpoint: every file of its manifest present with the size
    written (no file is read); CheckpointError naming the bad file otherwise, or saying the
    checkpoint was written in another format."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {path}: file {name} has {file.stat().st_size} bytes, "
                                  f"{expected['bytes']} were written (truncated or replaced)")
    if PIPELINE_STATE not in manifest:
        raise CheckpointError(f"checkpoint {path} was written by an earlier version of hf_asyncpp (it has no "
                              f"{PIPELINE_STATE}); this version cannot resume or export it")
    state = json.loads((path / PIPELINE_STATE).read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {state.get('format')} in {PIPELINE_STATE}; this "
                              f"version of hf_asyncpp reads format {FORMAT}")
    return state


def verify_checksums(path: Path, layout=None) -> None:
    """Collective: the ranks hash the checkpoint's files between them (each file once, in parallel)
    and every rank raises the same CheckpointError if one is damaged. Without a layout, this
    process hashes them all."""
    manifest = json.loads((path / MANIFEST).read_text())
    mine = list(manifest) if layout is None else share_of(list(manifest), layout.rank, layout.world_size)
    found = [[name for name in mine if digest(path / name) != manifest[name]["sha256"]]]
    if layout is not None:
        mine, found = found[0], [None] * layout.world_size
        dist.all_gather_object(found, mine, group=layout.io_group)
    damaged = sorted(name for names in found for name in names)
    if damaged:
        raise CheckpointError(f"checkpoint {path}: file {damaged[0]} is damaged (checksum differs)")


def read_data_positions(path: Path) -> list[dict] | None:
    """The streamed dataset's positions a checkpoint holds, one per dp rank (None if it holds none)."""
    file = Path(path) / DATA_POSITIONS
    return json.loads(file.read_text()) if file.is_file() else None


def load_checkpoint(engine, layout, path: Path) -> dict:
    """Load a checkpoint into the engine (collective). Returns its pipeline state. Rank 0 checks the
    files' presence and sizes, then the ranks their checksums between them; every rank raises the
    same CheckpointError if a file is bad."""
    verdict = [None]
    if layout.is_main:
        try:
            verdict = [verify_checkpoint(path)]
        except (CheckpointError, OSError, ValueError) as err:
            verdict = [CheckpointError(str(err))]
    dist.broadcast_object_list(verdict, src=0, group=layout.io_group)
    if isinstance(verdict[0], Exception):
        raise verdict[0]
    run_state = verdict[0]
    verify_checksums(path, layout)
    if engine.executor.layout_bound:  # in-flight state is replayed by the order, or kept versions emulate it
        current = engine.executor.run_layout()
        saved = {k: run_state.get(k, 0 if k in ("sync_steps", "emulate_pp_size") else None) for k in current}
        if saved != current:
            raise CheckpointError(f"checkpoint {path} was saved by an asynchronous run with {saved}; resuming it needs "
                                  f"the same pp_size, schedule and n_microbatches, sync_steps and emulate_pp_size "
                                  f"(this run: {current})")
    reader = FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    try:
        load_training_state(engine, layout.rank, saved, lambda state: dcp.load(
            state, storage_reader=reader, process_group=layout.io_group, planner=DefaultLoadPlanner(flatten_state_dict=False)))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {err}") from None
    return run_state
