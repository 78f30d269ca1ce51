"""Rerunning a study's finished arms at this code and holding them to their records
(`hf-asyncpp study STUDY.yaml --reproduce [ARM ...] [--steps N]`).

A finished arm counts only if it ran with the settings it would run with now and under this code's
numerics (runner.py), so its rerun is its recorded settings, launched the way the study launches it, into
`<output_dir>/reproductions/arms/<arm>` (a log, not a result: git ignores it). Every value its
`metrics.jsonl` logged — training loss, aux loss, learning rate, gradient norm, tokens, weight-version
ages, evaluations — is compared with the committed record of the same step; the timings are not.

A whole rerun is held to its final validation loss: within `tolerance` (0.01 by default, what the study's
acceptance asks; under the ±0.016 a numerics change once moved a committed arm, and under the gaps the
study reads). With `steps`, the rerun is stopped (SIGTERM: it saves a checkpoint, which is deleted) once
it has logged step `steps`, and every value up to there is held to PREFIX_RTOL: a change of numerics
starts at rounding size (8e-6 at step 10 in the case above) and only grows later (+0.024 by step 100),
so a loose bound on the first steps would let it through. It costs steps/max_steps of a whole rerun.
Either way `reproductions.json` in the study's output_dir keeps each arm's latest comparison (which
commit reran it, how many records, the largest difference, the final losses), written as each rerun ends,
and `reproductions.md` the table of them. Named arms are always rerun; without names, only the finished
arms whose kept comparison does not already answer the request under these numerics, so a long sweep
stopped halfway continues with the same command.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..log import get_logger
from ..loop import MEASURED_KEYS
from ..provenance import NUMERICS, source_commit
from .grid import Arm, Study, StudyError
from .processes import ArmProcesses
from ..plots import read_metrics
from .runner import arm_command, arm_dir, drop_checkpoints, finished_record

__all__ = ["PREFIX_RTOL", "TOLERANCE", "compare_records", "reproduce_arms", "write_reproductions"]

logger = get_logger(__name__)

TOLERANCE = 0.01
# A partial rerun's bound on each value, relative: tests/test_numerics.py's for runs the same numerics
# compute in another floating-point order (another machine, library build).
PREFIX_RTOL = 1e-5


def _records(directory: Path) -> dict[tuple[int, bool], dict]:
    """A run's logged records by (step, is an evaluation); none before it logged any."""
    try:
        train, evaluations = read_metrics(directory)
    except (OSError, ValueError):  # no file yet, or a line being written
        return {}
    return {**{(r["step"], False): r for r in train}, **{(r["step"], True): r for r in evaluations}}


def _difference(recorded, rerun, relative: bool = False) -> float:
    """The largest absolute (or relative) difference between two logged values (numbers, or lists of
    them); inf where they differ otherwise (a missing key, another schedule name, NaN against a number)."""
    if isinstance(recorded, list) and isinstance(rerun, list) and len(recorded) == len(rerun):
        return max((_difference(a, b, relative) for a, b in zip(recorded, rerun)), default=0.0)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (recorded, rerun)):
        if math.isnan(recorded) or math.isnan(rerun):
            return 0.0 if math.isnan(recorded) and math.isnan(rerun) else math.inf
        difference = abs(float(recorded) - float(rerun))
        return difference / max(abs(recorded), abs(rerun)) if relative and difference else difference
    return 0.0 if recorded == rerun else math.inf


