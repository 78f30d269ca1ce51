"""Non-finite values: every rank takes the same decision, nothing non-finite is ever applied or
written, and `skip` continues as if the update had never been computed.

Runs of training_scripts/train.py under torchrun (pp 2, fp32, fixed seeds, constant LR, no shuffle)
through tests/faults.py, which makes the loss of one microbatch of minibatch K (0-based; step K + 1)
NaN — and with it that microbatch's gradient on every stage.

- `stop`: every rank exits non-zero one step later with the message (step, stages, tensors); the
  checkpoints written before hold finite values only; no export is written.
- `skip`, 1F1B: the final weights equal, bit for bit, a run on the same data without minibatch K
  (one step fewer), and the logged losses of every other step are that run's.
- `skip`, PipeDream-2BW + Error Feedback: the final weights equal, bit for bit, the same run in which
  each stage's update of minibatch K is simply not applied (faults.py IDENTITY_UPDATE; minibatch K+1
  was already forwarded on the older weights, so "without minibatch K" means exactly that), so the
  weight versions and EF buffers stayed consistent.
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.test_engine import small_model_config
from tests.test_run import _env

SEQ, MBS, M, STEPS, K = 16, 2, 4, 8, 3
ROWS = MBS * M
POISON = 8191  # the first token of one row of minibatch K; no other row starts with it


def _data(tmp_path, drop_minibatch: int | None = None):
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192  # the built-in tokenizer's
    config.save_pretrained(tmp_path / "model")
    rows = torch.randint(0, 8000, (STEPS * ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    rows[K * ROWS + MBS, 0] = POISON  # the first row of microbatch 1 of minibatch K
    if drop_minibatch is not None:
        rows = torch.cat([rows[:drop_minibatch * ROWS], rows[(drop_minibatch + 1) * ROWS:]])
    path = tmp_path / ("data.jsonl" if drop_minibatch is None else "data_without.jsonl")
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))
    return path


def _train(tmp_path, out, data, schedule, *extra, fault: dict | None = None):
    command = ["torchrun", "--nproc_per_node", "2", "tests/faults.py", "--model_config", str(tmp_path / "model"),
               "--dataset", str(data), "--seq_len", str(SEQ), "--micro_batch_size", str(MBS), "--n_microbatches",
               str(M), "--pp_size", "2", "--schedule", schedule, "--optimizer", "adamw", "--learning_rate", "3e-3",
               "--lr_scheduler_type", "constant", "--shuffle", "false", "--max_steps", str(STEPS), "--logging_steps",
               "1", "--report_to", "none", "--seed", "3", "--output_dir", str(out), *extra]
    env = {**_env(), **{k: str(v) for k, v in (fault or {}).items()}}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def _checkpoint_tensors(path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    return torch.load(path.parent / f"{path.name}.pt", weights_only=False)


@pytest.mark.multirank
def test_stop_ends_every_rank_at_the_next_step_and_writes_nothing_non_finite(tmp_path):
    out = tmp_path / "stop"
    start = time.time()
    done = _train(tmp_path, out, _data(tmp_path), "1f1b", "--nonfinite_policy", "stop", "--save_steps", "2",
                  fault={"POISON_TOKEN": POISON})
    assert done.returncode != 0
    assert time.time() - start < 120
    assert (f"error: step {K + 1}: non-finite the loss of 1 microbatch(es) (computed on stage 1) and the gradient "
            "of stage(s) 0, 1; its update was skipped. nonfinite_policy is stop") in done.stderr
    # Decided on every rank at the end of the next step, before that step is logged.
    assert [r["step"] for r in _records(out)] == list(range(1, K + 2))
    assert not (out / "final").exists()
    for name in ("checkpoint-2", "checkpoint-4"):  # checkpoint-4 holds the weights the NaN never reached
        tensors = _checkpoint_tensors(out / name)
        floats = [v for v in tensors.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        assert floats and all(bool(torch.isfinite(v).all()) for v in floats)


@pytest.mark.multirank
def test_skip_gives_the_weights_of_a_run_that_never_saw_the_minibatch(tmp_path):
    skipped, reference = tmp_path / "skipped", tmp_path / "reference"
    done = _train(tmp_path, skipped, _data(tmp_path), "1f1b", "--nonfinite_policy", "skip",
                  fault={"POISON_TOKEN": POISON})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"warning: step {K + 1}: non-finite the loss of 1 microbatch(es)" in done.stdout
    without = _train(tmp_path, reference, _data(tmp_path, drop_minibatch=K), "1f1b", "--max_steps", str(STEPS - 1))
    assert without.returncode == 0, without.stderr[-3000:]

    records, expected = _records(skipped), _records(reference)
    assert math.isnan(records[K]["loss"]) and records[K]["skipped_updates_per_stage"] == [1, 1]
    assert [r["loss"] for r in records[:K] + records[K + 1:]] == [r["loss"] for r in expected]
    got, want = _weights(skipped), _weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.multirank
def test_skip_under_an_asynchronous_schedule_drops_exactly_that_update(tmp_path):
    skipped, reference = tmp_path / "skipped", tmp_path / "reference"
    data = _data(tmp_path)
    args = ("pipedream-2bw", "--ef", "true", "--nonfinite_policy", "skip")
    done = _train(tmp_path, skipped, data, *args, fault={"POISON_TOKEN": POISON})
    assert done.returncode == 0, done.stderr[-3000:]
    dropped = _train(tmp_path, reference, data, *args, fault={"IDENTITY_UPDATE": K})
    assert dropped.returncode == 0, dropped.stderr[-3000:]

    records = _records(skipped)
    assert sum(sum(r["skipped_updates_per_stage"]) for r in records) == 2  # one update on each stage
    got, want = _weights(skipped), _weights(reference)
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class _Stats:
    """What one step's reduced statistics report (metrics.ReducedStepStats.value)."""

    def __init__(self, losses=0, stages=(), skipped=(0, 0)):
        self.values = {"nonfinite_loss_microbatches": losses, "nonfinite_grad_stages": list(stages),
                       "skipped_updates_per_stage": list(skipped)}

    def value(self, key):
        return self.values[key]


def test_skip_stops_once_more_steps_than_the_limit_were_skipped(capsys):
    from hf_asyncpp.resilience import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("skip", skip_limit=2, last_stage=1)
    guard.review(1, _Stats())
    guard.review(2, _Stats(stages=[0], skipped=(1, 0)))
    guard.review(3, _Stats(losses=1))  # a loss reported before its update: not a skipped step
    guard.review(4, _Stats(losses=1, stages=[0, 1], skipped=(1, 1)))
    assert "step 2: non-finite the gradient of stage(s) 0; its update was skipped (1 of 2 allowed)" in capsys.readouterr().out
    with pytest.raises(NonFiniteError, match=r"step 7: .* 3 steps with non-finite values \(steps 2, 4, 7\), more than "
                                             r"nonfinite_skip_limit \(2\)"):
        guard.review(7, _Stats(stages=[1], skipped=(0, 1)))


def test_stop_names_the_step_the_stages_and_the_tensors():
    from hf_asyncpp.resilience import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("stop", skip_limit=10, last_stage=3)
    guard.review(5, _Stats())
    with pytest.raises(NonFiniteError, match=r"^step 6: non-finite the loss of 2 microbatch\(es\) \(computed on stage 3\) "
                                             r"and the gradient of stage\(s\) 1, 3; its update was skipped"):
        guard.review(6, _Stats(losses=2, stages=[1, 3], skipped=(0, 1, 0, 1)))
