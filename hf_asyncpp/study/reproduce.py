"""Rerunning a study's finished arms at this code and holding them to their records
(`hf-asyncpp study STUDY.yaml --reproduce [ARM ...] [--steps N]`).

A finished arm counts only if it ran with the settings it would run with now and under this code's
numerics (runner.py), so its rerun is its recorded settings, launched the way the study launches it, into
`<output_dir>/reproductions/arms/<arm>` (a log, not a result: git ignores it). Every value its
`metrics.jsonl` logged — training loss, aux loss, learning rate, gradient norm, tokens, weight-version
ages, evaluations — is compared with the committed record of the same step; the timings are not.

A whole rerun is held to its final validation loss: within `tolerance` (0.01 by default, a tenth of the
smallest gap the study reports as a finding and a third of the reference's +0.028) of the recorded one.
With `steps`, the rerun is stopped (SIGTERM: it saves a checkpoint and exits) once it has logged step
`steps`, and held to the records up to there: the same code on the same kind of machine reproduces them
bit for bit, and a step whose value moved is the first sign of a numerics change; it costs steps/max_steps
of a whole rerun. Either way `reproductions.json` in the study's output_dir keeps each arm's latest
comparison (which commit reran it, how many records, the largest difference, the final losses) and
`reproductions.md` the table of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..log import get_logger
from ..provenance import NUMERICS, source_commit
from .grid import Arm, Study, StudyError
from .processes import ArmProcesses
from .runner import arm_command, arm_dir, finished_record

__all__ = ["TOLERANCE", "compare_records", "reproduce_arms"]

logger = get_logger(__name__)

TOLERANCE = 0.01
# What a record says about how fast the machine ran, not what the run computed.
_TIMING_KEYS = ("train_tokens_per_second", "step_time_s", "idle_fraction_per_rank")


def _records(directory: Path) -> dict[tuple[int, bool], dict]:
    """A run's logged records by (step, is an evaluation)."""
    path = directory / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {(r["step"], "eval_loss" in r): r for r in map(json.loads, lines)}


def _difference(recorded, rerun) -> float:
    """The largest absolute difference between two logged values (numbers, or lists of them); inf where
    they differ otherwise (a missing key, another schedule name, NaN against a number)."""
    if isinstance(recorded, list) and isinstance(rerun, list) and len(recorded) == len(rerun):
        return max((_difference(a, b) for a, b in zip(recorded, rerun)), default=0.0)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (recorded, rerun)):
        if math.isnan(recorded) or math.isnan(rerun):
            return 0.0 if math.isnan(recorded) and math.isnan(rerun) else math.inf
        return abs(float(recorded) - float(rerun))
    return 0.0 if recorded == rerun else math.inf


def compare_records(recorded_dir: Path, rerun_dir: Path, max_steps: int, until: int | None = None,
                    tolerance: float = TOLERANCE) -> dict:
    """The rerun in `rerun_dir` held to the record in `recorded_dir`: every record the rerun logged, up to
    its last step, against the recorded one of the same step. A whole rerun (`until` None) agrees when it
    reached `max_steps` and its final validation loss is within `tolerance` of the recorded one; a rerun
    until step `until` agrees when it got there and every compared value is within `tolerance`. Either
    way a recorded step missing from the rerun disagrees."""
    recorded, rerun = _records(recorded_dir), _records(rerun_dir)
    last = max((step for step, _ in rerun), default=0)
    compared = sorted(key for key in recorded if key[0] <= last)
    worst, worst_at = 0.0, None
    for key in compared:
        theirs = rerun.get(key, {})
        for name, value in recorded[key].items():
            difference = 0.0 if name in _TIMING_KEYS else _difference(value, theirs.get(name))
            if difference > worst:
                worst, worst_at = difference, f"{name} at step {key[0]}"
    final = None
    if (max_steps, True) in rerun and (max_steps, True) in recorded:
        final = {"recorded": recorded[max_steps, True]["eval_loss"], "rerun": rerun[max_steps, True]["eval_loss"]}
        final["difference"] = final["rerun"] - final["recorded"]
    missing = sum(key not in rerun for key in compared)
    if until is None:
        agrees = final is not None and abs(final["difference"]) <= tolerance
    else:
        agrees = last >= min(until, max_steps) and worst <= tolerance
    return {"steps": last, "records": len(compared), "missing": missing, "bitwise": worst == 0.0 and not missing,
            "max_difference": worst, "max_difference_at": worst_at, "final_eval_loss": final,
            "agrees": agrees and not missing and bool(compared)}


