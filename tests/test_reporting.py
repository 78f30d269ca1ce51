"""Experiment trackers (hf_asyncpp.reporting).

`check_report_to` must refuse, with one clear message, an unknown tracker, "none" mixed with trackers
and a tracker whose package is missing. `Reporters` must send each record's numeric scalars to
TensorBoard under transformers' tag names (`train/<key>`, `eval/<key without eval_>`) at the logged
step, and skip everything else; the event files are read back with TensorBoard's own reader.
"""

from __future__ import annotations

import importlib.util

import pytest

CONFIG = {"schedule": "pipedream-2bw", "optimizer": "muon", "max_steps": 3}


def _train_record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "aux_loss": 0.01, "learning_rate": 1e-3, "grad_norm": 0.5,
            "num_input_tokens_seen": step * 64,
            "idle_fraction_per_rank": [0.1, 0.2], "weight_version_age_per_stage": [1, 1],
            "schedule": "pipedream-2bw", "unset": None, "finished": True}


def _read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def test_tensorboard_receives_train_and_eval_scalars_at_their_steps(tmp_path):
    from hf_asyncpp.reporting import Reporters

    log_dir = tmp_path / "runs"
    reporters = Reporters(["tensorboard"], log_dir, "tiny-run", CONFIG)
    for step, loss in [(1, 5.5), (2, 4.25), (3, 3.0)]:
        record = _train_record(step, loss)
        reporters.log(record, step=record["step"])
    reporters.log({"step": 3, "eval_loss": 3.5, "eval_perplexity": 33.1, "eval_tokens": 4096}, step=3)
    reporters.close()

    events = _read_events(log_dir)
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(1, 5.5), (2, 4.25), (3, 3.0)]
    assert [(event.step, event.value) for event in events.Scalars("eval/loss")] == [(3, 3.5)]
    assert [event.value for event in events.Scalars("train/num_input_tokens_seen")] == [64, 128, 192]
    assert "eval/perplexity" in events.Tags()["scalars"]


def test_per_rank_lists_become_named_scalars_and_strings_booleans_none_and_the_step_are_not_logged(tmp_path):
    from hf_asyncpp.reporting import Reporters

    reporters = Reporters(["tensorboard"], tmp_path, "tiny-run", CONFIG)
    reporters.log({**_train_record(1, 5.0), "train_tokens_per_second": 900.0}, step=1)
    reporters.close()

    events = _read_events(tmp_path)
    assert set(events.Tags()["scalars"]) == {
        "train/loss", "train/aux_loss", "train/learning_rate", "train/grad_norm", "train/num_input_tokens_seen",
        "train/tokens_per_second",  # not train/train_tokens_per_second
        "train/idle_fraction_rank_0", "train/idle_fraction_rank_1",
        "train/weight_version_age_stage_0", "train/weight_version_age_stage_1"}
    assert [e.value for e in events.Scalars("train/idle_fraction_rank_1")] == [pytest.approx(0.2)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is a dev requirement")
def test_a_run_resumed_from_its_checkpoint_continues_its_wandb_run(tmp_path, monkeypatch):
    """W&B offline (nothing leaves the machine): the run ids a checkpoint keeps (Reporters.run_ids) open
    the same run again, so a requeued job's curves continue instead of starting a new run."""
    from hf_asyncpp.reporting import Reporters

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = Reporters(["wandb"], tmp_path / "runs", "tiny-run", CONFIG)
    first.log(_train_record(1, 5.0), step=1)
    kept = first.run_ids()
    first.close()
    resumed = Reporters(["wandb"], tmp_path / "runs", "tiny-run", CONFIG, run_ids=kept)
    resumed.log(_train_record(2, 4.0), step=2)
    assert resumed.run_ids() == kept and set(kept) == {"wandb"}
    resumed.close()
    runs = sorted(p.name for p in (tmp_path / "runs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(kept["wandb"] in name for name in runs)  # two sessions of one run


def test_no_tracker_writes_nothing(tmp_path):
    from hf_asyncpp.reporting import Reporters

    for report_to in ([], ["none"]):
        reporters = Reporters(report_to, tmp_path / "runs", "tiny-run", CONFIG)
        reporters.log(_train_record(1, 5.0), step=1)
        reporters.close()
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("report_to, message", [
    (["tensorbord"], "unknown tracker 'tensorbord'; choose from tensorboard, wandb, trackio or none"),
    (["none", "tensorboard"], "'none' cannot be combined with trackers"),
])
def test_check_report_to_refuses_unknown_names_and_none_with_trackers(report_to, message):
    from hf_asyncpp.reporting import check_report_to

    with pytest.raises(ValueError, match=message):
        check_report_to(report_to)


def test_check_report_to_accepts_installed_trackers_and_none():
    from hf_asyncpp.reporting import check_report_to

    for report_to in ([], ["none"], ["tensorboard"]):
        check_report_to(report_to)


@pytest.mark.skipif(importlib.util.find_spec("trackio") is not None, reason="trackio is installed here")
def test_a_tracker_without_its_package_says_how_to_install_it(tmp_path):
    from hf_asyncpp.reporting import Reporters, check_report_to

    message = "report_to trackio needs the trackio package: pip install trackio"
    with pytest.raises(ValueError, match=message):
        check_report_to(["tensorboard", "trackio"])
    # Refused before any tracker opens: no TensorBoard run is left behind.
    with pytest.raises(ValueError, match=message):
        Reporters(["tensorboard", "trackio"], tmp_path / "runs", "tiny-run", CONFIG)
    assert not (tmp_path / "runs").exists()


@pytest.mark.multirank  # two train.py processes
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is a dev requirement")
def test_a_requeued_job_logs_on_in_the_wandb_run_its_checkpoint_names(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = tmp_path / "run"
    command = [sys.executable, "training_scripts/train.py", "--config", "training_scripts/configs/tiny_moe.yaml",
               "--seq_len", "32", "--n_microbatches", "2", "--micro_batch_size", "2", "--eval_fraction", "0",
               "--save_steps", "2", "--logging_steps", "1", "--save_final", "false", "--report_to", "wandb",
               "--resume_from_checkpoint", "latest", "--output_dir", str(out)]
    for steps in (2, 4):  # the first job ends at its checkpoint; the second resumes it
        done = subprocess.run([*command, "--max_steps", str(steps)], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    import json

    kept = json.loads((out / "checkpoint-2" / "pipeline_state.json").read_text())["tracker_run_ids"]
    runs = sorted(p.name for p in (out / "runs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(kept["wandb"] in name for name in runs)
