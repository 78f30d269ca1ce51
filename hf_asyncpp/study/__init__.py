"""Studies: grids of training runs over optimizer × delay mode × Error Feedback × momentum × depth ×
seed, with a results table and figures (`hf-asyncpp study <study.yaml>`).

Two phases, as the reference study ran them: each optimizer with several learning rates first picks,
for each momentum value, the one whose synchronous run (first seed) ends with the lowest validation
loss (tuning.json records the trials and picks); then every arm runs with the pick of its optimizer
and momentum, delayed arms with the learning rate tuned for sync, unchanged.
The grid format is in grid.py, how arms run in runner.py, the table in results.py, the reference
study's claims held against it in claims.py, the figures in figures.py, and the gap against the training
budget across several studies in budget.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..log import get_logger
from .figures import write_figures
from .grid import Arm, Study, StudyError, load_study, mode_name
from .claims import claims_markdown, headline_markdown, verdicts_markdown
from .results import collect_arms, final_losses, results_rows, write_results
from .processes import StudyStopped
from .runner import check_arms, finished_record, run_arms

__all__ = ["Arm", "Study", "StudyError", "StudyStopped", "load_study", "read_chosen", "report", "run_study"]

logger = get_logger(__name__)


TUNING = "tuning.json"


def _tuning_record(trials: dict, chosen: dict, at_edge: set) -> dict:
    """tuning.json: every trial and every pick, one entry per (optimizer, momentum[, learning rate]);
    a pick that is the smallest or largest of three or more candidates is marked `at_edge`."""
    return {"format": 2,
            "trials": [dict(optimizer=o, momentum=m, learning_rate=lr, eval_loss=loss)
                       for (o, m), t in trials.items() for lr, loss in t.items()],
            "chosen": [dict(optimizer=o, momentum=m, learning_rate=lr, at_edge=(o, m) in at_edge)
                       for (o, m), lr in chosen.items()]}


def read_chosen(study: Study) -> dict[tuple[str, float], float]:
    """The learning rate of each (optimizer, momentum) that tuning.json records. Without tuning.json
    (tuning not finished), the pick of the tuning arms finished so far, by the same rule, and each
    optimizer's first candidate where none has finished. A tuning.json of the format before
    per-momentum tuning ({"chosen": {optimizer: lr}}, tuned at the first momentum and used at all of
    them, as those arms ran) gives that learning rate to every momentum value of the optimizer."""
    path = study.output_dir / TUNING
    chosen = study.first_learning_rates()
    if not path.is_file():
        return {**chosen, **_pick(_finished_trials(study, study.tuning_arms()))[0]}
    record = json.loads(path.read_text())
    if isinstance(record.get("chosen"), dict):  # the format before per-momentum tuning
        for optimizer, lr in record["chosen"].items():
            chosen.update({(optimizer, m): float(lr) for m in study.momentums})
        return chosen
    if record.get("format") != 2 or not isinstance(record.get("chosen"), list):
        raise StudyError(f"{path}: not a tuning record this version reads; delete it to tune again "
                         "(finished tuning arms are not rerun)")
    for entry in record["chosen"]:
        chosen[(entry["optimizer"], float(entry["momentum"]))] = float(entry["learning_rate"])
    return chosen


def _finished_trials(study: Study, tuning: list[Arm]) -> dict[tuple[str, float], dict[float, float]]:
    """The final validation loss of each tuning arm finished with its current settings, per
    (optimizer, momentum) and learning rate; a pair none of whose arms finished has no entry."""
    trials: dict[tuple[str, float], dict[float, float]] = {}
    for arm in tuning:
        record = finished_record(study, arm)
        if record is not None:
            trials.setdefault((arm.optimizer, arm.momentum), {})[arm.learning_rate] = record["final_eval"]["eval_loss"]
    return trials


def _pick(trials: dict) -> tuple[dict[tuple[str, float], float], set[tuple[str, float]]]:
    """Per (optimizer, momentum), the learning rate with the lowest final validation loss; and the
    pairs whose pick is the smallest or largest of three or more candidates (the optimum may lie
    beyond them)."""
    chosen = {pair: min(losses, key=losses.get) for pair, losses in trials.items()}
    at_edge = {pair for pair, losses in trials.items()
               if len(losses) >= 3 and chosen[pair] in (min(losses), max(losses))}
    return chosen, at_edge


def _choose_learning_rates(study: Study, log) -> dict[tuple[str, float], float]:
    """Run the tuning arms (those finished are skipped) and pick, per (optimizer, momentum), the
    learning rate with the lowest final validation loss; written to tuning.json."""
    tuning = study.tuning_arms()
    chosen = study.first_learning_rates()
    if not tuning:
        return chosen
    log(f"study: tuning learning rates on {len(tuning)} sync arms")
    run_arms(study, tuning, log)
    trials = _finished_trials(study, tuning)
    untried = sorted({(arm.optimizer, arm.momentum) for arm in tuning} - set(trials))
    if untried:
        raise StudyError(f"every learning-rate trial of {untried[0][0]} at momentum {untried[0][1]:g} failed "
                         f"(see {study.output_dir / 'arms'})")
    picks, at_edge = _pick(trials)
    chosen.update(picks)
    for pair in sorted(at_edge):
        end = "largest" if chosen[pair] == max(trials[pair]) else "smallest"
        log(f"study: warning: {pair[0]}'s best learning rate at momentum {pair[1]:g}, {chosen[pair]:g}, is the {end} "
            "of its candidates: the optimum may lie beyond them; add a candidate past it (finished arms are kept)")
    (study.output_dir / TUNING).write_text(json.dumps(_tuning_record(trials, chosen, at_edge), indent=1))
    log("study: learning rates: " + ", ".join(f"{o} (momentum {m:g}) {lr:g}" for (o, m), lr in chosen.items()))
    return chosen


def report(study: Study, failed: list[str] | None = None) -> list[Path]:
    """Tables, claims, the two tables README Results quotes (headline, verdicts) and figures from the finished
    arms (the ones in the grid; tuning-only arms are left out)."""
    if not (study.output_dir / "arms").is_dir():
        raise StudyError(f"{study.output_dir} holds no arms, so there is nothing to report: run the study first")
    records = collect_arms(study.output_dir / "arms")
    in_grid = {a.name for a in study.arms(read_chosen(study))}
    records = [r for r in records if Arm.from_record(r).name in in_grid]
    rows = results_rows(records)
    claims, headline, verdicts = (study.output_dir / name for name in ("claims.md", "headline.md", "verdicts.md"))
    main = study.main_delayed_mode()
    main_mode = mode_name(*main) if main else None
    losses = final_losses(records)
    claims.write_text(claims_markdown(study, losses))
    verdicts.write_text(verdicts_markdown(study, losses))
    headline.write_text(headline_markdown(study, rows))
    return [*write_results(study.output_dir, rows, records, failed or []), claims, headline, verdicts,
            *write_figures(study.output_dir, rows, records, main_mode)]


def run_study(path: str | Path, log=logger.info) -> list[Path]:
    """Run (or continue) a study and write its report; returns the files written. StudyStopped, without
    a report, when a signal stopped it (a rerun continues it)."""
    study = load_study(path)
    # Every arm's config is checked before anything runs (with each optimizer's first learning rate).
    check_arms(study, study.tuning_arms() + study.arms(study.first_learning_rates()))
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
