"""End to end through training_scripts/train.py, as users launch it.

The run must follow the documented recursion exactly: step k's minibatch is rows k·G … (k+1)·G − 1
of the file (shuffle off, dp = 1), split into microbatches in order; the loss is the mean of the
microbatch losses; gradients are clipped by the global norm; SGD with momentum (weight decay on what
transformers.Trainer decays: not biases or norm weights) and the LR schedule step once per minibatch. The test recomputes that with plain transformers + torch.optim and
compares every logged loss and every exported weight (1e-5: fp32, differently ordered sums). A
pipeline run closes with each rank's idle share beside the same run with (or, synchronous, without)
its flush, rank 0's share the one its metrics.jsonl records step by step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.test_engine import save_model_dir, small_model_config

SEQ, MBS, M, STEPS = 16, 2, 4, 3
TRAIN = ["training_scripts/train.py", "--config", "training_scripts/configs/tiny_moe.yaml"]


def _setup(tmp_path):
    config = small_model_config("tiny-mixtral")
    config.vocab_size = 8192  # the built-in tokenizer's size, so the export ships it
    save_model_dir(config, tmp_path / "model")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.vocab_size, (STEPS * MBS * M + 5, SEQ), generator=gen)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))
    return config, rows


def _overrides(tmp_path, out):
    """The recursion's settings over tiny_moe.yaml's: synchronous, no Error Feedback, nothing held out."""
    return ["--model_config", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
            "--schedule", "1f1b", "--ef", "false", "--eval_fraction", "0",
            "--shuffle", "false", "--seq_len", str(SEQ), "--micro_batch_size", str(MBS), "--n_microbatches", str(M),
            "--optimizer", "sgd", "--learning_rate", "0.5", "--momentum", "0.9", "--weight_decay", "0.01",
            "--max_grad_norm", "0.5", "--lr_scheduler_type", "linear", "--warmup_steps", "1",
            "--max_steps", str(STEPS), "--logging_steps", "1", "--seed", "7", "--output_dir", str(out)]


def _microbatch_losses(model, config, rows, k):
    """Gradient accumulation over minibatch k's microbatches (loss / m); returns its mean LM loss."""
    lm = 0.0
    for mb in rows[k * MBS * M:(k + 1) * MBS * M].chunk(M):
        out = model(input_ids=mb, labels=mb)
        (out.loss / M).backward()
        lm += (out.loss - config.router_aux_loss_coef * out.aux_loss).item() / M
    return lm


def _sgd(model):
    """The reference optimizer: weight decay on the parameters transformers.Trainer decays."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if (n in decay) == decays],
               "weight_decay": 0.01 if decays else 0.0} for decays in (True, False)]
    return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


def _reference(config, rows, max_grad_norm=0.5):
    from transformers import get_scheduler

    from hf_asyncpp.models import build_model

    model = build_model(config, seed=7)  # train.py's starting weights (the run's seed is 7)
    opt = _sgd(model)
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=STEPS)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        lm = _microbatch_losses(model, config, rows, k)
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        losses.append(lm)
    return losses, model


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _check_run(out, expected_losses, reference_model, n_ranks, delay=0):
    from transformers import AutoModelForCausalLM

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("step", "epoch", "loss", "aux_loss", "learning_rate", "grad_norm", "num_input_tokens_seen",
                "train_tokens_per_second", "step_time_s", "schedule"):
        assert key in records[0]
    assert len(records[0]["idle_fraction_per_rank"]) == n_ranks
    # Weight-version age per stage: steps 0 and 1 both run on the initial weights, then `delay`.
    assert [r["weight_version_age_per_stage"] for r in records] == [
        [min(k, delay)] * len(records[0]["weight_version_age_per_stage"]) for k in range(STEPS)
    ]
    assert records[-1]["num_input_tokens_seen"] == STEPS * MBS * M * SEQ
    assert [r["loss"] for r in records] == pytest.approx(expected_losses, abs=1e-5)
    assert all(r["aux_loss"] > 0 for r in records)
    # By default the run also reports to tensorboard (output_dir/runs) and draws its loss curves.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs")).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert (out / "loss_curves.png").read_bytes().startswith(b"\x89PNG")
    exported = AutoModelForCausalLM.from_pretrained(out / "final")
    ours, theirs = dict(exported.named_parameters()), dict(reference_model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert max((ours[n] - theirs[n]).abs().max().item() for n in ours) < 1e-5


def _check_closing_lines(stderr: str, out, schedule: str, flushed: str) -> None:
    """The two lines after training: the measured idle share of each of the two ranks, then the run with
    `flushed`'s flush added (an asynchronous schedule: more idle) or taken away (a synchronous one: less)."""
    shares = r"(\d\.\d\d), (\d\.\d\d)"
    measured = re.search(rf"\[hf_asyncpp\] idle share by pipeline rank over {STEPS} steps of {schedule} "
                         rf"\(1 − forward/backward compute / step wall time\): {shares}\n", stderr)
    change = "takes [\\d.]+ s of each [\\d.]+ s step; without it they would idle" if flushed == schedule else (
        "would add [\\d.]+ s to each [\\d.]+ s step, idling them")
    other = re.search(rf"\[hf_asyncpp\] {flushed}'s flush {change} {shares} \(timing model at the measured "
                      rf"compute; \d\.\d\d on equal stages\)\n", stderr)
    assert measured and other and other.start() == measured.end(), stderr[-3000:]
    measured, other = [float(x) for x in measured.groups()], [float(x) for x in other.groups()]
    assert all(0 <= x <= 1 for x in measured + other)
    assert all(o >= m for o, m in zip(other, measured)) if flushed != schedule else all(
        o <= m for o, m in zip(other, measured))
    # Rank 0's share over the run is its per-step idle fractions weighted by its step times (logged every step).
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    wall = sum(r["step_time_s"] for r in records)
    assert measured[0] == pytest.approx(sum(r["idle_fraction_per_rank"][0] * r["step_time_s"] for r in records) / wall,
                                        abs=0.0051)


