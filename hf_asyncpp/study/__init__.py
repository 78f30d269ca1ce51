"""Studies: grids of training runs over optimizer × delay mode × Error Feedback × momentum × depth ×
seed, with a results table and figures (`hf-asyncpp study <study.yaml>`).

Two phases, as the reference study ran them: each optimizer with several learning rates first picks
the one whose synchronous run (first seed, first momentum) ends with the lowest validation loss; then
every arm runs with its optimizer's pick, delayed arms with the learning rate tuned for sync, unchanged.
The grid format is in grid.py, how arms run in runner.py, the table in results.py, the figures in
figures.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..log import get_logger
from .figures import write_figures
from .grid import Arm, Study, StudyError, load_study
from .results import collect_arms, results_rows, write_results
from .runner import arm_dir, check_arms, run_arms

__all__ = ["Arm", "Study", "StudyError", "load_study", "report", "run_study"]

logger = get_logger(__name__)


def _choose_learning_rates(study: Study, log) -> dict[str, float]:
    tuning = study.tuning_arms()
    chosen = {opt: lrs[0] for opt, lrs in study.learning_rates.items()}
    if not tuning:
        return chosen
    log(f"study: tuning learning rates on {len(tuning)} sync arms")
    outcomes = run_arms(study, tuning, log)
    trials = {}
    for arm in tuning:
        if outcomes[arm.name] != "failed":
            loss = json.loads((arm_dir(study, arm) / "arm.json").read_text())["final_eval"]["eval_loss"]
            trials.setdefault(arm.optimizer, {})[arm.learning_rate] = loss
    for optimizer in {a.optimizer for a in tuning}:
        if not trials.get(optimizer):
            raise StudyError(f"every learning-rate trial of {optimizer} failed (see {study.output_dir / 'arms'})")
        chosen[optimizer] = min(trials[optimizer], key=trials[optimizer].get)
    (study.output_dir / "tuning.json").write_text(json.dumps(
        {"trials": {o: {str(lr): loss for lr, loss in t.items()} for o, t in trials.items()}, "chosen": chosen},
        indent=1))
    log("study: learning rates: " + ", ".join(f"{o} {lr:g}" for o, lr in chosen.items()))
    return chosen


def report(study: Study, failed: list[str] | None = None) -> list[Path]:
    """Table and figures from the finished arms (the ones in the grid; tuning-only arms are left out)."""
    records = collect_arms(study.output_dir / "arms")
    chosen = json.loads((study.output_dir / "tuning.json").read_text())["chosen"] \
        if (study.output_dir / "tuning.json").is_file() else {o: lrs[0] for o, lrs in study.learning_rates.items()}
    in_grid = {a.name for a in study.arms(chosen)}
    records = [r for r in records if Arm.from_record(r).name in in_grid]
    rows = results_rows(records)
    return write_results(study.output_dir, rows, records, failed or []) + write_figures(study.output_dir, rows, records)


def run_study(path: str | Path, log=logger.info) -> list[Path]:
    """Run (or continue) a study and write its report; returns the files written."""
    study = load_study(path)
    # Every arm's config is checked before anything runs (with each optimizer's first learning rate).
    check_arms(study, study.tuning_arms() + study.arms({o: lrs[0] for o, lrs in study.learning_rates.items()}))
    study.output_dir.mkdir(parents=True, exist_ok=True)
    chosen = _choose_learning_rates(study, log)
    arms = study.arms(chosen)
    log(f"study: {study.name}: {len(arms)} arms, {study.parallel} at a time, launch {study.launch}")
    outcomes = run_arms(study, arms, log)
    failed = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    paths = report(study, failed)
    log(f"study: {sum(o == 'done' for o in outcomes.values())} ran, {sum(o == 'skipped' for o in outcomes.values())} "
        f"already finished, {len(failed)} failed; results in {study.output_dir}")
    return paths
