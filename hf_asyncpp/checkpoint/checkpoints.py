"""Training checkpoints on disk: `<output_dir>/checkpoint-<step>/`, written atomically, verified on load.

A checkpoint is written by all ranks into `checkpoint-<step>.partial/` with
torch.distributed.checkpoint (each rank its own shards, in parallel), then rank 0 adds
`trainer_state.json` (step, layout, config) and `manifest.json` (every file's size and SHA-256) and
renames the directory. Only a directory without the `.partial` suffix and with a manifest counts as
a checkpoint: a crash at any point before the rename leaves nothing that looks complete, and the
previous checkpoints are untouched (the oldest are removed only after the new one is complete,
`save_total_limit`). Loading checks the manifest first and names the missing or damaged file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..resilience import RunFailure, first_nonfinite
from .training_state import load_training_state, training_state

__all__ = ["CheckpointError", "find_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint",
           "verify_checkpoint"]

PREFIX = "checkpoint-"
MANIFEST, TRAINER_STATE = "manifest.json", "trainer_state.json"


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


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _write_json(path: Path, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _first_cause(err: CheckpointException) -> BaseException:
    """The underlying error of the lowest failing rank (DCP wraps each rank's error with its traceback)."""
    for _, wrapped in sorted(err.failures.items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, stack summary)
        if isinstance(cause, BaseException):
            return cause
    return err


def _report(failure: BaseException, final: Path) -> str:
    """The failure, with the free space where the checkpoint goes: a full disk then shows even when
    the failing writer lost the errno (torch.save's zip writer says only "unexpected pos")."""
    report = f"{type(failure).__name__}: {failure}"
    try:
        return f"{report}; {shutil.disk_usage(final.parent).free} bytes free on its file system"
    except OSError:
        return report


def _agree(layout, final: Path, failure: BaseException | None) -> None:
    """Every rank learns whether any rank's part of the save failed, and raises the same error."""
    reports = [None] * layout.world_size
    dist.all_gather_object(reports, None if failure is None else _report(failure, final), group=layout.io_group)
    failed = [(rank, report) for rank, report in enumerate(reports) if report]
    if failed:
        rank, report = failed[0]
        raise CheckpointError(f"saving checkpoint {final} failed on rank {rank} ({report}); "
                              "the previous checkpoint is kept")


def save_checkpoint(engine, layout, output_dir: str | Path, step: int, trainer_state: dict,
                    save_total_limit: int | None = None) -> Path:
    """Write the training state after `step` completed steps (collective: every rank calls it).
    A failure on any rank (a full disk, an unwritable directory, a non-finite value in the state,
    which is then not written at all) raises the same CheckpointError on
    every rank, naming the path and the cause; the partial directory is removed and the previous
    checkpoint, pruned only after a new one is complete, stays."""
    final = Path(output_dir) / f"{PREFIX}{step}"
    staging = final.with_name(final.name + ".partial")
    state = training_state(engine, layout.rank)
    try:
        failure = None
        bad = first_nonfinite(state.items())
        if bad is not None:  # never written: a checkpoint that resumes into NaN is worse than none
            failure = ValueError(f"{bad} holds non-finite values")
        try:
            if layout.is_main and failure is None:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
        except OSError as err:
            failure = err
        _agree(layout, final, failure)
        failure = None
        try:
            # Not flattened: a dict entry (LR schedule, RNG) is one object under its key, as load expects.
            dcp.save(state, storage_writer=FileSystemWriter(staging), process_group=layout.io_group,
                     planner=DefaultSavePlanner(flatten_state_dict=False))
        except CheckpointException as err:  # DCP reports a failed write on every rank (a BaseException)
            failure = _first_cause(err)
        except Exception as err:
            failure = err
        _agree(layout, final, failure)
        failure = None
        try:
            if layout.is_main:
                _write_json(staging / TRAINER_STATE, dict(trainer_state, step=step, pp_size=layout.pp_size,
                                                          dp_size=layout.dp_size, schedule=engine.spec.name,
                                                          n_microbatches=engine.config.n_microbatches))
                files = {p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)} for p in sorted(staging.iterdir())}
                _write_json(staging / MANIFEST, files)  # written last: its presence marks the files complete
                shutil.rmtree(final, ignore_errors=True)
                staging.rename(final)
        except OSError as err:
            failure = err
        _agree(layout, final, failure)
    except CheckpointError:
        if layout.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if layout.is_main and save_total_limit:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=layout.io_group)
    return final


def verify_checkpoint(path: Path, checksums: bool = True) -> dict:
    """The trainer state of a complete, undamaged checkpoint; CheckpointError naming the bad file.
    Without `checksums` only presence and sizes are checked (what a load does after validation)."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {path}: file {name} has {file.stat().st_size} bytes, "
                                  f"{expected['bytes']} were written (truncated or replaced)")
        if checksums and _digest(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is damaged (checksum differs)")
    return json.loads((path / TRAINER_STATE).read_text())


def load_checkpoint(engine, layout, path: Path) -> dict:
    """Load a checkpoint into the engine (collective). Returns its trainer state. Rank 0 checks the
    files' presence and sizes first (config validation checked their checksums) and every rank raises
    the same CheckpointError if they are bad."""
    verdict = [None]
    if layout.is_main:
        try:
            verdict = [verify_checkpoint(path, checksums=False)]
        except (CheckpointError, OSError, ValueError) as err:
            verdict = [CheckpointError(str(err))]
    dist.broadcast_object_list(verdict, src=0, group=layout.io_group)
    if isinstance(verdict[0], Exception):
        raise verdict[0]
    trainer_state = verdict[0]
    if engine.versioned:  # in-flight state is replayed by the order: it must be the same order
        saved = {k: trainer_state.get(k) for k in ("pp_size", "schedule", "n_microbatches")}
        current = dict(pp_size=layout.pp_size, schedule=engine.spec.name, n_microbatches=engine.config.n_microbatches)
        if saved != current:
            raise CheckpointError(f"checkpoint {path} was saved by an asynchronous run with {saved}; resuming it needs "
                                  f"the same pp_size, schedule and n_microbatches (this run: {current})")
    reader = FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    try:
        load_training_state(engine, layout.rank, saved, lambda state: dcp.load(
            state, storage_reader=reader, process_group=layout.io_group, planner=DefaultLoadPlanner(flatten_state_dict=False)))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {err}") from None
    return trainer_state