LAUNCHERS = {
    "accelerate": (["accelerate", "launch", "--config_file", "training_scripts/accelerate/cpu_2proc.yaml"], "1f1b"),
    "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"], "interleaved-1f1b"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launched_on_two_ranks_the_run_follows_the_recursion(tmp_path, launcher):
    config, rows = _setup(tmp_path)
    out = tmp_path / "run"
    prefix, schedule = LAUNCHERS[launcher]
    cmd = [*prefix, *TRAIN, *_overrides(tmp_path, out), "--pp_size", "2", "--schedule", schedule]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, model = _reference(config, rows)
    _check_run(out, losses, model, n_ranks=2)
    _check_closing_lines(proc.stderr, out, schedule, flushed=schedule)


@pytest.mark.launch
def test_plain_python_runs_one_process_with_the_same_result(tmp_path):
    config, rows = _setup(tmp_path)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, *TRAIN, *_overrides(tmp_path, out)], capture_output=True, text=True,
                          env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[hf_asyncpp] one process (no launcher): pp_size 2 → 1" in proc.stderr
    assert "idle share" not in proc.stderr  # no pipeline, nothing to wait for
    losses, model = _reference(config, rows)
    _check_run(out, losses, model, n_ranks=1)


@pytest.mark.launch
def test_accelerate_cpu_mode_that_would_run_undistributed_is_refused(tmp_path):
    out = tmp_path / "run"
    cmd = ["accelerate", "launch", "--cpu", "--num_processes", "2", *TRAIN, "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode != 0
    assert "asked for 2 processes but started one" in proc.stderr
    assert not out.exists()


def _reference_2bw(config, rows):
    """PipeDream-2BW's rule written out with plain transformers + torch.optim: the gradient of
    minibatch k is taken at x_{max(k−1, 0)} and applied to x_k (the update rule w_{k+1} = w_k − U(g_{k−1}(w_{k−1})),
    with w_k = x_{k−1}); after the last step nothing is pending."""
    import copy

    from transformers import get_scheduler

    from hf_asyncpp.models import build_model

    current = build_model(config, seed=7)
    stale = copy.deepcopy(current)
    opt = _sgd(current)
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=STEPS)
    previous = copy.deepcopy(current.state_dict())  # x_{k−1}
    losses = []
    for k in range(STEPS):
        stale.load_state_dict(previous)
        stale.zero_grad()
        lm = _microbatch_losses(stale, config, rows, k)
        previous = copy.deepcopy(current.state_dict())
        for p, q in zip(current.parameters(), stale.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        sched.step()
        losses.append(lm)
    return losses, current


@pytest.mark.multirank
@pytest.mark.parametrize("launch", ["torchrun pp 2", "python (emulator)"])
def test_pipedream_2bw_run_follows_the_one_step_delayed_recursion(tmp_path, launch):
    config, rows = _setup(tmp_path)
    out = tmp_path / "run"
    args = [*TRAIN, *_overrides(tmp_path, out), "--schedule", "pipedream-2bw", "--max_grad_norm", "0"]
    if launch.startswith("torchrun"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *args, "--pp_size", "2"]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, model = _reference_2bw(config, rows)
    # Against the same run without delay: the warm-up makes update 0 zero (lr 0), so steps 0 and 1 see
    # the same weights in both; step 2 does not (2BW is one update behind), so the delay — and only
    # the delay — changes the trajectory.
    sync_losses, _ = _reference(config, rows, max_grad_norm=0)
    assert losses[:2] == pytest.approx(sync_losses[:2], abs=1e-6)
    assert abs(losses[2] - sync_losses[2]) > 1e-4
    _check_run(out, losses, model, n_ranks=2 if launch.startswith("torchrun") else 1, delay=1)
    if launch.startswith("torchrun"):
        _check_closing_lines(proc.stderr, out, "pipedream-2bw", flushed="1f1b")


@pytest.mark.launch
def test_epochs_and_a_warmup_ratio_become_steps_once_the_data_is_read(tmp_path):
    """num_train_epochs 1 over 29 blocks at 8 a step is ceil(3.625) = 4 steps, and a warmup_ratio of 0.5
    of them is 2 (rounded up, as Trainer does): the same run as max_steps 4, warmup_steps 2."""
    _setup(tmp_path)

    def run(out, *schedule):
        overrides = _overrides(tmp_path, out)
        cut = overrides.index("--warmup_steps")
        overrides = overrides[:cut] + overrides[cut + 4:]  # --warmup_steps 1 --max_steps N
        proc = subprocess.run([sys.executable, *TRAIN, *overrides, *schedule], capture_output=True, text=True,
                              env=_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    by_epochs = run(tmp_path / "epochs", "--num_train_epochs", "1", "--warmup_ratio", "0.5")
    by_steps = run(tmp_path / "steps", "--max_steps", "4", "--warmup_steps", "2")
    assert [r["step"] for r in by_epochs] == [1, 2, 3, 4]
    assert [(r["loss"], r["learning_rate"]) for r in by_epochs] == [(r["loss"], r["learning_rate"]) for r in by_steps]
