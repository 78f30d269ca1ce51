"""Learning-rate tuning, one rule for both protocols: the lowest final validation loss of the first seed
picks; a pick at the edge of three or more candidates adds one past it (up to lr_extensions times) and
is flagged when still at the edge. Under `per_mode` each delayed (optimizer, mode, EF λ, momentum) tunes
its own rate among the sync pick × the study's factors; `both` reports the two protocols side by side.

Arms "run" here by writing their records from a loss table (runner.run_arms replaced), so the tuning's
rounds, their order and the report are checked without training anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_asyncpp.provenance import NUMERICS
from hf_asyncpp.study import load_study, read_chosen, read_per_mode, report, run_study
from hf_asyncpp.study.grid import Arm, StudyError
from hf_asyncpp.study.tuning import candidates

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "training_scripts" / "configs" / "tiny_moe.yaml"


def _study_file(tmp_path, **keys) -> Path:
    raw = dict(name="t", base_config=str(BASE), base={"max_steps": 300, "eval_fraction": 0.05},
               optimizers={"adamw": [1.0e-3, 3.0e-3, 1.0e-2]}, modes=["sync", "pipedream-2bw"], ef=[0, 1.0],
               momentum=[0.9], seeds=[0, 1], output_dir=str(tmp_path / "out"))
    raw.update(keys)
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def finish(study, arm: Arm, eval_loss: float, numerics: str = NUMERICS) -> None:
    """Write `arm`'s record as the runner does for an arm that finished with its current settings."""
    from hf_asyncpp.study.runner import _settings, arm_dir

    directory = arm_dir(study, arm)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": eval_loss + 1.0}) + "\n")
    (directory / "arm.json").write_text(json.dumps(
        {"arm": arm.__dict__, "mode": arm.mode, "settings": _settings(study, arm), "final_eval": {"eval_loss": eval_loss},
         "provenance": {"numerics": numerics}}))


@pytest.fixture
def fake_runs(monkeypatch):
    """run_arms replaced: as the runner, it skips the finished arms it is given and runs the others, each
    finishing with loss(arm); each call's arms that ran are recorded (a batch), in order."""
    from hf_asyncpp.study.runner import finished_record

    batches: list[list[str]] = []

    def install(loss):
        def run_arms(study, arms, log):
            assert len({arm.name for arm in arms}) == len(arms), "an arm given twice would run twice at once"
            ran = [arm for arm in arms if finished_record(study, arm) is None]
            batches.append([arm.name for arm in ran])
            for arm in ran:
                finish(study, arm, loss(arm))
            return {arm.name: "done" if arm in ran else "skipped" for arm in arms}

        import hf_asyncpp.study as study_package
        import hf_asyncpp.study.tuning as tuning

        monkeypatch.setattr(tuning, "run_arms", run_arms)
        monkeypatch.setattr(study_package, "run_arms", run_arms)
        return batches

    return install


def _valley(best: float, delayed_best: float | None = None):
    """A loss with its minimum at `best` for sync arms and at `delayed_best` for delayed ones: log-distance."""
    import math

    def loss(arm: Arm) -> float:
        centre = best if arm.synchronous or delayed_best is None else delayed_best
        return 4.0 + abs(math.log10(arm.learning_rate / centre)) + 0.01 * arm.seed + 0.1 * (not arm.synchronous)

    return loss


# The rule

def test_a_pick_inside_its_candidates_adds_none():
    assert candidates([1e-3, 3e-3, 1e-2], {1e-3: 5.0, 3e-3: 4.0, 1e-2: 4.5}, extensions=2, tolerance=0.0) == [1e-3, 3e-3, 1e-2]


def test_an_edge_pick_adds_one_step_past_it_on_a_log_scale_and_again_while_still_at_the_edge():
    lrs = [1e-3, 3e-3, 1e-2]
    assert candidates(lrs, {1e-3: 5.0, 3e-3: 4.5, 1e-2: 4.0}, extensions=2, tolerance=0.0) == [1e-3, 3e-3, 1e-2, 0.033]
    # The added one finished best again: one more, no further than the limit.
    done = {1e-3: 5.0, 3e-3: 4.5, 1e-2: 4.0, 0.033: 3.9}
    assert candidates(lrs, done, extensions=2, tolerance=0.0) == [1e-3, 3e-3, 1e-2, 0.033, 0.11]
    assert candidates(lrs, {**done, 0.11: 3.8}, extensions=2, tolerance=0.0) == [1e-3, 3e-3, 1e-2, 0.033, 0.11]
    assert candidates(lrs, {1e-3: 4.0, 3e-3: 4.5, 1e-2: 5.0}, extensions=1, tolerance=0.0) == [0.00033, 1e-3, 3e-3, 1e-2]


def test_no_candidate_is_added_before_every_listed_one_finished_or_with_fewer_than_three():
    assert candidates([1e-3, 3e-3, 1e-2], {1e-3: 4.0, 3e-3: 4.5}, extensions=2, tolerance=0.0) == [1e-3, 3e-3, 1e-2]
    assert candidates([1e-3, 3e-3], {1e-3: 4.0, 3e-3: 4.5}, extensions=2, tolerance=0.0) == [1e-3, 3e-3]


