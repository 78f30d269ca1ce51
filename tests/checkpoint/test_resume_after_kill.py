"""A rank killed with SIGKILL mid-run loses nothing that was checkpointed, and resuming continues the
same trajectory bitwise.

Three runs of training_scripts/train.py (pp = 2, PipeDream-2BW, AdamW + Error Feedback, fp32, fixed
seeds, save_steps 3; 2BW saves with microbatches in flight): one straight through; one whose rank 1
is SIGKILLed in the middle of its second save (tests/faults.py), which must leave only a `.partial`
directory that `latest` passes over; then the same arguments with `--resume_from_checkpoint latest`.
The killed run is a torchrun launch (the kill, the launcher's report); the straight and resumed ones
run train.py's main on ranks of the suite's pool. Every
checkpoint that the killed run left marked complete verifies (sizes and checksums of all its files),
and the resumed run's per-step losses (metrics.jsonl, including the steps logged before the kill)
and exported weights equal the straight run's exactly.

A kill between saves is tested in tests/test_resilience.py (a launcher's restart and a requeued
two-node job, both resuming bitwise), and every schedule's resume in tests/checkpoint/test_checkpoints.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hf_asyncpp.checkpoint.checkpoints import find_checkpoint, list_checkpoints, verify_checkpoint
from tests.ranks import train_py
from tests.test_engine import save_model_dir, small_model_config
from tests.test_run import _env

SEQ, MBS, M, STEPS, SAVE_EVERY = 16, 2, 4, 15, 3


def _setup(tmp_path):
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192  # the built-in tokenizer's
    save_model_dir(config, tmp_path / "model")
    rows = torch.randint(0, 8192, (STEPS * MBS * M, SEQ), generator=torch.Generator().manual_seed(0))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))


def _command(tmp_path, out, *extra, script="training_scripts/train.py"):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
            *_arguments(tmp_path, out, *extra)]


def _arguments(tmp_path, out, *extra):
    return ["--model_config", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
            "--seq_len", str(SEQ), "--micro_batch_size", str(MBS), "--n_microbatches", str(M), "--pp_size", "2",
            "--schedule", "pipedream-2bw", "--optimizer", "adamw", "--ef", "true", "--learning_rate", "3e-3",
            "--warmup_steps", "3", "--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY),
            "--save_total_limit", "2", "--threads_per_rank", "1", "--output_dir", str(out), *extra]


def _losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.multirank
def test_a_rank_killed_inside_a_save_resumes_from_the_checkpoint_before_bitwise(tmp_path):
    _setup(tmp_path)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The straight run, the reference: train.py's main on two ranks of the suite's pool.
    ran = train_py(2, _arguments(tmp_path, straight), tmp_path / "straight-logs")
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]

    # rank 1 dies inside the save of step 6
    launcher = subprocess.Popen(_command(tmp_path, killed, script="tests/faults.py"),
                                env={**_env(), "KILL_IN_SAVE": "2"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert launcher.wait(timeout=300) != 0  # the launcher reports the lost rank
    assert not (killed / "final").exists()
    left = list_checkpoints(killed)
    assert (killed / f"checkpoint-{2 * SAVE_EVERY}.partial").is_dir()  # the interrupted save
    assert [c.name for c in left] == [f"checkpoint-{SAVE_EVERY}"]
    assert find_checkpoint("latest", killed) == left[-1]
    for checkpoint in left:
        verify_checkpoint(checkpoint)  # raises if a file of a complete-looking checkpoint is missing or cut
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        assert all(hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() == entry["sha256"]
                   for name, entry in manifest.items()), checkpoint

    continued = train_py(2, _arguments(tmp_path, killed, "--resume_from_checkpoint", "latest"), tmp_path / "resumed-logs")
    assert [code for code, _ in continued] == [0, 0], continued[0][1][-3000:]
    assert _losses(killed) == _losses(straight)
    assert len(_losses(straight)) == STEPS
    expected, resumed = load_file(straight / "final" / "model.safetensors"), load_file(killed / "final" / "model.safetensors")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
