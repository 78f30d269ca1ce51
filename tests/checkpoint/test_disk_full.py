"""A checkpoint save that runs out of disk stops the run with the path and the cause, and the
previous checkpoint stays complete and loadable.

train.py under torchrun (pp 2, 1F1B, AdamW) writes into a small tmpfs that holds one checkpoint and
the run's logs but not a second checkpoint beside it: checkpoint-2 completes, checkpoint-4 fails with
"No space left on device" on whichever rank hits it first; every rank stops with the same error (exit
status non-zero, no hang), no `.partial` directory is left, and checkpoint-2 verifies and resumes
(in a larger directory) to the same losses as a run that never failed. Needs permission to mount a
tmpfs (root in a container); skipped otherwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from hf_asyncpp.checkpoint.checkpoints import list_checkpoints, verify_checkpoint
from tests.checkpoint.test_resume_after_kill import _setup
from tests.test_run import _env

SEQ, MBS, M = 16, 2, 4


def _command(tmp_path, out, *extra):
    return ["torchrun", "--nproc_per_node", "2", "training_scripts/train.py", "--config",
            "training_scripts/configs/tiny_moe.yaml", "--model_config", str(tmp_path / "model"), "--dataset",
            str(tmp_path / "data.jsonl"), "--seq_len", str(SEQ), "--micro_batch_size", str(MBS),
            "--n_microbatches", str(M), "--pp_size", "2", "--schedule", "1f1b", "--max_steps", "6",
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
    done = subprocess.run(_command(tmp_path, reference), capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint_bytes = sum(f.stat().st_size for f in (reference / "checkpoint-2").iterdir())
    if not _mount(small_disk, int(checkpoint_bytes * 1.5) + 256 * 1024):  # one checkpoint, not two
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    try:
        out = small_disk / "run"
        failed = subprocess.run(_command(tmp_path, out), capture_output=True, text=True, env=_env(), timeout=600)
        assert failed.returncode != 0
        assert f"saving checkpoint {out / 'checkpoint-4'} failed" in failed.stderr
        assert "No space left on device" in failed.stderr and "the previous checkpoint is kept" in failed.stderr
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
        assert not list(out.glob("*.partial"))
        verify_checkpoint(out / "checkpoint-2")
        shutil.copytree(out, tmp_path / "moved")
    finally:
        subprocess.run(["umount", str(small_disk)], capture_output=True)
    moved = tmp_path / "moved"
    resumed = subprocess.run(_command(tmp_path, moved, "--resume_from_checkpoint", "latest"), capture_output=True,
                             text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(moved) == _losses(reference)