def test_candidates_within_the_tie_tolerance_of_the_best_resolve_to_the_larger_rate():
    from hf_asyncpp.study.tuning import tied

    losses = {1e-3: 4.000, 3e-3: 4.004, 1e-2: 4.2}
    assert tied(losses, 0.005) == [1e-3, 3e-3]
    assert tied(losses, 0.003) == [1e-3]
    assert tied({}, 0.005) == []
    # The smallest rate is best, but the middle one ties with it: no edge pick, so nothing is added.
    assert candidates([1e-3, 3e-3, 1e-2], losses, extensions=2, tolerance=0.005) == [1e-3, 3e-3, 1e-2]
    # With a strict rule the same losses put the pick at the edge, and one is added below it.
    assert candidates([1e-3, 3e-3, 1e-2], losses, extensions=1, tolerance=0.0) == [0.00033, 1e-3, 3e-3, 1e-2]


def test_a_tie_picks_the_larger_rate_and_tuning_json_marks_the_tied_ones(tmp_path, fake_runs):
    losses = {1e-3: 4.30, 3e-3: 4.001, 1e-2: 4.004}  # 3e-3 is lowest by 0.003: a tie at the default 0.005

    fake_runs(lambda arm: losses.get(arm.learning_rate, 4.5) + (0.1 if not arm.synchronous else 0.0))
    run_study(_study_file(tmp_path), log=lambda *_: None)
    study = load_study(_study_file(tmp_path))
    assert read_chosen(study) == {("adamw", 0.9): 1e-2}
    tuning = json.loads((study.output_dir / "tuning.json").read_text())
    assert (tuning["tie_tolerance"], tuning["tuning_seed"]) == (0.005, 0)
    assert [(t["learning_rate"], t["tied"], t["chosen"]) for t in tuning["sync"]] == [
        (1e-3, False, False), (3e-3, True, False), (1e-2, True, True), (0.033, False, False)]  # 1e-2 was at the edge
    strict = _study_file(tmp_path, lr_tie_tolerance=0.0)
    assert read_chosen(load_study(strict)) == {("adamw", 0.9): 3e-3}


# The sync protocol

def test_sync_tuning_extends_an_edge_pick_then_every_delayed_arm_reuses_the_sync_pick(tmp_path, fake_runs):
    batches = fake_runs(_valley(best=0.033, delayed_best=0.0033))
    run_study(_study_file(tmp_path), log=lambda *_: None)
    study = load_study(_study_file(tmp_path))
    assert batches[0] == [a.name for a in study.tuning_arms()]  # the file's candidates first
    assert batches[1] == ["adamw-sync-m0.9-lr0.033-s0"]  # 0.01 was best, at the edge: one past it
    assert batches[2] == ["adamw-sync-m0.9-lr0.11-s0"]  # 0.033 best, at the edge again: one more
    assert read_chosen(study) == {("adamw", 0.9): 0.033}
    assert {a.learning_rate for a in study.arms(read_chosen(study))} == {0.033}
    tuning = json.loads((study.output_dir / "tuning.json").read_text())
    assert [(t["learning_rate"], t["chosen"], t["at_edge"]) for t in tuning["sync"]] == [
        (1e-3, False, False), (3e-3, False, False), (1e-2, False, False), (0.033, True, False), (0.11, False, False)]
    assert tuning["per_mode"] == []


def test_a_pick_still_at_the_edge_after_the_extensions_is_warned_about_and_flagged(tmp_path, fake_runs):
    fake_runs(_valley(best=10.0))  # far beyond every candidate
    logged = []
    run_study(_study_file(tmp_path, lr_extensions=1), log=logged.append)
    assert any("still the largest of its candidates after 1 extension" in line for line in logged)
    tuning = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert [t["at_edge"] for t in tuning["sync"] if t["chosen"]] == [True]


# The per_mode protocol, and both