def compare_records(recorded_dir: Path, rerun_dir: Path, max_steps: int, until: int | None = None,
                    tolerance: float = TOLERANCE) -> dict:
    """The rerun in `rerun_dir` held to the record in `recorded_dir`: every record the rerun logged, up to
    its last step, against the recorded one of the same step. A whole rerun (`until` None) agrees when it
    reached `max_steps` and its final validation loss is within `tolerance` of the recorded one; a rerun
    until step `until` agrees when it got there and every compared value is within PREFIX_RTOL of the
    recorded one. Either way a recorded step missing from the rerun disagrees."""
    recorded, rerun = _records(recorded_dir), _records(rerun_dir)
    last = max((step for step, _ in rerun), default=0)
    compared = sorted(key for key in recorded if key[0] <= last)
    worst, worst_at, worst_relative = 0.0, None, 0.0
    for key in compared:
        theirs = rerun.get(key, {})
        for name, value in recorded[key].items():
            if name in MEASURED_KEYS:
                continue
            difference = _difference(value, theirs.get(name))
            worst_relative = max(worst_relative, _difference(value, theirs.get(name), relative=True))
            if difference > worst:
                worst, worst_at = difference, f"{name} at step {key[0]}"
    final = None
    if (max_steps, True) in rerun and (max_steps, True) in recorded:
        final = {"recorded": recorded[max_steps, True]["eval_loss"], "rerun": rerun[max_steps, True]["eval_loss"]}
        final["difference"] = final["rerun"] - final["recorded"]
    missing = sum(key not in rerun for key in compared)
    if until is None:
        agrees, held_to = final is not None and abs(final["difference"]) <= tolerance, f"final loss ± {tolerance:g}"
    else:
        agrees, held_to = last >= min(until, max_steps) and worst_relative <= PREFIX_RTOL, f"relative {PREFIX_RTOL:g}"
    return {"steps": last, "records": len(compared), "missing": missing, "bitwise": worst == 0.0 and not missing,
            "max_difference": worst, "max_difference_at": worst_at, "max_relative_difference": worst_relative,
            "final_eval_loss": final, "held_to": held_to, "agrees": agrees and not missing and bool(compared)}


def _finished(study: Study, arms: list[Arm]) -> dict[str, Arm]:
    return {arm.name: arm for arm in arms if finished_record(study, arm) is not None}


def _chosen_arms(study: Study, names: list[str] | None, tables_only: bool) -> list[Arm]:
    from . import known_arms, table_arms

    finished = _finished(study, table_arms(study) if tables_only and not names else known_arms(study))
    if not names:
        if not finished:
            raise StudyError(f"{study.output_dir} holds no arm{' the tables read' * tables_only} finished under "
                             f"these settings and numerics ({NUMERICS}) to reproduce")
        return list(finished.values())
    unknown = [name for name in names if name not in finished]
    if unknown:
        raise StudyError(f"not a finished arm of {study.name} under these settings and numerics ({NUMERICS}): "
                         f"{', '.join(unknown)}")
    return [finished[name] for name in names]


def _last_logged_step(directory: Path) -> int:
    return max((step for step, _ in _records(directory)), default=0)


def _rerun(study: Study, rerun_study: Study, arm: Arm, steps: int | None, processes: ArmProcesses,
           tolerance: float) -> dict | None:
    directory = arm_dir(rerun_study, arm)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    stop_at = (lambda: _last_logged_step(directory) >= steps) if steps else None
    start = time.time()
    with open(directory / "stdout.txt", "w") as out, open(directory / "stderr.txt", "w") as err:
        status = processes.run(arm_command(rerun_study, arm), out, err, lambda pid: None, stop_at)
    drop_checkpoints(directory)  # a stopped rerun's: nothing resumes it
    if status is None or processes.stop_signal is not None:
        return None
    max_steps = finished_record(study, arm)["settings"]["config"]["max_steps"]
    comparison = compare_records(arm_dir(study, arm), directory, max_steps, steps, tolerance)
    return {"arm": arm.name, **comparison, "exit_status": status, "seconds": round(time.time() - start, 1),
            "commit": source_commit(), "numerics": NUMERICS}


def _summary(entries: dict[str, dict]) -> str:
    whole = [e for e in entries.values() if e["final_eval_loss"]]
    partial = sorted({e["steps"] for e in entries.values() if not e["final_eval_loss"]})
    line = (f"{len(entries)} finished arm{'s' * (len(entries) != 1)} rerun from their recorded settings: "
            f"{sum(e['agrees'] for e in entries.values())} agree, {sum(e['bitwise'] for e in entries.values())} "
            f"bit for bit; {len(whole)} whole")
    if whole:
        largest = max(abs(e["final_eval_loss"]["difference"]) for e in whole)
        line += f" (final validation loss at most {largest:.1e} apart)"
    return line + (f", {len(entries) - len(whole)} to step {'/'.join(map(str, partial))}" if partial else "") + "."


def _coverage(entries: dict[str, dict], table_names: list[str]) -> str:
    """How far the arms the report's tables read are reproduced under this code's numerics."""
    whole = [name for name in table_names if _covered(entries.get(name), None)]
    partial = [name for name in table_names if name not in whole and _covered(entries.get(name), 1)]
    return (f"Of the {len(table_names)} finished arms the report's tables read, {len(whole)} agree rerun whole "
            f"and {len(partial)} rerun to a step only, under these numerics ({NUMERICS}); "
            f"{len(table_names) - len(whole) - len(partial)} not (yet).")


