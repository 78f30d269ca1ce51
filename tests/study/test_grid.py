"""The study grid's learning-rate choice per (optimizer, momentum) and its sync-start mode: parsing, arm
expansion, names, overrides, the tuning record and the results rows. Single-process, nothing trains."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_asyncpp.study import StudyError, load_study, read_chosen
from hf_asyncpp.study.grid import Arm, mode_name
from hf_asyncpp.study.results import results_rows

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "training_scripts" / "configs" / "tiny_moe.yaml"


def _study(tmp_path, **keys):
    raw = dict(name="t", base_config=str(BASE), base={"max_steps": 300, "eval_fraction": 0.05},
               optimizers={"adamw": [1.0e-3, 3.0e-3], "muon": [2.0e-2]}, modes=["sync", "pipedream-2bw"],
               ef=[0, 1.0], momentum=[0.9, 0.95], seeds=[0, 1], output_dir=str(tmp_path / "out"))
    raw.update(keys)
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return load_study(path)


# Learning rates per (optimizer, momentum)

def test_tuning_arms_cover_every_momentum_of_every_optimizer_with_several_learning_rates(tmp_path):
    study = _study(tmp_path)
    tuning = study.tuning_arms()
    assert {(a.optimizer, a.momentum, a.learning_rate) for a in tuning} == {
        ("adamw", m, lr) for m in (0.9, 0.95) for lr in (1.0e-3, 3.0e-3)}  # muon has one candidate: no tuning
    assert all(a.synchronous and a.seed == 0 and a.ef_lambda == 0 and a.sync_steps == 0 for a in tuning)


def test_each_optimizer_and_momentum_pair_uses_its_own_chosen_learning_rate(tmp_path):
    study = _study(tmp_path)
    chosen = {("adamw", 0.9): 3.0e-3, ("adamw", 0.95): 1.0e-3, ("muon", 0.9): 2.0e-2, ("muon", 0.95): 2.0e-2}
    arms = study.arms(chosen)
    # optimizers × momentum × the reported seed (seed 0 tunes adamw: it runs only its tuning arms) × (sync + 2BW × EF off/on)
    assert len(arms) == 2 * 2 * 1 * (1 + 2) and {a.seed for a in arms} == {1}
    for arm in arms:
        assert arm.learning_rate == chosen[(arm.optimizer, arm.momentum)]


def test_the_first_reported_seed_runs_whole_then_the_other_seeds_mode_by_mode(tmp_path):
    """A grid run in parts first looks at every mode once, then completes the seeds of one mode after
    another, so the earliest claims get their spread before the later modes run."""
    study = _study(tmp_path, modes=["sync", "pipedream-2bw@2", "pipedream@2"], seeds=[0, 1, 2, 3])
    arms = study.arms(study.first_learning_rates())
    assert 0 not in {a.seed for a in arms}  # the tuning seed runs its tuning arms alone
    first = [a for a in arms if a.seed == 1]
    assert arms[:len(first)] == first  # the first seed's every arm before any other seed's
    later = arms[len(first):]
    modes = [a.mode for a in later]
    assert list(dict.fromkeys(modes)) == ["sync", "pipedream-2bw@2", "pipedream@2"]
    assert modes == sorted(modes, key=modes.index)  # each mode's arms contiguous
    sync_later = [a for a in later if a.synchronous]
    assert {a.seed for a in sync_later} == {2, 3} and len(sync_later) == 2 * 2 * 2  # optimizers × momenta × seeds
    assert sorted(a.name for a in arms) == sorted({a.name for a in arms})  # each arm once
    assert len(arms) == 3 * 2 * 2 * (1 + 2 + 2)  # seeds × optimizers × momenta × (sync, 2BW off/on, PipeDream off/on)


def test_within_a_seed_every_optimizer_runs_a_mode_before_any_runs_the_next(tmp_path):
    study = _study(tmp_path, modes=["sync", "pipedream-2bw@2", "pipedream@2"])
    arms = [a for a in study.arms(study.first_learning_rates()) if a.seed == 1]
    modes = [a.mode for a in arms]
    assert modes == sorted(modes, key=modes.index)  # each mode's arms are contiguous, in the file's order
    assert list(dict.fromkeys(modes)) == ["sync", "pipedream-2bw@2", "pipedream@2"]
    first_delayed = [a for a in arms if not a.synchronous][:8]  # 2 optimizers × 2 momentum values × EF off/on
    assert {a.optimizer for a in first_delayed} == {"adamw", "muon"}
    assert {a.schedule for a in first_delayed} == {"pipedream-2bw"}


def test_a_learning_rate_keyed_by_optimizer_alone_applies_to_all_its_momentum_values(tmp_path):
    study = _study(tmp_path)
    arms = study.arms({"adamw": 1.0e-3, ("muon", 0.95): 2.0e-2, "muon": 5.0e-2})
    assert {a.learning_rate for a in arms if a.optimizer == "adamw"} == {1.0e-3}
    assert {(a.momentum, a.learning_rate) for a in arms if a.optimizer == "muon"} == {(0.9, 5.0e-2), (0.95, 2.0e-2)}
    with pytest.raises(StudyError, match="no learning rate chosen for muon"):
        study.arms({"adamw": 1.0e-3})


def test_the_untuned_pick_is_every_optimizers_first_candidate_at_every_momentum(tmp_path):
    study = _study(tmp_path)
    assert study.first_learning_rates() == {("adamw", 0.9): 1.0e-3, ("adamw", 0.95): 1.0e-3,
                                            ("muon", 0.9): 2.0e-2, ("muon", 0.95): 2.0e-2}
    assert read_chosen(study) == study.first_learning_rates()  # no tuning.json yet


def test_a_sync_start_mode_parses_into_its_schedule_depth_and_synchronous_steps(tmp_path):
    study = _study(tmp_path, modes=["sync", "pipedream-2bw@4+sync100", "pipedream+sync20"], depth=2)
    assert study.modes == [("sync", 1, 0), ("pipedream-2bw", 4, 100), ("pipedream", 2, 20)]


@pytest.mark.parametrize("mode", ["pipedream-2bw@2+sync", "pipedream-2bw@2+sync0", "pipedream-2bw@2+warm10",
                                  "sync+sync10", "pipedream-2bw@2+sync1e2"])
def test_a_malformed_sync_start_mode_is_refused(tmp_path, mode):
    with pytest.raises(StudyError, match=re.escape(f"mode '{mode}'")):
        _study(tmp_path, modes=["sync", mode])


# Error Feedback on some delayed modes only (ef_modes)

def test_ef_modes_runs_error_feedback_on_the_modes_it_names_and_ef_off_on_the_others(tmp_path):
    study = _study(tmp_path, modes=["sync", "pipedream-2bw", "pipedream@4", "pipedream-2bw+sync10"],
                   ef_modes=["pipedream-2bw@2"], depth=2)
    arms = study.arms(study.first_learning_rates())
    lambdas = {}
    for arm in arms:
        lambdas.setdefault(arm.mode, set()).add(arm.ef_lambda)
    assert lambdas == {"sync": {0.0}, "pipedream-2bw@2": {0.0, 1.0}, "pipedream@4": {0.0},
                       "pipedream-2bw@2+sync10": {0.0}}
    assert len(arms) == 2 * 2 * 1 * (1 + 2 + 1 + 1)  # optimizers × momentum × reported seeds × modes' EF values
    every = _study(tmp_path, modes=["sync", "pipedream-2bw", "pipedream@4"], depth=2)  # no ef_modes: all
    assert {a.ef_lambda for a in every.arms(every.first_learning_rates()) if a.mode == "pipedream@4"} == {0.0, 1.0}


@pytest.mark.parametrize("keys,message", [
    (dict(ef_modes=["pipedream@2"]), "ef_modes lists pipedream@2, not a delayed mode in 'modes'"),
    (dict(ef_modes=["sync"]), "ef_modes lists sync"),
    (dict(ef_modes=["pipedream-2bw@2"], ef=[1.0], modes=["sync", "pipedream-2bw", "pipedream"]),
     "'ef' must include 0"),
])
def test_ef_modes_naming_a_mode_the_grid_does_not_delay_or_leaving_one_without_arms_is_refused(tmp_path, keys,
                                                                                            message):
    with pytest.raises(StudyError, match=re.escape(message)):
        _study(tmp_path, **keys)


# The main delayed mode: what the headline, the optimizer and momentum claims and the momentum figure read

@pytest.mark.parametrize("modes,main", [
    (["sync", "pipedream-2bw@16", "pipedream-2bw@2+sync10", "pipedream-2bw@4", "pipedream@2"], "pipedream-2bw@4"),
    (["sync", "pipedream@2", "pipedream-2bw"], "pipedream-2bw@2"),  # written without @: the study's depth
    (["sync", "pipedream@2", "wpipe@4"], None),  # the reference's claims are about 2BW
])
def test_the_main_delayed_mode_is_2bw_at_its_smallest_depth_without_a_sync_start(tmp_path, modes, main):
    from hf_asyncpp.study.claims import Grid

    study = _study(tmp_path, modes=modes, depth=2)
    found = study.main_delayed_mode()
    assert (mode_name(*found) if found else None) == main
    assert Grid(study, {}).main == main


def test_without_ef_on_the_claims_mode_the_ef_claims_are_not_in_the_grid(tmp_path):
    from hf_asyncpp.study.claims_report import claims_markdown, headline_markdown
    from tests.study.test_results import _table

    study = _study(tmp_path, modes=["sync", "pipedream-2bw@2", "pipedream-2bw@4"], ef_modes=["pipedream-2bw@4"])
    verdicts = {row[0]: row[-1] for row in _table(claims_markdown(study, {}), "| claim |")[1:]}
    assert verdicts["with Error Feedback the delayed run matches the synchronous one"] == "not in this grid"
    assert verdicts["Error Feedback removes at least half of the gap"] == "not in this grid"
    sync = _record_row("adamw", "sync", 0.0)
    delayed = _record_row("adamw", "pipedream-2bw@2", 0.0, gap=0.5)
    row = _table(headline_markdown(study, [sync, delayed]), "| optimizer |")[1]
    assert row[2] == "3.000, +0.500 (1 seed)"  # sync and the gap; no EF value to show


def _record_row(optimizer, mode, ef, gap=0.0):
    return dict(optimizer=optimizer, mode=mode, ef_lambda=ef, momentum=0.9, seeds=1, val_loss=3.0 + gap,
                val_loss_std=0.0, gap=gap, gap_std=0.0)


def test_a_mode_listed_twice_is_refused(tmp_path):
    with pytest.raises(StudyError, match="twice"):
        _study(tmp_path, modes=["sync", "pipedream-2bw", "pipedream-2bw@2"], depth=2)


def test_a_sync_start_arm_is_its_own_mode_and_sets_sync_steps(tmp_path):
    study = _study(tmp_path, modes=["sync", "pipedream-2bw@2", "pipedream-2bw@2+sync100"])
    arms = study.arms(study.first_learning_rates())
    start = [a for a in arms if a.sync_steps]
    assert len(start) == 2 * 2 * 1 * 2  # optimizers × momentum × reported seeds (seed 0 tunes) × EF off/on
    arm = next(a for a in start if a.optimizer == "adamw" and a.ef_lambda == 1.0 and a.momentum == 0.9 and a.seed == 1)
    assert arm.mode == "pipedream-2bw@2+sync100"
    assert arm.name == "adamw-pipedream-2bw-p2-sync100-ef1-m0.9-lr0.001-s1"
    keys = arm.overrides("emulator")
    assert (keys["sync_steps"], keys["schedule"], keys["emulate_pp_size"], keys["ef"]) == (100, "pipedream-2bw", 2, True)
    assert arm.overrides("pipeline")["sync_steps"] == 100
    assert len({a.name for a in arms}) == len(arms)


def test_arms_without_sync_start_keep_the_names_and_overrides_they_had_before_it(tmp_path):
    # A rerun finds finished arms by name, so these must not change.
    assert Arm("adamw", "pipedream-2bw", 2, 1.0, 0.9, 3.0e-3, 1).name == "adamw-pipedream-2bw-p2-ef1-m0.9-lr0.003-s1"
    assert Arm("muon", "sync", 1, 0.0, 0.95, 2.0e-2, 0).name == "muon-sync-m0.95-lr0.02-s0"
    assert "sync_steps" not in Arm("adamw", "pipedream", 4, 0.0, 0.9, 1.0e-3, 0).overrides("emulator")
    # and an arm.json written before sync start existed still reads
    old = {"arm": dict(optimizer="adamw", schedule="pipedream", depth=4, ef_lambda=0.0, momentum=0.9,
                       learning_rate=1.0e-3, seed=0)}
    assert Arm.from_record(old) == Arm("adamw", "pipedream", 4, 0.0, 0.9, 1.0e-3, 0, 0)


def test_a_sync_start_arm_validates_as_the_runner_runs_it(tmp_path):
    from hf_asyncpp.study.runner import check_arms

    study = _study(tmp_path, modes=["sync", "pipedream-2bw@2+sync100"], optimizers={"adamw": [1.0e-3]},
                   momentum=[0.9], seeds=[0])
    check_arms(study, study.arms(study.first_learning_rates()))
    late = _study(tmp_path, modes=["sync", "pipedream-2bw@2+sync300"], optimizers={"adamw": [1.0e-3]},
                  momentum=[0.9], seeds=[0])
    with pytest.raises(StudyError, match="sync_steps"):  # not below max_steps 300
        check_arms(late, late.arms(late.first_learning_rates()))


def test_on_a_gpu_an_emulated_study_runs_every_arm_in_fp32(tmp_path, monkeypatch):
    """Emulated arms compute in fp32; a synchronous arm on a GPU would compute in bf16 (auto), so the
    gaps would hold precision as well as delay: such a study is refused until it asks for fp32."""
    import torch

    from hf_asyncpp.study.runner import check_arms

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    study = _study(tmp_path, optimizers={"adamw": [1.0e-3]}, momentum=[0.9], seeds=[0])
    with pytest.raises(StudyError, match="set mixed_precision: \"no\" in base"):
        check_arms(study, study.arms(study.first_learning_rates()))
    fp32 = _study(tmp_path, optimizers={"adamw": [1.0e-3]}, momentum=[0.9], seeds=[0],
                  base={"max_steps": 300, "eval_fraction": 0.05, "mixed_precision": "no"})
    check_arms(fp32, fp32.arms(fp32.first_learning_rates()))


def _record(arm: Arm, loss: float) -> dict:
    return {"arm": arm.__dict__, "mode": arm.mode, "final_eval": {"eval_loss": loss}}


def test_a_sync_start_rows_gap_is_to_the_sync_arm_of_its_optimizer_momentum_and_seed():
    def arm(mode_schedule, depth, ef, seed, sync_steps=0, momentum=0.9, optimizer="adamw"):
        return Arm(optimizer, mode_schedule, depth, ef, momentum, 1.0e-3, seed, sync_steps)

    records = [_record(arm("sync", 1, 0.0, 0), 3.0), _record(arm("sync", 1, 0.0, 1), 3.2),
               _record(arm("sync", 1, 0.0, 0, momentum=0.95), 9.0),  # another momentum: not the reference
               _record(arm("pipedream-2bw", 2, 0.0, 0), 3.5), _record(arm("pipedream-2bw", 2, 0.0, 1), 3.7),
               _record(arm("pipedream-2bw", 2, 0.0, 0, 100), 3.2), _record(arm("pipedream-2bw", 2, 0.0, 1, 100), 3.4),
               _record(arm("pipedream-2bw", 2, 1.0, 0, 100), 3.05), _record(arm("pipedream-2bw", 2, 1.0, 1, 100), 3.25)]
    rows = {(r["mode"], r["ef_lambda"], r["momentum"]): r for r in results_rows(records)}
    assert rows[("pipedream-2bw@2", 0.0, 0.9)]["gap"] == pytest.approx(0.5)
    start = rows[("pipedream-2bw@2+sync100", 0.0, 0.9)]
    assert start["gap"] == pytest.approx(0.2) and start["gap_std"] == pytest.approx(0.0, abs=1e-9)
    start_ef = rows[("pipedream-2bw@2+sync100", 1.0, 0.9)]
    assert start_ef["gap"] == pytest.approx(0.05)
    assert start_ef["ef_recovered"] == pytest.approx(0.75)  # against its own EF-off twin (0.2), not 2BW's (0.5)