def test_per_mode_tunes_each_delayed_mode_and_ef_among_factors_of_the_sync_pick(tmp_path, fake_runs):
    batches = fake_runs(_valley(best=3e-3, delayed_best=3e-4))
    path = _study_file(tmp_path, lr_protocol="both", per_mode_lr_factors=[0.1, 0.3, 1.0])
    run_study(path, log=lambda *_: None)
    study = load_study(path)
    chosen = read_chosen(study)
    assert chosen == {("adamw", 0.9): 3e-3}
    per_mode = read_per_mode(study, chosen)
    two_bw = ("pipedream-2bw", 2, 0)
    assert per_mode == {("adamw", two_bw, 0.0, 0.9): 3e-4, ("adamw", two_bw, 1.0, 0.9): 3e-4}
    # Round 2: the per_mode candidates (×0.1, ×0.3; ×1 is the sync protocol's own arm) beside the sync
    # protocol's arms; the ×0.1 pick is at the edge, so round 3 adds 0.1 × 0.1/0.3 = ×0.033.
    assert "adamw-pipedream-2bw-p2-m0.9-lr0.0003-s0" in batches[1]
    assert "adamw-pipedream-2bw-p2-ef1-m0.9-lr0.003-s1" in batches[1]  # sync protocol, seed 1: no wait
    assert sorted(batches[2]) == ["adamw-pipedream-2bw-p2-ef1-m0.9-lr0.0001-s0", "adamw-pipedream-2bw-p2-m0.9-lr0.0001-s0"]
    assert "adamw-pipedream-2bw-p2-m0.9-lr0.0003-s1" in batches[-1]  # per_mode's seeds at its pick, last
    rows = json.loads((study.output_dir / "results.json").read_text())["rows"]
    gaps = {(r["protocol"], r["ef_lambda"]): r["learning_rate"] for r in rows if r["mode"] != "sync"}
    assert gaps == {("sync", 0.0): 3e-3, ("sync", 1.0): 3e-3, ("per_mode", 0.0): 3e-4, ("per_mode", 1.0): 3e-4}
    headline = (study.output_dir / "headline.md").read_text()
    assert "Protocol `sync`" in headline and "Protocol `per_mode`" in headline
    assert (study.output_dir / "gap_bars.png").is_file() and (study.output_dir / "gap_bars_per_mode.png").is_file()


def test_an_unknown_protocol_or_a_non_positive_factor_is_refused(tmp_path):
    with pytest.raises(StudyError, match="lr_protocol must be one of sync, per_mode, both"):
        load_study(_study_file(tmp_path, lr_protocol="delayed"))
    with pytest.raises(StudyError, match="per_mode_lr_factors"):
        load_study(_study_file(tmp_path, lr_protocol="per_mode", per_mode_lr_factors=[0.1, 0]))


# Numerics

def test_an_arm_finished_under_other_numerics_is_stale_reruns_and_is_left_out_of_the_report(tmp_path, fake_runs):
    path = _study_file(tmp_path, optimizers={"adamw": [3e-3]})
    study = load_study(path)
    old = Arm("adamw", "pipedream-2bw", 2, 0.0, 0.9, 3e-3, 0)
    for arm in study.arms(read_chosen(study)):
        finish(study, arm, 4.0, numerics="2026-01-01" if arm == old else NUMERICS)
    report(study)
    results = json.loads((study.output_dir / "results.json").read_text())
    assert results["stale_arms"] == [old.name] and old.name not in results["arms"]
    assert "Stale arms" in (study.output_dir / "results.md").read_text()
    batches = fake_runs(lambda arm: 5.0)
    run_study(path, log=lambda *_: None)
    assert batches == [[old.name]]  # the other arms' records stand
    assert json.loads((study.output_dir / "results.json").read_text())["stale_arms"] == []
    record = json.loads((study.output_dir / "arms" / old.name / "arm.json").read_text())
    assert record["final_eval"]["eval_loss"] == 5.0 and record["provenance"]["numerics"] == NUMERICS


# Tuning apart from reporting

def test_the_report_reads_no_arm_of_the_tuning_seed_and_says_which_seeds_it_reads(tmp_path, fake_runs):
    fake_runs(_valley(best=3e-3))  # the tuning seed's loss is 0.01 below seed 1's (_valley)
    path = _study_file(tmp_path, seeds=[0, 1, 2])
    run_study(path, log=lambda *_: None)
    study = load_study(path)
    assert (study.tuning_seed, study.reported_seeds) == (0, [1, 2])
    results = json.loads((study.output_dir / "results.json").read_text())
    assert results["arms"] and all(name.endswith(("-s1", "-s2")) for name in results["arms"])
    sync = next(r for r in results["rows"] if r["mode"] == "sync")
    assert sync["seeds"] == 2 and sync["val_loss"] == pytest.approx(4.015)  # seeds 1 and 2: 4.01, 4.02
    for name in ("summary.md", "results.md", "headline.md"):
        assert "Seeds 1, 2: seed 0's arms chose the learning rates" in (study.output_dir / name).read_text()


def test_a_study_that_fixes_its_rates_in_advance_reports_every_seed(tmp_path, fake_runs):
    fake_runs(_valley(best=3e-3))
    path = _study_file(tmp_path, optimizers={"adamw": [3e-3]}, seeds=[1, 2])
    run_study(path, log=lambda *_: None)
    study = load_study(path)
    assert (study.tuning_seed, study.reported_seeds) == (None, [1, 2])
    assert "Seeds 1, 2: no arm chose a learning rate" in (study.output_dir / "summary.md").read_text()
    # per_mode with a single factor chooses nothing either.
    assert load_study(_study_file(tmp_path, optimizers={"adamw": [3e-3]}, lr_protocol="per_mode",
                                  per_mode_lr_factors=[1.0], seeds=[1])).tuning_seed is None


def test_a_study_that_tunes_on_its_only_seed_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(StudyError, match="chooses learning rates on seed 0.*list at least one more seed"):
        load_study(_study_file(tmp_path, seeds=[0]))
    with pytest.raises(StudyError, match="chooses learning rates on seed 3"):
        load_study(_study_file(tmp_path, optimizers={"adamw": [3e-3]}, lr_protocol="per_mode", seeds=[3]))