def _chosen_arms(study: Study, names: list[str] | None) -> list[Arm]:
    from . import known_arms

    finished = {arm.name: arm for arm in known_arms(study) if finished_record(study, arm) is not None}
    if not names:
        if not finished:
            raise StudyError(f"{study.output_dir} holds no arm finished under these settings and numerics "
                             f"({NUMERICS}) to reproduce")
        return list(finished.values())
    unknown = [name for name in names if name not in finished]
    if unknown:
        raise StudyError(f"not a finished arm of {study.name} under these settings and numerics ({NUMERICS}): "
                         f"{', '.join(unknown)}")
    return [finished[name] for name in names]


def _last_logged_step(directory: Path) -> int:
    path = directory / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):  # a line being written
        return 0


def _rerun(study: Study, rerun_study: Study, arm: Arm, steps: int | None, processes: ArmProcesses,
           tolerance: float) -> dict | None:
    directory = arm_dir(rerun_study, arm)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    stop_at = (lambda: _last_logged_step(directory) >= steps) if steps else None
    start = time.time()
    with open(directory / "stdout.txt", "w") as out, open(directory / "stderr.txt", "w") as err:
        status = processes.run(arm_command(rerun_study, arm), out, err, lambda pid: None, stop_at)
    for checkpoint in directory.glob("checkpoint-*"):  # a stopped rerun's: nothing resumes it
        shutil.rmtree(checkpoint, ignore_errors=True)
    if status is None or processes.stop_signal is not None:
        return None
    max_steps = finished_record(study, arm)["settings"]["config"]["max_steps"]
    comparison = compare_records(arm_dir(study, arm), directory, max_steps, steps, tolerance)
    return {"arm": arm.name, **comparison, "exit_status": status, "tolerance": tolerance,
            "seconds": round(time.time() - start, 1), "commit": source_commit(), "numerics": NUMERICS}


def _summary(entries: dict[str, dict]) -> str:
    whole = [e for e in entries.values() if e["final_eval_loss"]]
    line = (f"{len(entries)} finished arm{'s' * (len(entries) != 1)} rerun from their recorded settings: {sum(e['agrees'] for e in entries.values())} "
            f"agree, {sum(e['bitwise'] for e in entries.values())} bit for bit; {len(whole)} whole")
    if whole:
        line += f" (final validation loss at most {max(abs(e['final_eval_loss']['difference']) for e in whole):.1e} apart)"
    partial = sorted({e["steps"] for e in entries.values() if not e["final_eval_loss"]})
    return line + (f", {len(entries) - len(whole)} to step {'/'.join(map(str, partial))}" if partial else "") + "."


def _markdown(entries: dict[str, dict]) -> str:
    lines = [_summary(entries), "", "| arm | rerun at | steps compared | records | bitwise | largest difference | final validation loss, "
             "recorded → rerun | agrees |", "|---|---|---:|---:|---|---:|---|---|"]
    for name, e in sorted(entries.items()):
        final = e["final_eval_loss"]
        final_text = f"{final['recorded']:.4f} → {final['rerun']:.4f} ({final['difference']:+.1e})" if final else "—"
        commit = (e["commit"] or "no checkout")[:12]
        lines.append(f"| {name} | {commit} | {e['steps']} | {e['records']} | {'yes' if e['bitwise'] else 'no'} | "
                     f"{e['max_difference']:.1e} | {final_text} | {'yes' if e['agrees'] else '**no**'} "
                     f"(± {e['tolerance']:g}) |")
    return "\n".join(lines) + "\n"


def reproduce_arms(study: Study, names: list[str] | None = None, steps: int | None = None,
                   tolerance: float = TOLERANCE, log=logger.info) -> list[dict]:
    """Rerun the named finished arms (all of them without names) `study.parallel` at a time, each whole or
    its first `steps` steps, and record how each compares; returns this run's comparisons (none for an arm
    a signal stopped). `reproductions.json` / `.md` keep every arm's latest."""
    if steps is not None and steps < 1:
        raise StudyError("--steps must be at least 1")
    arms = _chosen_arms(study, names)
    rerun_study = dataclasses.replace(study, output_dir=study.output_dir / "reproductions", checkpoint_steps=0)
    processes = ArmProcesses(log)
    with processes.stopping_on_signals(), ThreadPoolExecutor(max_workers=study.parallel) as pool:
        results = list(pool.map(lambda arm: _rerun(study, rerun_study, arm, steps, processes, tolerance), arms))
    done = [r for r in results if r is not None]
    for r in done:
        final = r["final_eval_loss"]
        log(f"study: {r['arm']}: {r['records']} records to step {r['steps']}, largest difference "
            f"{r['max_difference']:.1e}" + (f", final validation loss {final['difference']:+.1e}" if final else "")
            + ("" if r["agrees"] else f": DOES NOT AGREE within {tolerance:g}"))
    path = study.output_dir / "reproductions.json"
    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries.update({r["arm"]: r for r in done})
    path.write_text(json.dumps(entries, indent=1, sort_keys=True))
    (study.output_dir / "reproductions.md").write_text(_markdown(entries))
    return done
