"""The gaps along the run (steps.md): at each report step, a delayed row's held-out gap beside its
training-loss gap (the mean logged training loss over the TRAIN_WINDOW steps up to the step), each paired by
seed against the sync arm; and the results table's training-loss gap at each arm's end. Arms are written as
finished records with logged curves built so that every number has a known answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_asyncpp.provenance import NUMERICS
from hf_asyncpp.study import load_study, report
from hf_asyncpp.study.grid import Arm
from hf_asyncpp.study.steps import TRAIN_WINDOW

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "training_scripts" / "configs" / "tiny_moe.yaml"


def _study(tmp_path, **keys):
    raw = dict(name="t", base_config=str(BASE), base={"max_steps": 500, "eval_fraction": 0.05},
               optimizers={"adamw": [3e-3]}, modes=["sync", "pipedream-2bw"], ef=[0, 1.0], momentum=[0.9],
               seeds=[1, 2], output_dir=str(tmp_path / "out"), report_steps=[250, 500])
    raw.update(keys)
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(raw))
    return load_study(path)


def _finish(study, arm: Arm, held_out: dict[int, float], training: float) -> None:
    """An arm's record and curves: evaluations `held_out` (step → loss); training losses logged every 10
    steps, `training` + 1 before the last window of each report step and alternating training ± 0.1 inside it
    (whose mean is `training`)."""
    from hf_asyncpp.study.runner import _settings, arm_dir

    directory = arm_dir(study, arm)
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(10, 501, 10):
        in_window = any(s - TRAIN_WINDOW < step <= s for s in (250, 500))
        loss = training + (0.1 if step % 20 else -0.1) if in_window else training + 1.0
        lines.append({"step": step, "loss": loss})
        if step in held_out:
            lines.append({"step": step, "eval_loss": held_out[step]})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (directory / "arm.json").write_text(json.dumps(
        {"arm": arm.__dict__, "mode": arm.mode, "settings": _settings(study, arm),
         "final_eval": {"step": 500, "eval_loss": held_out[500]}, "provenance": {"numerics": NUMERICS}}))


def _grid(tmp_path):
    study = _study(tmp_path)
    # Per seed: sync, 2BW and 2BW + EF; held-out at 250 and 500, training loss (its windows' mean).
    runs = {("sync", 0.0): {1: ((5.0, 4.0), 3.5), 2: ((5.2, 4.2), 3.7)},
            ("pipedream-2bw", 0.0): {1: ((5.4, 4.2), 3.9), 2: ((5.6, 4.4), 4.1)},
            ("pipedream-2bw", 1.0): {1: ((5.1, 4.1), 3.6), 2: ((5.3, 4.3), 3.9)}}
    for (schedule, ef), seeds in runs.items():
        for seed, ((at_250, at_500), training) in seeds.items():
            arm = Arm("adamw", schedule, 1 if schedule == "sync" else 2, ef, 0.9, 3e-3, seed)
            _finish(study, arm, {250: at_250, 500: at_500}, training)
    return study


def test_each_report_step_gets_the_held_out_and_training_loss_gaps_paired_by_seed(tmp_path):
    study = _grid(tmp_path)
    report(study)
    rows = json.loads((study.output_dir / "steps.json").read_text())["rows"]
    by = {(r["mode"], r["ef_lambda"], r["step"]): r for r in rows}
    assert set(by) == {("pipedream-2bw@2", ef, step) for ef in (0.0, 1.0) for step in (250, 500)}
    no_ef_250, ef_500 = by[("pipedream-2bw@2", 0.0, 250)], by[("pipedream-2bw@2", 1.0, 500)]
    assert no_ef_250["gap"] == pytest.approx([0.4, 0.0])  # 5.4 − 5.0 and 5.6 − 5.2
    assert no_ef_250["train_gap"] == pytest.approx([0.4, 0.0])  # 3.9 − 3.5, 4.1 − 3.7
    assert ef_500["gap"] == pytest.approx([0.1, 0.0])
    assert ef_500["train_gap"][0] == pytest.approx(0.15)  # 0.1 and 0.2
    assert ef_500["ef_recovered"] == pytest.approx(0.5)  # (0.2 − 0.1) / 0.2
    text = (study.output_dir / "steps.md").read_text()
    assert "| adamw | 0.9 | pipedream-2bw@2 | 1 | 500 | +0.100 ± 0.000 (2 seeds) | +0.150 ± 0.071 (2 seeds) | 50% |" in text
    assert text.startswith("Seeds 1, 2: no arm chose a learning rate")


def test_the_results_table_carries_the_training_loss_gap_at_the_end_beside_the_held_out_one(tmp_path):
    study = _grid(tmp_path)
    report(study)
    rows = json.loads((study.output_dir / "results.json").read_text())["rows"]
    no_ef = next(r for r in rows if r["mode"] == "pipedream-2bw@2" and r["ef_lambda"] == 0.0)
    assert (no_ef["gap"], no_ef["train_gap"]) == (pytest.approx(0.2), pytest.approx(0.4))
    assert next(r for r in rows if r["mode"] == "sync")["train_gap"] == pytest.approx(0.0)
    summary = (study.output_dir / "summary.md").read_text()
    assert "The same gap in training loss" in summary and "+0.400 ± 0.000 (2 seeds)" in summary


def test_a_study_without_report_steps_writes_no_steps_table(tmp_path):
    study = _grid(tmp_path)
    study.report_steps = ()
    report(study)
    assert not (study.output_dir / "steps.md").exists()


def test_report_steps_must_be_positive(tmp_path):
    from hf_asyncpp.study.grid import StudyError

    with pytest.raises(StudyError, match="report_steps"):
        _study(tmp_path, report_steps=[0, 250])
