"""Studies: grids of training runs over optimizer × delay mode × Error Feedback × momentum × depth ×
seed, with a results table and figures (`hf-asyncpp study <study.yaml>`).

Learning rates are tuned first, by one rule (tuning.py: the lowest final validation loss on the first
seed, an edge pick extended): under `lr_protocol: sync` each optimizer and momentum picks on its
synchronous arms and every delayed arm reuses that pick; under `per_mode` each (optimizer, mode, EF,
momentum) picks its own; `both` runs and reports the two side by side (tuning.json records trials and
picks). Then every arm runs its seeds at its pick.
The grid format is in grid.py, how arms run in runner.py, the table in results.py, the reference
study's claims held against it in claims.py (written out by claims_report.py), the figures in
figures.py, the gap against the training budget across several studies in budget.py, and rerunning
finished arms to hold them to their records in reproduce.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..log import get_logger
from .claims_report import (claims_markdown, headline_by_protocol, headline_markdown, verdicts_by_protocol,
                            verdicts_markdown)
from .figures import write_figures
from .grid import Arm, Study, StudyError, load_study, mode_name
from .results import final_losses, results_rows, seeds_note, write_results
from .processes import StudyStopped
from .reproduce import write_reproductions
from .runner import check_arms, finished_record, run_arms
from .steps import final_training_losses, write_steps
from .tuning import per_mode_picks, sync_picks, tune, write_tuning

__all__ = ["Arm", "Study", "StudyError", "StudyStopped", "known_arms", "load_study", "protocol_arms",
           "read_chosen", "read_per_mode", "report", "run_study", "table_arms"]

PROTOCOL_MEANINGS = {
    "sync": "every arm of an optimizer and momentum at the learning rate tuned on its sync arms.",
    "per_mode": "each delayed mode (and EF λ) at the learning rate tuned on its own arms, among the sync pick × "
                "the study's factors.",
}

logger = get_logger(__name__)


def _chosen(study: Study, sync) -> dict[tuple[str, float], float]:
    """Each (optimizer, momentum)'s pick in the sync tuning `sync`, its first candidate where none has
    finished."""
    return {**study.first_learning_rates(), **sync.chosen()}


def read_chosen(study: Study) -> dict[tuple[str, float], float]:
    """Each (optimizer, momentum)'s sync pick among its finished tuning arms (tuning.py), its first
    candidate where none has finished."""
    return _chosen(study, sync_picks(study))


def _per_mode_tuning(study: Study, sync_chosen: dict):
    """The per_mode protocol's tuning as its finished arms give it; None when the study does not run it."""
    return per_mode_picks(study, sync_chosen) if "per_mode" in study.protocols else None


def read_per_mode(study: Study, sync_chosen: dict) -> dict[tuple, float]:
    """Each delayed group's own pick among its finished candidates (none before the per_mode protocol's
    tuning has finished one); {} when the study does not run that protocol."""
    tuning = _per_mode_tuning(study, sync_chosen)
    return tuning.chosen() if tuning else {}


def _tunings(study: Study):
    """The sync tuning and its picks, the per_mode tuning (None when the study does not run it) and its
    picks, as the finished arms give them now."""
    sync = sync_picks(study)
    chosen = _chosen(study, sync)
    per_mode_tuning = _per_mode_tuning(study, chosen)
    return sync, chosen, per_mode_tuning, per_mode_tuning.chosen() if per_mode_tuning else {}


def known_arms(study: Study) -> list[Arm]:
    """Every arm the study runs, as far as its finished arms tell now: each tuning's candidates (with the
    extensions finished results have added) and each protocol's arms at the picks so far."""
    sync, chosen, per_mode_tuning, per_mode = _tunings(study)
    arms = [study.tuning_arm(g, lr) for g, lrs in sync.candidates.items() for lr in lrs]
    if per_mode_tuning:
        arms += [study.tuning_arm(g, lr) for g, lrs in per_mode_tuning.candidates.items() for lr in lrs]
    return _each_once(arms + _grid_arms(study, chosen, per_mode))


def table_arms(study: Study) -> list[Arm]:
    """The arms the report's tables read (every protocol's, at the picks so far; tuning-only arms aside)."""
    _, chosen, _, per_mode = _tunings(study)
    return _grid_arms(study, chosen, per_mode)


def _each_once(arms: list[Arm]) -> list[Arm]:
    return list({arm.name: arm for arm in arms}.values())


def _grid_arms(study: Study, sync_chosen: dict, per_mode: dict) -> list[Arm]:
    """Every protocol's arms, each once (the protocols share their sync arms)."""
    return _each_once([arm for protocol in study.protocols for arm in protocol_arms(study, protocol, sync_chosen, per_mode)])


def protocol_arms(study: Study, protocol: str, sync_chosen: dict, per_mode: dict) -> list[Arm]:
    """The grid's arms as a protocol reads them: delayed arms at the sync pick, or at their own."""
    return study.arms(sync_chosen, per_mode if protocol == "per_mode" else None)


