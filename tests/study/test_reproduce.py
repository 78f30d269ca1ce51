"""Reproducing finished arms: a rerun is held to its record value by value (timings aside), a whole rerun
by its final validation loss within the tolerance, a partial one by every value up to the step it was
stopped at within the relative bound of floating-point order (a numerics change starts that small and
grows later); a rerun that stopped short or lost a record does not agree."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml

from hf_asyncpp.study.reproduce import PREFIX_RTOL, TOLERANCE, compare_records
from tests.study.test_tuning import _study_file, _valley, fake_runs  # noqa: F401  (the fixture)
from tests.study.test_study_runs import study_file  # noqa: F401  (the fixture)


def _train(step, loss, seconds=1.0):
    return {"step": step, "loss": loss, "grad_norm": 0.5, "learning_rate": 1e-3, "weight_version_age_per_stage": [1, 1],
            "schedule": "pipedream-2bw", "step_time_s": seconds, "train_tokens_per_second": 100 / seconds,
            "idle_fraction_per_rank": [0.1 * seconds, 0.2]}


def _write(directory, records):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _run(losses, final, seconds=1.0):
    records = [_train(10 * (i + 1), loss, seconds) for i, loss in enumerate(losses)]
    return records + ([{"step": 10 * len(losses), "eval_loss": final, "eval_tokens": 64}] if final is not None else [])


RECORDED = _run([5.0, 4.0, 3.5, 3.2], final=3.3)


def test_a_bitwise_rerun_agrees_whatever_its_timings(tmp_path):
    recorded = _write(tmp_path / "recorded", RECORDED)
    rerun = _write(tmp_path / "rerun", _run([5.0, 4.0, 3.5, 3.2], final=3.3, seconds=7.0))
    result = compare_records(recorded, rerun, max_steps=40)
    assert result["bitwise"] and result["agrees"] and result["records"] == 5 and result["steps"] == 40
    assert result["final_eval_loss"] == {"recorded": 3.3, "rerun": 3.3, "difference": 0.0}


def test_a_whole_rerun_is_held_to_its_final_validation_loss_within_the_tolerance(tmp_path):
    recorded = _write(tmp_path / "recorded", RECORDED)
    close = compare_records(recorded, _write(tmp_path / "close", _run([5.0, 4.001, 3.5, 3.2], final=3.305)), 40)
    assert close["agrees"] and not close["bitwise"]
    assert close["max_difference"] == pytest.approx(0.005) and close["max_difference_at"] == "eval_loss at step 40"
    far = compare_records(recorded, _write(tmp_path / "far", _run([5.0, 4.0, 3.5, 3.2], final=3.3 + 1.5 * TOLERANCE)), 40)
    assert not far["agrees"] and far["final_eval_loss"]["difference"] == pytest.approx(1.5 * TOLERANCE)


def test_a_rerun_that_stopped_short_of_the_end_or_of_its_step_does_not_agree(tmp_path):
    recorded = _write(tmp_path / "recorded", RECORDED)
    short = _write(tmp_path / "short", _run([5.0, 4.0], final=None))
    whole = compare_records(recorded, short, max_steps=40)
    assert not whole["agrees"] and whole["final_eval_loss"] is None and whole["bitwise"]  # what ran is equal
    assert compare_records(recorded, short, max_steps=40, until=20)["agrees"]
    assert not compare_records(recorded, short, max_steps=40, until=30)["agrees"]


@pytest.mark.parametrize("relative_change, agrees", [(0.2 * PREFIX_RTOL, True), (3 * PREFIX_RTOL, False),
                                                    (2 * TOLERANCE, False)])
def test_a_partial_rerun_is_held_to_every_value_it_logged_within_floating_point_order(tmp_path, relative_change,
                                                                                     agrees):
    # 3e-5 of a loss of 4 is 1.2e-4: far inside the whole rerun's tolerance, yet a change of numerics.
    recorded = _write(tmp_path / "recorded", RECORDED)
    moved = _write(tmp_path / "moved", _run([5.0, 4.0 * (1 + relative_change), 3.5], final=None))
    result = compare_records(recorded, moved, max_steps=40, until=30)
    assert result["agrees"] == agrees and not result["bitwise"] and result["max_difference_at"] == "loss at step 20"
    assert result["max_relative_difference"] == pytest.approx(relative_change / (1 + relative_change))


@pytest.mark.parametrize("change", ["missing record", "other schedule", "NaN"])
def test_a_record_missing_or_differing_in_kind_does_not_agree(tmp_path, change):
    records = [dict(r) for r in RECORDED]
    if change == "missing record":
        del records[1]
    elif change == "other schedule":
        records[1]["schedule"] = "1f1b"
    else:
        records[1]["loss"] = math.nan
    result = compare_records(_write(tmp_path / "recorded", RECORDED), _write(tmp_path / "rerun", records), 40, until=40)
    assert not result["agrees"] and not result["bitwise"]


def _kept(steps=40, final=True, agrees=True, numerics=None, relative=0.0):
    from hf_asyncpp.provenance import NUMERICS

    return {"steps": steps, "agrees": agrees, "numerics": numerics or NUMERICS, "max_relative_difference": relative,
            "final_eval_loss": {"recorded": 3.3, "rerun": 3.3, "difference": 0.0} if final else None}


@pytest.mark.parametrize("kept, steps, spared", [
    (_kept(), None, True), (_kept(), 20, True),  # a whole rerun that agreed answers whole and partial
    (_kept(steps=20, final=False), 20, True), (_kept(steps=20, final=False), 30, False),
    (_kept(steps=20, final=False), None, False),  # a partial one answers no whole request
    (_kept(numerics="2020-01-01"), None, False),  # kept under other numerics: reruns
    (_kept(agrees=False), None, False),  # one that disagreed reruns (and disagrees again, saying so)
    (_kept(relative=1e-3), 20, False), (None, 20, False)])  # close enough for the final loss, not for a prefix
def test_a_sweep_spares_only_the_arms_whose_kept_comparison_answers_it_under_these_numerics(kept, steps, spared):
    from hf_asyncpp.study.reproduce import _covered

    assert _covered(kept, steps) is spared


def test_a_sweep_of_the_tables_arms_leaves_out_the_arms_only_the_tuning_read(tmp_path, fake_runs):  # noqa: F811
    from hf_asyncpp.study import load_study, run_study, table_arms
    from hf_asyncpp.study.reproduce import _chosen_arms

    fake_runs(_valley(best=3e-3, delayed_best=3e-4))
    path = _study_file(tmp_path, lr_protocol="both", per_mode_lr_factors=[0.1, 0.3, 1.0])
    run_study(path, log=lambda *_: None)
    study = load_study(path)
    tables = {arm.name for arm in _chosen_arms(study, None, tables_only=True)}
    every = {arm.name for arm in _chosen_arms(study, None, tables_only=False)}
    assert tables == {arm.name for arm in table_arms(study)} and tables < every
    assert {"adamw-sync-m0.9-lr0.003-s1", "adamw-pipedream-2bw-p2-m0.9-lr0.003-s1",  # the sync protocol's
            "adamw-pipedream-2bw-p2-ef1-m0.9-lr0.0003-s1"} <= tables  # per_mode's, at its pick
    assert {"adamw-sync-m0.9-lr0.001-s0", "adamw-pipedream-2bw-p2-m0.9-lr0.0001-s0"} <= every - tables


def test_the_report_recounts_the_reproductions_coverage_as_the_tables_arms_change(tmp_path, fake_runs):  # noqa: F811
    from hf_asyncpp.provenance import NUMERICS
    from hf_asyncpp.study import load_study, report, run_study, table_arms
    from hf_asyncpp.study.reproduce import write_reproductions

    fake_runs(_valley(best=3e-3))
    path = _study_file(tmp_path)
    run_study(path, log=lambda *_: None)
    study = load_study(path)
    arm = table_arms(study)[0].name
    whole = {"arm": arm, "steps": 300, "records": 1, "missing": 0, "bitwise": True, "max_difference": 0.0,
             "max_difference_at": None, "max_relative_difference": 0.0, "held_to": "final loss ± 0.01", "agrees": True,
             "final_eval_loss": {"recorded": 4.0, "rerun": 4.0, "difference": 0.0}, "commit": None, "numerics": NUMERICS}
    write_reproductions(study, {arm: whole})
    table = study.output_dir / "reproductions.md"
    # The tables read seed 1's sync, 2BW and 2BW + EF arms (seed 0 tuned).
    assert "Of the 3 finished arms the report's tables read, 1 agree rerun whole" in table.read_text()
    shutil.rmtree(study.output_dir / "arms" / table_arms(study)[-1].name)  # one fewer finished
    assert table in report(study)
    assert "Of the 2 finished arms the report's tables read, 1 agree rerun whole and 0 rerun to a step only" \
        in table.read_text()


@pytest.mark.multirank
def test_finished_arms_rerun_at_this_code_reproduce_their_records_and_a_changed_record_is_caught(
        study_file, tmp_path, capsys):  # noqa: F811
    from hf_asyncpp.cli import main
    from hf_asyncpp.study import load_study, run_study
    from hf_asyncpp.study.reproduce import reproduce_arms

    base = yaml.safe_load((tmp_path / "base.yaml").read_text())
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**base, "max_steps": 40, "eval_steps": 10}))
    raw = {**yaml.safe_load(study_file.read_text()), "modes": ["sync", "pipedream-2bw"], "ef": [1.0], "seeds": [0]}
    study_file.write_text(yaml.safe_dump(raw))
    run_study(study_file, log=lambda *_: None)
    study = load_study(study_file)
    (arm,) = [p.name for p in (study.output_dir / "arms").iterdir() if "-p2-" in p.name]

    # Whole: every record equal, the final loss too.
    (whole,) = reproduce_arms(study, [arm], log=lambda *_: None)
    assert whole["agrees"] and whole["bitwise"] and whole["steps"] == 40 and whole["missing"] == 0
    assert whole["final_eval_loss"]["difference"] == 0.0 and whole["numerics"]
    assert "Of the 2 finished arms the report's tables read, 1 agree rerun whole and 0 rerun to a step only" in (
        study.output_dir / "reproductions.md").read_text()
    rerun_dir = study.output_dir / "reproductions" / "arms" / arm
    assert (rerun_dir / "metrics.jsonl").is_file() and not list(rerun_dir.glob("checkpoint-*"))

    # A sweep (no names) reruns only what is not yet answered under these numerics: the whole rerun answers
    # a request to step 3, so only the sync arm reruns, and its comparison is kept before the sweep ends.
    kept_when_logged = []

    def log(line):
        if "records to step" in line:
            kept_when_logged.append(json.loads((study.output_dir / "reproductions.json").read_text()))
    (swept,) = reproduce_arms(study, steps=3, log=log)
    assert swept["arm"] != arm and swept["agrees"] and kept_when_logged[0].keys() == {arm, swept["arm"]}
    assert reproduce_arms(study, steps=3, log=lambda *_: None) == []  # a second sweep has nothing left

    # Until step 3: stopped by SIGTERM long before its 40 steps, its records so far equal, no checkpoint left.
    (partial,) = reproduce_arms(study, [arm], steps=3, log=lambda *_: None)
    assert partial["agrees"] and partial["bitwise"] and 3 <= partial["steps"] < 40
    assert partial["final_eval_loss"] is None and not list(rerun_dir.glob("checkpoint-*"))
    kept = json.loads((study.output_dir / "reproductions.json").read_text())
    assert kept[arm]["steps"] == partial["steps"]  # the latest comparison of each arm
    table = (study.output_dir / "reproductions.md").read_text()
    assert f"| {arm} |" in table and f"| {swept['arm']} |" in table and table.startswith(
        "2 finished arms rerun from their recorded settings: 2 agree, 2 bit for bit; 0 whole, 2 to step")
    assert "0 agree rerun whole and 2 rerun to a step only" in table and "; 0 not (yet)." in table

    # A committed record that the code does not give: the command says so and exits 1.
    metrics = study.output_dir / "arms" / arm / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records[0]["loss"] += 2 * TOLERANCE
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["study", str(study_file), "--reproduce", arm, "--steps", "3"]) == 1
    assert f"DOES NOT AGREE (relative {PREFIX_RTOL:g})" in capsys.readouterr().err
    # An arm that is not a finished one is one clear error, before anything runs.
    assert main(["study", str(study_file), "--reproduce", "adamw-sync-m0.9-lr0.003-s9"]) == 2
    assert "not a finished arm" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--steps", "3"], ["--tolerance", "0.1"], ["--reproduce", "--report-only"],
                                  ["--reproduce", "--budget-figure", "out"], ["--tables-only"],
                                  ["--reproduce", "some-arm", "--tables-only"]])
def test_reproduce_options_alone_or_mixed_with_another_action_are_a_usage_error(argv, capsys):
    from hf_asyncpp.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["study", "any.yaml", *argv])
    assert exit_.value.code == 2 and "--" in capsys.readouterr().err