def _markdown(entries: dict[str, dict], table_names: list[str]) -> str:
    lines = [_summary(entries), "", _coverage(entries, table_names), "",
             "| arm | rerun at | steps compared | records | bitwise | largest difference | "
             "final validation loss, recorded → rerun | agrees |", "|---|---|---:|---:|---|---:|---|---|"]
    for name, e in sorted(entries.items()):
        final = e["final_eval_loss"]
        final_text = f"{final['recorded']:.4f} → {final['rerun']:.4f} ({final['difference']:+.1e})" if final else "—"
        commit = (e["commit"] or "no checkout")[:12]
        lines.append(f"| {name} | {commit} | {e['steps']} | {e['records']} | {'yes' if e['bitwise'] else 'no'} | "
                     f"{e['max_difference']:.1e} | {final_text} | {'yes' if e['agrees'] else '**no**'} "
                     f"({e['held_to']}) |")
    return "\n".join(lines) + "\n"


def _covered(entry: dict | None, steps: int | None) -> bool:
    """Whether an arm's kept comparison already answers this request under this code's numerics: an agreeing
    whole rerun for a whole one; for one to step `steps`, any rerun that got that far within PREFIX_RTOL."""
    if not entry or entry.get("numerics") != NUMERICS or not entry["agrees"]:
        return False
    if steps is None:
        return entry["final_eval_loss"] is not None
    return (entry["final_eval_loss"] is not None or entry["steps"] >= steps) and \
        entry.get("max_relative_difference", math.inf) <= PREFIX_RTOL


def write_reproductions(study: Study, entries: dict[str, dict]) -> None:
    """reproductions.json (every arm's latest comparison) and reproductions.md (its table, and how far the
    arms the tables read are covered)."""
    from . import table_arms

    table_names = sorted(_finished(study, table_arms(study)))
    (study.output_dir / "reproductions.json").write_text(json.dumps(entries, indent=1, sort_keys=True))
    (study.output_dir / "reproductions.md").write_text(_markdown(entries, table_names))


def _log_comparison(result: dict, log) -> None:
    final = result["final_eval_loss"]
    log(f"study: {result['arm']}: {result['records']} records to step {result['steps']}, largest difference "
        f"{result['max_difference']:.1e}" + (f", final validation loss {final['difference']:+.1e}" if final else "")
        + ("" if result["agrees"] else f": DOES NOT AGREE ({result['held_to']})"))


def reproduce_arms(study: Study, names: list[str] | None = None, steps: int | None = None,
                   tolerance: float = TOLERANCE, log=logger.info, tables_only: bool = False) -> list[dict]:
    """Rerun the named finished arms `study.parallel` at a time, each whole or its first `steps` steps, and
    record how each compares; returns this run's comparisons (none for an arm a signal stopped). Without
    names, every finished arm whose kept comparison does not already answer the request under these
    numerics (of those the report's tables read, with `tables_only`), so a sweep that was stopped
    continues where it stopped. `reproductions.json` / `.md` keep every arm's latest comparison, each
    written as soon as it is made."""
    if steps is not None and steps < 1:
        raise StudyError("--steps must be at least 1")
    arms = _chosen_arms(study, names, tables_only)
    path = study.output_dir / "reproductions.json"
    entries = json.loads(path.read_text()) if path.is_file() else {}
    if not names:
        covered = {arm.name for arm in arms if _covered(entries.get(arm.name), steps)}
        if covered:
            log(f"study: {len(covered)} of {len(arms)} finished arms already reproduced "
                f"{'whole' if steps is None else f'to step {steps} or further'} under these numerics are not "
                "rerun (name an arm to rerun it)")
        arms = [arm for arm in arms if arm.name not in covered]
    rerun_study = dataclasses.replace(study, output_dir=study.output_dir / "reproductions", checkpoint_steps=0)
    processes = ArmProcesses(log)
    keeping = threading.Lock()

    def reproduce(arm: Arm) -> dict | None:
        result = _rerun(study, rerun_study, arm, steps, processes, tolerance)
        if result is not None:
            with keeping:  # kept at once: a sweep of many arms may be stopped between them
                entries[arm.name] = result
                write_reproductions(study, entries)
                _log_comparison(result, log)
        return result

    with processes.stopping_on_signals(), ThreadPoolExecutor(max_workers=study.parallel) as pool:
        results = list(pool.map(reproduce, arms))
    return [r for r in results if r is not None]
