"""End to end through training_scripts/train.py: a streamed, shuffled jsonl corpus, a run under
torchrun stopped by SIGTERM at a known step (tests/faults.py) and continued with
`resume_from_checkpoint: latest` logs bitwise the losses of the run that was never stopped, and it
continued the stream from the checkpoint's saved positions (one per dp rank) rather than replaying
it. The uninterrupted and the continued runs are train.py's main on two ranks of the suite's pool.

Two layouts: PipeDream-2BW at pp 2 (its loop asks for step k+1's rows before step k's, and the
checkpoint has step k+1's microbatches in flight) and 1F1B at dp 2 (two positions, one per dp rank,
each written once although a dp rank's first- and last-stage ranks both read it).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

from tests.ranks import train_py
from tests.test_engine import save_model_dir, small_model_config
from tests.test_run import _env

WORDS = "King Queen Duke Lord night sword crown blood heart love death honour fair sweet grave moon".split()
STEPS, STOP_SIGNALLED_AT = 10, 4


def _setup(tmp_path):
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192  # the built-in tokenizer's
    save_model_dir(config, tmp_path / "model")
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(4):  # ~ 20 steps an epoch at dp 1, windows of 16 documents
        docs = [" ".join(rng.choices(WORDS, k=rng.randint(3, 30))) for _ in range(60)]
        (corpus / f"{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def _command(tmp_path, out, schedule, pp_size, script="training_scripts/train.py"):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
            *_arguments(tmp_path, out, schedule, pp_size)]


def _arguments(tmp_path, out, schedule, pp_size):
    return ["--model_config", str(tmp_path / "model"), "--dataset", str(tmp_path / "corpus"), "--streaming", "true",
            "--shuffle", "true", "--shuffle_window", "16", "--seq_len", "16", "--micro_batch_size", "2",
            "--n_microbatches", "2", "--pp_size", str(pp_size), "--schedule", schedule, "--optimizer", "adamw",
            "--learning_rate", "3e-3", "--warmup_steps", "2", "--max_steps", str(STEPS), "--save_final", "false",
            "--threads_per_rank", "1", "--report_to", "none", "--output_dir", str(out),
            "--resume_from_checkpoint", "latest"]


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, pp_size", [("pipedream-2bw", 2), ("1f1b", 1)])
def test_a_stopped_streamed_run_resumed_from_latest_logs_the_uninterrupted_losses_bitwise(tmp_path, schedule, pp_size):
    _setup(tmp_path)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ran = train_py(2, _arguments(tmp_path, straight, schedule, pp_size), tmp_path / "straight-logs")
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]

    first = subprocess.run(_command(tmp_path, stopped, schedule, pp_size, script="tests/faults.py"),
                           env={**_env(), "SIGTERM_AT_STEP": str(STOP_SIGNALLED_AT)}, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    at = int(re.search(r"stopped after step (\d+) on SIGTERM", first.stderr).group(1))
    assert STOP_SIGNALLED_AT < at < STEPS
    positions = json.loads((stopped / f"checkpoint-{at}" / "data_positions.json").read_text())
    dp_size = 2 // pp_size
    assert [(p["dp_rank"], p["step"]) for p in positions] == [(d, at) for d in range(dp_size)]

    resumed = train_py(2, _arguments(tmp_path, stopped, schedule, pp_size), tmp_path / "resumed-logs")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    logs = "".join(log for _, log in resumed)
    assert f"resumed from {stopped / f'checkpoint-{at}'}" in logs
    assert "read again" not in logs and "replay" not in logs  # no replay
    assert _losses(stopped) == _losses(straight) and len(_losses(straight)) == STEPS
