"""Writing a training checkpoint: staged at the step boundary, written while training goes on.

A save has two halves.

- **Staging**, on every rank at the step boundary (what training waits for): the updates held for the
  global norm are settled, the state is checked for non-finite values (a state holding one is never
  written) and copied to host memory, into pinned buffers on a GPU so the copies run together and end
  with one sync. Rank 0 creates `checkpoint-<step>.partial/` with the model's config and tokenizer.
- **Writing**, on a background thread of every rank while the next steps run:
  torch.distributed.checkpoint writes each rank's shards from that copy, the ranks hash the files
  between them (each file once), and rank 0 writes the JSON states and the manifest, renames the
  directory and prunes old ones (checkpoints.py: what a checkpoint holds, and when it counts as one).

Training pays for a host copy (the rank's state once more in host memory until the write ends), not
for the file system or the checksum pass. The writing half talks over a gloo group of its own, so its
collectives never interleave with the main thread's. One save is in flight at a time: the next save,
the end of the run, a stop and an export wait for it (`wait`), and a failure there (a full disk)
is raised on every rank as the same CheckpointError. Each save's staging and writing times (the
slowest rank's) are measured: the time-limit stop (resilience.TimeLimit) plans with them.
`background=False` writes in the calling thread from the live tensors, without the copy
(`save_checkpoint`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..resilience import first_nonfinite
from .checkpoints import (DATA_POSITIONS, FORMAT, MANIFEST, PIPELINE_STATE, PREFIX, TRAINER_STATE, CheckpointError,
                          digest, list_checkpoints, share_of)
from .training_state import training_state

__all__ = ["CheckpointWriter", "SaveTiming", "save_checkpoint", "state_bytes"]


@dataclass(frozen=True)
class SaveTiming:
    """One save, measured: its step, the bytes every rank wrote together, and the slowest rank's
    staging (training waited for it) and writing (in the background, unless written in place)."""

    step: int
    bytes: int
    staging_s: float
    writing_s: float

    @property
    def total_s(self) -> float:
        """What a save that the run waits for (a stop's) takes: staging, then writing."""
        return self.staging_s + self.writing_s


def state_bytes(state: dict) -> int:
    """The bytes of this rank's part of a training state (its shards)."""
    return sum(_local(v).numel() * _local(v).element_size() for v in state.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_copy(state: dict) -> dict:
    """A copy of `state` in host memory that training can no longer change. Device tensors go to
    pinned buffers without blocking, and one stream sync ends the copies; a DTensor keeps its sharding
    around a host copy of its shard (a blocking copy each: a save's, not a step's)."""
    staged, device = {}, None
    for key, value in state.items():
        if isinstance(value, DTensor):
            staged[key] = value.detach().to("cpu", copy=True)
            continue
        pinned = value.device.type == "cuda"
        staged[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=pinned).copy_(value, non_blocking=pinned)
        device = value.device if pinned else device
    if device is not None:
        torch.cuda.current_stream(device).synchronize()
    return staged


class _FailedOn(Exception):
    """Another rank's error, as DCP reports it on every rank: said as that rank's."""

    def __init__(self, rank: int, cause: BaseException):
        super().__init__(str(cause))
        self.rank, self.cause = rank, cause


def _first_cause(err: CheckpointException) -> BaseException:
    """The underlying error of the lowest failing rank (DCP wraps each rank's error with its traceback)."""
    for rank, wrapped in sorted(err.failures.items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, stack summary)
        if isinstance(cause, BaseException):
            return _FailedOn(rank, cause)
    return err


def _report(failure: BaseException, final: Path) -> str:
    """The failure, with the free space where the checkpoint goes: a full disk then shows even when
    the failing writer lost the errno (torch.save's zip writer says only "unexpected pos")."""
    report = f"{type(failure).__name__}: {failure}"
    try:
        return f"{report}; {shutil.disk_usage(final.parent).free} bytes free on its file system"
    except OSError:
        return report


def _agree(group, world_size: int, final: Path, failure: BaseException | None, share=None) -> list:
    """Every rank learns whether any rank's part of the save failed, and raises the same error; rank 0
    then removes the partial directory. Returns every rank's `share` (what each contributed)."""
    reports = [None] * world_size
    if isinstance(failure, _FailedOn):
        mine = (failure.rank, _report(failure.cause, final))
    else:
        mine = None if failure is None else (dist.get_rank(group), _report(failure, final))
    dist.all_gather_object(reports, (mine, share), group=group)
    failed = sorted(report for report, _ in reports if report)
    if failed:
        if dist.get_rank(group) == 0:
            shutil.rmtree(final.with_name(final.name + ".partial"), ignore_errors=True)
        rank, report = failed[0]
        raise CheckpointError(f"saving checkpoint {final} failed on rank {rank} ({report}); "
                              "the previous checkpoint is kept")
    return [s for _, s in reports]


def _attempt(action):
    """(result, None), or (None, the error) for any error: every rank must learn of it, whatever it is."""
    try:
        return action(), None
    except CheckpointException as err:  # DCP reports a failed write on every rank (a BaseException)
        return None, _first_cause(err)
    except Exception as err:  # noqa: BLE001
        return None, err


@dataclass
class _Staged:
    """What the writing half needs: the state to write, where, and the JSON files rank 0 adds."""

    state: dict
    final: Path
    json_files: dict  # name → text (rank 0)
    save_total_limit: int | None
    staging_s: float
    model_config: object = None  # with hf_weights: the weights as HF files beside the state (rank 0)
    hf_weights: tuple | None = None  # (dtype, max shard bytes)

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")


class CheckpointWriter:
    """Saves a run's checkpoints (collective: every rank calls `save` at the same step), in the
    background unless `background` is False; `last` is the latest save's SaveTiming."""

    def __init__(self, layout, background: bool = True):
        self.layout, self.background = layout, background
        self.last: SaveTiming | None = None
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Path | None, BaseException | None] = (None, None)

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def written(self) -> Path | None:
        """The checkpoint in flight if this rank's part of it has ended well, else None: for a console
        line as soon as it is complete (rank-local; `wait` is still what every rank calls)."""
        done, failure = self._outcome
        return done if self._thread is not None and not self._thread.is_alive() and failure is None else None

    def save(self, engine, output_dir: str | Path, step: int, run_state: dict, save_total_limit: int | None = None,
             trainer_state: dict | None = None, model_config=None, tokenizer=None,
             data_position: dict | None = None, hf_weights: tuple | None = None) -> Path:
        """Stage the training state after `step` completed steps and write it (in the background: the
        checkpoint is complete once `wait` returns it). The arguments: checkpoints.save_checkpoint's."""
        self.wait()
        staged = self._stage(engine, output_dir, step, run_state, save_total_limit, trainer_state,
                             model_config, tokenizer, data_position)
        if model_config is not None and self.layout.is_main:
            staged.model_config, staged.hf_weights = model_config, hf_weights
        if not self.background:
            self._outcome = (self._write(staged, self.layout.io_group), None)
            return staged.final
        self._thread = threading.Thread(target=self._write_in_background, args=(staged,), daemon=True,
                                        name=f"checkpoint-{step}")
        self._thread.start()
        return staged.final

    def wait(self) -> Path | None:
        """Wait for the save in flight; returns the checkpoint it completed (once: None afterwards, and
        when there was none), or raises its CheckpointError (on every rank)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        (done, failure), self._outcome = self._outcome, (None, None)
        if failure is not None:
            raise failure
        return done

    def abandon(self, timeout_s: float) -> None:
        """After this rank's own failure or a lost peer: let the save in flight end (its collectives fail
        at once when a peer died, after the group's timeout when one stopped answering) and drop its
        outcome. The process groups can then be torn down: destroying one while this thread still
        waits in it aborts the process."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread, self._outcome = None, (None, None)

    # --- the two halves ---------------------------------------------------------------------------

    def _stage(self, engine, output_dir, step, run_state, save_total_limit, trainer_state, model_config, tokenizer,
               data_position) -> _Staged:
        from .hf_export import write_model_files

        layout, start = self.layout, time.perf_counter()
        final = Path(output_dir) / f"{PREFIX}{step}"
        partial = final.with_name(final.name + ".partial")
        engine.settle_updates()  # updates held for their global norm: a resume replays none of their units
        state = training_state(engine, layout.rank)
        pipeline_state = dict(run_state, format=FORMAT, step=step, dp_size=layout.dp_size, **engine.executor.run_layout())

        def prepare():
            bad = first_nonfinite(state.items())
            if bad is not None:  # never written: a checkpoint that resumes into NaN is worse than none
                raise ValueError(f"{bad} holds non-finite values")
            if layout.is_main:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                if model_config is not None:
                    write_model_files(partial, model_config, tokenizer)
            return _host_copy(state) if self.background else state

        staged_state, failure = _attempt(prepare)
        position = None if data_position is None else json.dumps(data_position)
        shared = _agree(layout.io_group, layout.world_size, final, failure, position)
        positions = {p["dp_rank"]: p for p in map(json.loads, filter(None, shared))}  # kept once per dp rank
        json_files = {TRAINER_STATE: trainer_state or {"global_step": step}, PIPELINE_STATE: pipeline_state}
        if positions:
            json_files[DATA_POSITIONS] = [positions[d] for d in sorted(positions)]
        json_files = {name: json.dumps(value, indent=2) for name, value in json_files.items()} if layout.is_main else {}
        return _Staged(staged_state, final, json_files, save_total_limit, time.perf_counter() - start)

    def _write_in_background(self, staged: _Staged) -> None:
        try:
            self._outcome = (self._write(staged, self.layout.checkpoint_group), None)
        except CheckpointError as err:
            self._outcome = (None, err)
        except BaseException as err:  # noqa: BLE001 — a bug, or the group torn down under it: said at wait
            self._outcome = (None, CheckpointError(f"saving checkpoint {staged.final} stopped: "
                                                   f"{type(err).__name__}: {err}"))

    def _write(self, staged: _Staged, group) -> Path:
        """Write the staged state, hash it, publish it (collective over `group`); measure it."""
        layout, start, final, partial = self.layout, time.perf_counter(), staged.final, staged.partial
        # Not flattened: a dict entry (LR schedule, RNG) is one object under its key, as load expects.
        _, failure = _attempt(lambda: dcp.save(staged.state, storage_writer=FileSystemWriter(partial),
                                               process_group=group, planner=DefaultSavePlanner(flatten_state_dict=False)))
        _agree(group, layout.world_size, final, failure)
        if staged.model_config is not None:  # rank 0: from the files just written, a group of layers at a time
            _, failure = _attempt(lambda: _write_hf_weights(staged))
        _agree(group, layout.world_size, final, failure)
        digests, failure = _attempt(lambda: {
            name: {"bytes": (partial / name).stat().st_size, "sha256": digest(partial / name)}
            for name in share_of([p.name for p in partial.iterdir()], layout.rank, layout.world_size)})
        shares = _agree(group, layout.world_size, final, failure, digests)
        files = {name: info for share in shares for name, info in share.items()}

        def publish():
            for name, text in staged.json_files.items():
                _write_text(partial / name, text)
                files[name] = {"bytes": (partial / name).stat().st_size, "sha256": digest(partial / name)}
            _write_text(partial / MANIFEST, json.dumps(dict(sorted(files.items())), indent=2))  # last: marks it complete
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)

        _, failure = _attempt(publish if layout.is_main else lambda: None)
        _agree(group, layout.world_size, final, failure)
        if layout.is_main and staged.save_total_limit:
            for old in list_checkpoints(final.parent)[:-staged.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        written = sum(info["bytes"] for info in files.values()) if layout.is_main else 0  # rank 0 knows every file
        times = [None] * layout.world_size  # also the barrier: every rank returns once the checkpoint is whole
        dist.all_gather_object(times, (staged.staging_s, time.perf_counter() - start, written), group=group)
        self.last = SaveTiming(int(final.name[len(PREFIX):]), times[0][2], max(t[0] for t in times),
                               max(t[1] for t in times))
        return final


LOAD_NOTE = "HOW_TO_LOAD.txt"


def _write_hf_weights(staged: _Staged) -> None:
    """The checkpoint's master weights as `save_pretrained` writes them, beside its state, so that
    `from_pretrained` loads the directory (checkpoint_export.write_hf_weights); or, without them, a
    one-line note naming the command that writes them."""
    from .checkpoint_export import write_hf_weights

    if staged.hf_weights is None:
        _write_text(staged.partial / LOAD_NOTE, f"from_pretrained needs this checkpoint's weights as HF files: "
                                                f"hf-asyncpp export {staged.final} OUT_DIR\n")
        return
    dtype, limit = staged.hf_weights
    write_hf_weights(staged.partial, staged.partial, staged.model_config, dtype, limit)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(engine, layout, output_dir: str | Path, step: int, run_state: dict,
                    save_total_limit: int | None = None, trainer_state: dict | None = None,
                    model_config=None, tokenizer=None, data_position: dict | None = None) -> Path:
    """Write the training state after `step` completed steps, and return once it is complete
    (collective: every rank calls it).
    `run_state`: the front end's own resume state (pipeline_state.json, with the step and layout added);
    `trainer_state`: a `TrainerState` as a dict (trainer_state.json; by default one with the step);
    `model_config`, `tokenizer`: written beside the weights, so the checkpoint exports on its own;
    `data_position`: this rank's position in a streamed dataset (None where it reads none; the ranks
    of one dp rank hold the same position, which is written once).
    A failure on any rank (a full disk, an unwritable directory, a non-finite value in the state,
    which is then not written at all) raises the same CheckpointError on every rank, naming the path
    and the cause; the partial directory is removed and the previous checkpoint, pruned only after a
    new one is complete, stays."""
    writer = CheckpointWriter(layout, background=False)
    writer.save(engine, output_dir, step, run_state, save_total_limit, trainer_state, model_config, tokenizer,
                data_position)
    return writer.wait()
