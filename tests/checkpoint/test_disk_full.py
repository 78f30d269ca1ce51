"""A checkpoint save that runs out of disk stops the run with the path and the cause, and the
previous checkpoint stays complete and loadable.

train.py under torchrun (pp 2, 1F1B, AdamW; the reference and resumed runs are train.py's main on
ranks of the suite's pool) writes
into a small tmpfs that holds one checkpoint and the run's logs but not a second checkpoint beside
it: checkpoint-2 completes, checkpoint-4 fails on whichever rank hits the full disk first (the
message gives the cause and the free space); every rank stops with the same error (exit status
non-zero, no hang), no `.partial` directory is left, and checkpoint-2 verifies and resumes (in a
larger directory) to the same losses as a run that never failed. A second run's output directory
becomes unwritable (chattr +i) once its first checkpoint exists: the next save stops the run with
the path and the cause, and that checkpoint verifies and resumes. Needs permission to mount a tmpfs
/ make a directory immutable (root in a container); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hf_asyncpp.checkpoint.checkpoints import list_checkpoints, verify_checkpoint
from tests.checkpoint.test_resume_after_kill import _setup
from tests.ranks import train_py
from tests.test_run import _env

SEQ, MBS, M = 16, 2, 4
UNWRITABLE_STEPS = 12  # the unwritable run's: past the failing save of step 4, and a resume after it


def _command(tmp_path, out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "training_scripts/train.py",
            *_arguments(tmp_path, out, *extra)]


def _arguments(tmp_path, out, *extra):
    return ["--config", "training_scripts/configs/tiny_moe.yaml", "--model_config", str(tmp_path / "model"),
            "--dataset", str(tmp_path / "data.jsonl"), "--seq_len", str(SEQ), "--micro_batch_size", str(MBS),
            "--n_microbatches", str(M), "--pp_size", "2", "--schedule", "1f1b", "--optimizer", "adamw", "--ef", "false",
            "--eval_fraction", "0", "--max_steps", "6",
            "--save_steps", "2", "--logging_steps", "1", "--report_to", "none", "--save_final", "false",
            "--seed", "3", "--output_dir", str(out), *extra]


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    yield mount_point


def _mount(mount_point, size_bytes) -> bool:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount_point)],
                          capture_output=True)
    return done.returncode == 0


@pytest.mark.multirank
def test_a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, small_disk):
    _setup(tmp_path)
    reference = tmp_path / "reference"
    ran = train_py(2, _arguments(tmp_path, reference), tmp_path / "reference-logs")  # on the suite's pool
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]
    checkpoint_bytes = sum(f.stat().st_size for f in (reference / "checkpoint-2").iterdir())
    if not _mount(small_disk, int(checkpoint_bytes * 1.5) + 256 * 1024):  # one checkpoint, not two
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    try:
        out = small_disk / "run"
        failed = subprocess.run(_command(tmp_path, out), capture_output=True, text=True, env=_env(), timeout=600)
        assert failed.returncode != 0
        assert f"saving checkpoint {out / 'checkpoint-4'} failed" in failed.stderr
        assert "the previous checkpoint is kept" in failed.stderr
        # The cause: ENOSPC itself, or (when torch.save's zip writer hits it first and loses the errno) a
        # file system without room for another checkpoint.
        free = int(re.search(r"; (\d+) bytes free on its file system", failed.stderr).group(1))
        assert "No space left on device" in failed.stderr or free < checkpoint_bytes
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
        assert not list(out.glob("*.partial"))
        verify_checkpoint(out / "checkpoint-2")
        shutil.copytree(out, tmp_path / "moved")
    finally:
        subprocess.run(["umount", str(small_disk)], capture_output=True)
    moved = tmp_path / "moved"
    resumed = train_py(2, _arguments(tmp_path, moved, "--resume_from_checkpoint", "latest"), tmp_path / "resumed-logs")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert _losses(moved) == _losses(reference)


def _immutable(path, on: bool) -> bool:
    """chattr ±i: no entry can be added to or removed from the directory, not even by root."""
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


@pytest.mark.multirank
def test_an_output_dir_that_becomes_unwritable_stops_the_run_and_the_last_checkpoint_still_loads(tmp_path):
    _setup(tmp_path)
    out = tmp_path / "run"
    # Saves the run waits for: a checkpoint written in the background may complete just as the next save
    # starts, leaving no moment to freeze the run between the two.
    run = subprocess.Popen(_command(tmp_path, out, "--max_steps", str(UNWRITABLE_STEPS), "--checkpoint_async", "false"),
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    try:
        deadline = time.time() + 300
        while not list_checkpoints(out) and time.time() < deadline and run.poll() is None:
            time.sleep(0.02)
        assert list_checkpoints(out), "the run ended or stalled before its first checkpoint"
        # Frozen while the directory is made immutable: on a loaded machine the run could otherwise
        # start step 4's save first, and its .partial directory would then be there to stay.
        os.killpg(run.pid, signal.SIGSTOP)
        immutable = _immutable(out, True)
        os.killpg(run.pid, signal.SIGCONT)
        if not immutable:
            pytest.skip("making a directory immutable (chattr +i) needs privileges this machine does not give")
        assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"], "frozen too late"
        _, stderr = run.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher and its workers
            os.killpg(run.pid, signal.SIGKILL)
        _immutable(out, False)
    assert run.returncode == 1
    assert f"error: saving checkpoint {out / 'checkpoint-4'} failed on rank 0 (PermissionError" in stderr
    assert "Operation not permitted" in stderr and "the previous checkpoint is kept" in stderr
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and not list(out.glob("*.partial"))
    verify_checkpoint(out / "checkpoint-2")
    resumed = train_py(2, _arguments(tmp_path, out, "--max_steps", str(UNWRITABLE_STEPS), "--resume_from_checkpoint",
                                     "latest"), tmp_path / "resumed-logs")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert f"resumed from {out / 'checkpoint-2'} after step 2" in resumed[0][1]
    assert sorted(_losses(out)) == list(range(1, UNWRITABLE_STEPS + 1))
