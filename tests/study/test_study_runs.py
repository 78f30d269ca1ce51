"""Studies: a small grid runs end to end, and its table's arithmetic follows the arms' own metrics.

Three arms (AdamW sync, PipeDream-2BW, PipeDream-2BW + EF), two seeds, a few steps of a tiny model:
the table's validation loss is each arm's last eval_loss in its metrics.jsonl, averaged over seeds;
the gap is the seed-paired difference to sync; EF's share recovered is (gap_off − gap_ef) / gap_off.
A rerun skips finished arms (and reruns them once their settings change); a crashed arm is reported
and the others finish.
"""

from __future__ import annotations

import json
import statistics
import sys

import pytest
import torch
import yaml

from tests.test_engine import save_model_dir, small_model_config

SEQ = 16


@pytest.fixture
def study_file(tmp_path, monkeypatch):
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192
    save_model_dir(config, tmp_path / "model")
    rows = torch.randint(0, 8192, (64, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    base = dict(model_config=str(tmp_path / "model"), dataset=str(tmp_path / "data.jsonl"), seq_len=SEQ,
                micro_batch_size=2, n_microbatches=2, max_steps=4, logging_steps=1, eval_fraction=0.25,
                lr_scheduler_type="constant", optimizer="adamw")
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = dict(name="tiny", base_config="base.yaml", optimizers={"adamw": [3.0e-3]},
                 modes=["sync", "pipedream-2bw"], ef=[0, 1.0], momentum=[0.9], seeds=[0, 1], parallel=2,
                 output_dir=str(tmp_path / "study"))
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "study.yaml"


def _final_eval_loss(arm_directory):
    records = [json.loads(line) for line in (arm_directory / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval_loss" in r][-1]["eval_loss"]


@pytest.mark.multirank
def test_a_small_study_runs_its_table_follows_the_arms_metrics_and_a_crashed_arm_is_reported(study_file, tmp_path,
                                                                                             monkeypatch):
    from hf_asyncpp.study import run_study

    paths = run_study(study_file, log=lambda *_: None)
    out = tmp_path / "study"
    assert {p.name for p in paths} >= {"results.json", "results.csv", "results.md", "claims.md", "headline.md",
                                       "verdicts.md", "loss_curves.png", "gap_bars.png"}
    arms = out / "arms"
    loss = {(mode, seed): _final_eval_loss(arms / f"adamw-{mode}-m0.9-lr0.003-s{seed}")
            for mode in ("sync", "pipedream-2bw-p2", "pipedream-2bw-p2-ef1") for seed in (0, 1)}
    rows = {(r["mode"], r["ef_lambda"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {("sync", 0.0), ("pipedream-2bw@2", 0.0), ("pipedream-2bw@2", 1.0)}

    sync, off, on = rows["sync", 0.0], rows["pipedream-2bw@2", 0.0], rows["pipedream-2bw@2", 1.0]
    assert sync["val_loss"] == pytest.approx((loss["sync", 0] + loss["sync", 1]) / 2, abs=1e-12)
    assert sync["val_loss_std"] == pytest.approx(statistics.stdev([loss["sync", 0], loss["sync", 1]]), abs=1e-12)
    gaps_off = [loss["pipedream-2bw-p2", s] - loss["sync", s] for s in (0, 1)]
    gaps_on = [loss["pipedream-2bw-p2-ef1", s] - loss["sync", s] for s in (0, 1)]
    assert off["gap"] == pytest.approx(statistics.fmean(gaps_off), abs=1e-12)
    assert off["gap_std"] == pytest.approx(statistics.stdev(gaps_off), abs=1e-12)
    assert on["gap"] == pytest.approx(statistics.fmean(gaps_on), abs=1e-12)
    if off["gap"] > 0:
        assert on["ef_recovered"] == pytest.approx((off["gap"] - on["gap"]) / off["gap"], abs=1e-12)
    else:
        assert on["ef_recovered"] is None  # nothing to recover
    assert sync["gap"] == 0.0 and off["seeds"] == 2
    # Each record says what produced it.
    provenance = json.loads((arms / "adamw-sync-m0.9-lr0.003-s0" / "arm.json").read_text())["provenance"]
    assert provenance["versions"]["torch"] == torch.__version__ and provenance["machine"]["cores"] >= 1
    # claims.md reads the same per-seed gaps.
    assert f"| adamw, momentum 0.9 | gap with EF {statistics.fmean(gaps_on):+.3f} |" in (out / "claims.md").read_text()
    # and the README's headline table gives sync, gap and gap with EF, each a mean ± its seed spread.
    cell = (f"{sync['val_loss']:.3f} ± {sync['val_loss_std']:.3f}, {off['gap']:+.3f} ± {off['gap_std']:.3f}, "
            f"{on['gap']:+.3f} ± {on['gap_std']:.3f} (2 seeds)")
    assert f"| AdamW | 2.612 [S1], +0.278 [S1], +0.028 [S1] | {cell} |" in (out / "headline.md").read_text()
    # The delayed arms really ran delayed: weight-version age 1 after the first step.
    metrics = [json.loads(line) for line in (arms / "adamw-pipedream-2bw-p2-m0.9-lr0.003-s0" / "metrics.jsonl")
               .read_text().splitlines() if '"loss"' in line]
    assert metrics[-1]["weight_version_age_per_stage"] == [1, 1]

    # A rerun skips every finished arm and writes the same table.
    before = {p: p.stat().st_mtime_ns for p in arms.glob("*/arm.json")}
    table = (out / "results.md").read_text()
    messages = []
    run_study(study_file, log=messages.append)
    assert {p: p.stat().st_mtime_ns for p in arms.glob("*/arm.json")} == before
    assert "0 ran, 6 already finished, 0 failed" in messages[-1]
    assert (out / "results.md").read_text() == table

    # Editing the base config makes every arm stale: a rerun runs them again. In that rerun one arm
    # crashes: it is reported (failed.txt, no arm.json, failed_arms) and the others finish.
    from hf_asyncpp.study import runner

    real_command = runner.arm_command

    def crash_one(study, arm):
        if arm.ef_lambda and arm.seed == 1:
            return [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]
        return real_command(study, arm)

    monkeypatch.setattr(runner, "arm_command", crash_one)
    base = study_file.parent / "base.yaml"
    base.write_text(base.read_text().replace("logging_steps: 1", "logging_steps: 2"))
    messages.clear()
    run_study(study_file, log=messages.append)
    assert sum("its settings or numerics changed since it ran; running it again" in m for m in messages) == 6
    assert "5 ran, 0 already finished, 1 failed" in messages[-1]
    crashed = arms / "adamw-pipedream-2bw-p2-ef1-m0.9-lr0.003-s1"
    assert (crashed / "failed.txt").read_text().startswith("exit status 3") and not (crashed / "arm.json").exists()
    assert len(list(arms.glob("*/arm.json"))) == 5
    results = json.loads((out / "results.json").read_text())
    assert results["failed_arms"] == [crashed.name]
    ef_row = next(r for r in results["rows"] if r["ef_lambda"] == 1.0)
    assert ef_row["seeds"] == 1  # the surviving seed only


def test_a_bad_study_file_fails_before_any_arm_runs(study_file, tmp_path):
    from hf_asyncpp.study import StudyError, run_study

    study = yaml.safe_load(study_file.read_text())
    for change, message in [({"modes": ["sync", "pipedream-3bw"]}, "unknown mode 'pipedream-3bw'"),
                            ({"optimizers": {"adamw": [-1.0]}}, "all positive"),
                            ({"modes": ["pipedream-2bw"]}, "must include sync"),
                            ({"seed": [0]}, "unknown study key"),
                            ({"base_config": "missing.yaml"}, "does not exist"),
                            ({"modes": ["sync", "pipedream@16"]}, "arm adamw-pipedream-p16-m0.9-lr0.003-s0: .*16 stages")]:
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**study, **change}))
        with pytest.raises(StudyError, match=message):
            run_study(tmp_path / "bad.yaml", log=lambda *_: None)
    assert not (tmp_path / "study").exists()


@pytest.mark.multirank
def test_a_study_stopped_by_a_signal_stops_its_arm_at_a_checkpoint_that_the_rerun_resumes_bitwise(
        study_file, tmp_path, monkeypatch):
    """With checkpoint_steps, SIGTERM to the study stops its running arm (the arm saves a checkpoint at its
    next step boundary and exits cleanly) and starts no further arm; the arm counts as stopped, neither
    failed nor finished (its mid-run evaluation is not a final one). The
    rerun resumes it from that checkpoint: per-step losses and the final validation loss equal those of
    the same arm run straight through, and its checkpoints are gone once it finished."""
    import os
    import signal
    import threading

    from hf_asyncpp.study import StudyStopped, load_study, runner
    from hf_asyncpp.study.grid import Arm

    base = yaml.safe_load((tmp_path / "base.yaml").read_text())
    # An evaluation every 7 steps: the stopped arm has evaluated mid-run, which is not its result.
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**base, "max_steps": 60, "eval_steps": 7}))
    raw = {**yaml.safe_load(study_file.read_text()), "ef": [0], "seeds": [0], "parallel": 1}
    (tmp_path / "straight.yaml").write_text(yaml.safe_dump({**raw, "output_dir": str(tmp_path / "straight")}))
    (tmp_path / "resumed.yaml").write_text(yaml.safe_dump({**raw, "checkpoint_steps": 5,
                                                          "output_dir": str(tmp_path / "resumed")}))
    straight, resumed = load_study(tmp_path / "straight.yaml"), load_study(tmp_path / "resumed.yaml")
    arm, queued = Arm("adamw", "pipedream-2bw", 2, 0.0, 0.9, 3.0e-3, 0), Arm("adamw", "sync", 1, 0.0, 0.9, 3.0e-3, 0)
    assert runner._settings(straight, arm) == runner._settings(resumed, arm)  # checkpoints change no result
    assert runner.run_arms(straight, [arm], lambda *_: None) == {arm.name: "done"}

    directory = runner.arm_dir(resumed, arm)

    returned = threading.Event()

    def stop_the_study_mid_arm():
        metrics = directory / "metrics.jsonl"
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < 8:
            if returned.wait(0.01):
                return  # the arm ended before its 8th line: the assertions below say so, no signal
        os.kill(os.getpid(), signal.SIGTERM)  # from a worker thread, as the OS may deliver it

    handler = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_the_study_mid_arm, daemon=True).start()
    messages = []
    try:
        with pytest.raises(StudyStopped, match="arms stopped at a checkpoint: 1, not started: 1"):
            runner.run_arms(resumed, [arm, queued], messages.append)
    finally:
        returned.set()  # the watcher must not signal the rerun below
    assert signal.getsignal(signal.SIGTERM) == handler  # the study's handler is gone with it
    assert f"study: {arm.name}: stopped; a rerun resumes it from its checkpoint" in messages
    assert not (directory / "failed.txt").exists() and not runner.arm_dir(resumed, queued).exists()
    saved = sorted(directory.glob("checkpoint-*"))
    assert len(saved) == 1 and (directory / "running.json").is_file()
    stopped = int(saved[0].name.split("-")[1])
    assert 8 <= stopped < 60
    assert runner._alive_process(directory) is None  # the arm's process has ended

    messages = []
    assert runner.run_arms(resumed, [arm], messages.append) == {arm.name: "done"}
    assert f"study: {arm.name}: resuming after step {stopped}" in messages
    losses = {d: [(r["step"], r.get("loss"), r.get("eval_loss")) for r in map(json.loads, (
        runner.arm_dir(s, arm) / "metrics.jsonl").read_text().splitlines()) if "loss" in r or "eval_loss" in r]
        for d, s in (("straight", straight), ("resumed", resumed))}
    assert losses["resumed"] == losses["straight"] and len(losses["straight"]) == 60 + 9  # 60 steps, 9 evaluations
    record = json.loads((directory / "arm.json").read_text())
    assert record["resumed_after_step"] == stopped
    assert not list(directory.glob("checkpoint-*")) and not (directory / "running.json").exists()


def test_a_stopped_study_exits_0_and_says_how_to_continue(monkeypatch, capsys):
    """As a run stopped by SIGTERM after its checkpoint: the study command ends cleanly, with one line."""
    import hf_asyncpp.study as study
    from hf_asyncpp.cli import main

    def stopped(path):
        raise study.StudyStopped("arms stopped at a checkpoint: 2, not started: 40")

    monkeypatch.setattr(study, "run_study", stopped)
    assert main(["study", "any.yaml"]) == 0
    err = capsys.readouterr().err
    assert "study stopped (arms stopped at a checkpoint: 2, not started: 40): run the same command" in err


def test_a_report_of_a_study_never_run_is_one_error_and_writes_nothing(study_file, tmp_path, capsys):
    from hf_asyncpp.cli import main

    assert main(["study", str(study_file), "--report-only"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'study'} holds no arms, so there is nothing to report: run the study first"]
    assert not (tmp_path / "study").exists()