def report(study: Study, failed: list[str] | None = None) -> list[Path]:
    """Tables, claims, headline.md and verdicts.md (quoted by README Results and docs/studies.md), steps.md (the gaps
    along the run, at the study's report steps), figures and tuning.json from the finished arms (the tables read
    the grid's arms of the reported seeds; tuning-only arms and the tuning seed's are left out); reproductions.md
    again where arms were reproduced, its coverage of the tables' arms as they stand now."""
    if not (study.output_dir / "arms").is_dir():
        raise StudyError(f"{study.output_dir} holds no arms, so there is nothing to report: run the study first")
    sync, chosen, per_mode_tuning, per_mode = _tunings(study)
    write_tuning(study, sync, per_mode_tuning)  # the picks as the finished arms give them now
    main = study.main_delayed_mode()
    main_mode = mode_name(*main) if main else None
    claims, figures, stale, reported = [], [], set(), {}
    losses: dict[str, dict] = {}  # per protocol, its finished arms' final losses
    rows_of: dict[str, list[dict]] = {}  # per protocol, its results rows
    read: dict[str, dict | None] = {}  # arm name → its finished record (None: not finished with these settings)
    for protocol in study.protocols:
        arms = protocol_arms(study, protocol, chosen, per_mode)
        for arm in arms:  # each arm's record read once, though the protocols share their sync arms
            if arm.name not in read:
                read[arm.name] = finished_record(study, arm)
        finished = {arm.name: read[arm.name] for arm in arms}
        records = [r for r in finished.values() if r is not None]
        reported.update({name: r for name, r in finished.items() if r is not None})
        stale |= {name for name, r in finished.items() if r is None and (study.output_dir / "arms" / name / "arm.json").is_file()}
        rows_of[protocol] = results_rows(records, protocol, final_training_losses(study, records))
        losses[protocol] = final_losses(records)
        heading = f"**Protocol `{protocol}`**: {PROTOCOL_MEANINGS[protocol]}\n\n" if len(study.protocols) > 1 else ""
        claims.append(heading + claims_markdown(study, losses[protocol]))
        suffix = "" if protocol == study.protocols[0] else f"_{protocol}"
        figures += write_figures(study.output_dir, rows_of[protocol], records, main_mode, suffix)
    if len(study.protocols) > 1:
        meanings = {protocol: PROTOCOL_MEANINGS[protocol] for protocol in study.protocols}
        texts = {"verdicts.md": verdicts_by_protocol(study, losses, meanings),
                 "headline.md": headline_by_protocol(study, rows_of, meanings)}
    else:
        (protocol,) = study.protocols
        texts = {"verdicts.md": verdicts_markdown(study, losses[protocol]),
                 "headline.md": headline_markdown(study, rows_of[protocol])}
    texts["claims.md"] = "\n".join(claims)
    rows = [row for protocol_rows in rows_of.values() for row in protocol_rows]
    note = seeds_note(study)
    paths = write_results(study.output_dir, rows, list(reported.values()), failed or [], sorted(stale), note)
    paths += write_steps(study, list(reported.values()), note)
    for name, text in texts.items():
        (study.output_dir / name).write_text(text)
        paths.append(study.output_dir / name)
    kept = study.output_dir / "reproductions.json"
    if kept.is_file():  # its coverage of the tables' arms moves as arms finish
        write_reproductions(study, json.loads(kept.read_text()))
        paths.append(kept.with_suffix(".md"))
    return [*paths, *figures]


def run_study(path: str | Path, log=logger.info) -> list[Path]:
    """Run (or continue) a study and write its report; returns the files written. StudyStopped, without
    a report, when a signal stopped it (a rerun continues it). Order: the sync tuning; then the per_mode
    tuning beside the sync protocol's arms (which need only the sync picks); then the per_mode arms."""
    study = load_study(path)
    # Every arm's config is checked before anything runs (with each optimizer's first learning rate).
    check_arms(study, study.tuning_arms() + study.arms(study.first_learning_rates()))
    study.output_dir.mkdir(parents=True, exist_ok=True)
    log(f"study: {study.name}: learning-rate protocol(s) {', '.join(study.protocols)}, {study.parallel} arms at a time, "
        f"launch {study.launch}")
    sync = tune(study, lambda: sync_picks(study), log)
    chosen = _chosen(study, sync)
    sync_arms = study.arms(chosen) if "sync" in study.protocols else []
    per_mode = None
    if "per_mode" in study.protocols:
        check_arms(study, per_mode_picks(study, chosen).unfinished_arms(study))
        per_mode = tune(study, lambda: per_mode_picks(study, chosen), log, alongside=sync_arms)
    outcomes = run_arms(study, _grid_arms(study, chosen, per_mode.chosen() if per_mode else {}), log)
    failed = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    paths = report(study, failed)
    log(f"study: {sum(o == 'done' for o in outcomes.values())} ran, {sum(o == 'skipped' for o in outcomes.values())} "
        f"already finished, {len(failed)} failed; results in {study.output_dir}")
    return paths
