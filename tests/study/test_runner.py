"""When a study's runner counts an arm as finished: its record's settings are the arm's resolved config,
so a study survives being moved, copied to another machine or having its files' comments edited, and
reruns an arm only when a value it ran with changed. Single-process, nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_asyncpp.provenance import NUMERICS
from hf_asyncpp.study import load_study
from hf_asyncpp.study.grid import Arm
from hf_asyncpp.study.runner import _finished, _settings, arm_dir, progress

REPO = Path(__file__).resolve().parents[2]
BASE_TEXT = (REPO / "training_scripts" / "configs" / "tiny_moe.yaml").read_text()


def _study(directory: Path, base_text: str = BASE_TEXT, output_dir: str = "out"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "base.yaml").write_text(base_text)
    raw = dict(name="t", base_config="base.yaml", base={"max_steps": 300, "eval_fraction": 0.05},
               optimizers={"adamw": [1.0e-3]}, modes=["sync", "pipedream-2bw"], ef=[0], momentum=[0.9],
               seeds=[0], output_dir=str(directory / output_dir))
    (directory / "study.yaml").write_text(json.dumps(raw))  # JSON is YAML
    return load_study(directory / "study.yaml")


ARM = Arm("adamw", "pipedream-2bw", 2, 0.0, 0.9, 1.0e-3, 0, 0)


def _record(study, arm: Arm, settings: dict | None = None, seconds: float | None = None) -> Path:
    directory = arm_dir(study, arm)
    directory.mkdir(parents=True)
    (directory / "arm.json").write_text(json.dumps(
        {"arm": arm.__dict__, "mode": arm.mode, "settings": settings or _settings(study, arm),
         "final_eval": {"eval_loss": 4.0}, "provenance": {"numerics": NUMERICS},
         **({} if seconds is None else {"seconds": seconds})}))
    return directory


def test_a_finished_arm_stays_finished_when_the_study_moves_or_its_files_comments_change(tmp_path):
    ran = _study(tmp_path / "first machine")
    directory = _record(ran, ARM)
    assert _finished(directory, _settings(ran, ARM))
    moved = _study(tmp_path / "second machine", "# a comment added later\n" + BASE_TEXT, output_dir="elsewhere")
    assert _finished(directory, _settings(moved, ARM))


def test_an_edited_value_in_the_base_config_or_the_arm_makes_the_arm_stale(tmp_path):
    study = _study(tmp_path / "a")
    directory = _record(study, ARM)
    edited = _study(tmp_path / "b", BASE_TEXT.replace("weight_decay: 0.1", "weight_decay: 0.2"))
    assert not _finished(directory, _settings(edited, ARM))
    other_seed = Arm(**{**ARM.__dict__, "seed": 1})
    assert not _finished(directory, _settings(study, other_seed))


def test_a_key_added_after_an_arm_ran_counts_as_its_default(tmp_path):
    """A record written before `shuffle_window` existed ran with the behaviour the key's default (10000)
    keeps; an arm that sets the key to another value is a different arm."""
    study = _study(tmp_path / "a")
    settings = _settings(study, ARM)
    old = {**settings, "config": {k: v for k, v in settings["config"].items() if k != "shuffle_window"}}
    directory = _record(study, ARM, old)
    assert settings["config"]["shuffle_window"] == 10_000  # the default, not None: the record must be filled in
    assert _finished(directory, settings)
    other = _study(tmp_path / "b", BASE_TEXT + "\nshuffle_window: 500\n")
    assert not _finished(directory, _settings(other, ARM))


def test_a_record_of_the_earlier_format_or_a_broken_one_is_not_finished(tmp_path):
    study = _study(tmp_path)
    earlier = _record(study, ARM, {"base_config": BASE_TEXT, "overrides": {}, "launch": "emulator"})
    assert not _finished(earlier, _settings(study, ARM))
    (earlier / "arm.json").write_text("{not json")
    assert not _finished(earlier, _settings(study, ARM))


def test_a_setting_of_another_optimizer_reruns_only_that_optimizers_arms(tmp_path):
    """soap_max_precond_dim added to a study's base: its SOAP arms run again, while an AdamW arm whose
    record holds the previous value (records once held every key) stays finished; new records leave out
    the keys only other optimizers read."""
    from hf_asyncpp.study.runner import _config_values, arm_config

    study = _study(tmp_path / "a")
    soap = Arm(**{**ARM.__dict__, "optimizer": "soap"})
    every_key = {"config": _config_values(arm_config(study, ARM)), "launch": study.launch}
    assert every_key["config"]["soap_max_precond_dim"] == 4096
    adamw_dir, soap_dir = _record(study, ARM, every_key), _record(study, soap)
    edited = _study(tmp_path / "b", BASE_TEXT + "\nsoap_max_precond_dim: 1024\n")
    assert _finished(adamw_dir, _settings(edited, ARM))
    assert not _finished(soap_dir, _settings(edited, soap))
    assert _finished(soap_dir, _settings(study, soap))
    new_record = _settings(edited, ARM)["config"]
    assert "adam_epsilon" in new_record and not any(k.startswith(("soap_", "muon_")) for k in new_record)


def test_progress_counts_the_finished_arms_and_times_the_rest_at_the_pace_of_their_kind(tmp_path):
    """The pace of a left arm: the median seconds of finished arms of its optimizer and schedule, else of
    its optimizer, else of any; `parallel` (1 by default) run at a time."""
    study = _study(tmp_path)
    sync, delayed = (Arm(**{**ARM.__dict__, "schedule": "sync", "depth": 1}), ARM)
    arms = [Arm(**{**arm.__dict__, "seed": seed}) for arm in (sync, delayed) for seed in (0, 1, 2)]
    muon = Arm(**{**ARM.__dict__, "optimizer": "muon"})
    assert progress(study, arms) == "0 of 6 arms finished; 6 to run"

    for arm, seconds in zip(arms[:2], (1000.0, 2000.0)):  # sync arms of seeds 0 and 1: median 1500 s
        _record(study, arm, seconds=seconds)
    _record(study, arms[3], seconds=5400.0)  # the first delayed arm
    # left: one sync arm (1500 s) and two delayed arms (5400 s each)
    assert progress(study, arms) == ("3 of 6 arms finished; 3 to run, about 3.4 hours at the finished arms' pace, "
                                     "1 at a time")
    # an optimizer none of whose arms finished takes the pace of all (the median of 1000, 2000, 5400)
    assert progress(study, [muon]).endswith("about 0.6 hours at the finished arms' pace, 1 at a time")
    for arm in arms[2:]:
        if not arm_dir(study, arm).exists():
            _record(study, arm, seconds=1.0)
    assert progress(study, arms) == "6 of 6 arms finished"


def test_a_checkpoint_is_resumed_only_by_a_run_with_the_settings_and_numerics_that_wrote_it(tmp_path):
    from hf_asyncpp.study.runner import _resumable_step

    study = _study(tmp_path / "a")
    directory = arm_dir(study, ARM)
    (directory / "checkpoint-40").mkdir(parents=True)
    assert _resumable_step(directory, _settings(study, ARM)) == 0  # incomplete (no manifest), and no running.json
    for step in (20, 40):
        (directory / f"checkpoint-{step}").mkdir(exist_ok=True)
        (directory / f"checkpoint-{step}" / "manifest.json").write_text("{}")
    assert _resumable_step(directory, _settings(study, ARM)) == 0  # no running.json: whose it is is unknown
    (directory / "running.json").write_text(json.dumps({"settings": _settings(study, ARM), "numerics": NUMERICS}))
    assert _resumable_step(directory, _settings(study, ARM)) == 40
    (directory / "running.json").write_text(json.dumps({"settings": _settings(study, ARM), "numerics": "2026-01-01"}))
    assert _resumable_step(directory, _settings(study, ARM)) == 0  # written by code of other numerics
    (directory / "running.json").write_text(json.dumps({"settings": _settings(study, ARM), "numerics": NUMERICS}))
    edited = _study(tmp_path / "b", BASE_TEXT.replace("weight_decay: 0.1", "weight_decay: 0.2"))
    assert _resumable_step(directory, _settings(edited, ARM)) == 0


def test_checkpointing_the_arms_keeps_the_finished_ones_finished(tmp_path):
    """save_steps, save_total_limit and resume_from_checkpoint say when an arm writes, not what it
    computes: turning checkpoint_steps on does not rerun the grid."""
    plain = _study(tmp_path / "a")
    directory = _record(plain, ARM)
    raw = json.loads((tmp_path / "a" / "study.yaml").read_text())
    (tmp_path / "a" / "checkpointed.yaml").write_text(json.dumps({**raw, "checkpoint_steps": 50}))
    checkpointed = load_study(tmp_path / "a" / "checkpointed.yaml")
    from hf_asyncpp.study.runner import arm_config

    assert arm_config(checkpointed, ARM).save_steps == 50 and arm_config(checkpointed, ARM).resume_from_checkpoint == "latest"
    assert _finished(directory, _settings(checkpointed, ARM))


@pytest.mark.launch
def test_a_rerun_is_refused_while_an_arm_of_an_earlier_run_still_writes_its_directory(tmp_path):
    """A study killed outright (SIGKILL) leaves its arms running; a rerun would start a second process
    writing the same directory. The process running.json names counts only while its command line
    names the arm's directory (a reused process id does not)."""
    import subprocess
    import sys
    import time

    import pytest

    from hf_asyncpp.study import StudyError
    from hf_asyncpp.study.runner import _refuse_alive

    study = _study(tmp_path)
    directory = arm_dir(study, ARM)
    directory.mkdir(parents=True)
    sleep = "import time; time.sleep(60)"
    arm = subprocess.Popen([sys.executable, "-c", sleep, "--output_dir", str(directory)])
    other = subprocess.Popen([sys.executable, "-c", sleep])
    # A process just started may not have exec'd yet: its command line is still its parent's.
    deadline = time.monotonic() + 30
    while str(directory).encode() not in Path(f"/proc/{arm.pid}/cmdline").read_bytes().split(b"\0"):
        assert time.monotonic() < deadline, "the stand-in arm never started"
        time.sleep(0.05)
    try:
        (directory / "running.json").write_text(json.dumps({"settings": {}, "pid": other.pid}))
        _refuse_alive(study, [ARM])
        (directory / "running.json").write_text(json.dumps({"settings": {}, "pid": arm.pid}))
        with pytest.raises(StudyError, match=rf"arm {ARM.name} is running \(process {arm.pid}\), started by another run"):
            _refuse_alive(study, [ARM])
    finally:
        arm.kill(), other.kill()
        arm.wait(), other.wait()
    _refuse_alive(study, [ARM])  # its process has ended: the rerun resumes the arm
    (directory / "running.json").write_text(json.dumps({"settings": {}}))  # written before process ids were kept
    _refuse_alive(study, [ARM])


def test_ef_last_update_reruns_only_the_arms_with_error_feedback(tmp_path):
    """ef_last_update trajectory in a study's base changes the arms with Error Feedback alone (without it every
    update is already the optimizer's own): those run again, the others stay finished, records of EF arms
    written before the key count as its default (extrapolate)."""
    study = _study(tmp_path / "a")
    with_ef = Arm(**{**ARM.__dict__, "ef_lambda": 1.0})
    settings = _settings(study, with_ef)
    before_the_key = {**settings, "config": {k: v for k, v in settings["config"].items() if k != "ef_last_update"}}
    without_dir, with_dir = _record(study, ARM), _record(study, with_ef, before_the_key)
    assert _finished(with_dir, _settings(study, with_ef))
    edited = _study(tmp_path / "b", BASE_TEXT + "\nef_last_update: trajectory\n")
    assert _finished(without_dir, _settings(edited, ARM))
    assert not _finished(with_dir, _settings(edited, with_ef))
    assert "ef_last_update" not in _settings(edited, ARM)["config"]
