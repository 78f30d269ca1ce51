"""The gaps along the run: at each of a study's `report_steps`, every delayed row's held-out gap beside its
training-loss gap, paired by seed against the sync arm of the same optimizer and momentum (steps.md).

- The held-out gap reads the evaluation the arm logged at that step.
- The training-loss gap reads the mean of the training losses the arm logged over the TRAIN_WINDOW steps up
  to it. A delayed arm's training loss is measured on the weights its forward used, one version behind.
- EF's share is of the held-out gap, as in the results table.

A step before the last is on its way down the longer run's learning-rate schedule, not at the end of a
shorter run's: the last step is the budget the study names, the others show how the gaps move with steps.
The results table's training-loss gap (results.py) is this reading at the arm's last step.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .grid import Arm, Study
from .results import Losses, markdown_head, markdown_row, mean_and_std, paired_gaps, row_key, row_share, share_cell, spread

__all__ = ["TRAIN_WINDOW", "final_training_losses", "losses_at", "steps_markdown", "steps_rows", "write_steps"]

# 25 logged steps of 32 sequences at the studies' logging_steps 10: 800 sequences, enough to average
# out one batch's luck, short enough to follow the run (the studies evaluate every 250 steps).
TRAIN_WINDOW = 250


def _curves(study: Study, records: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """Each record's arm's (training, evaluation) curves, read once."""
    from ..plots import read_metrics
    from .runner import arm_dir

    return [read_metrics(arm_dir(study, Arm.from_record(record))) for record in records]


def _training_loss(train: list[dict], step: int) -> float | None:
    """The mean logged training loss over the TRAIN_WINDOW steps up to `step` (None: none logged there)."""
    window = [t["loss"] for t in train if step - TRAIN_WINDOW < t["step"] <= step]
    return statistics.fmean(window) if window else None


def losses_at(records: list[dict], curves: list[tuple[list[dict], list[dict]]], step: int) -> tuple[Losses, Losses]:
    """(held-out, training) losses of each finished arm at `step` from its `curves` (_curves), keyed as
    results.final_losses; an arm that logged no evaluation at `step` (or no training loss in the window)
    is left out of that one."""
    held_out: Losses = defaultdict(dict)
    training: Losses = defaultdict(dict)
    for record, (train, evals) in zip(records, curves):
        key, seed = row_key(record), record["arm"]["seed"]
        at_step = [e["eval_loss"] for e in evals if e["step"] == step]
        if at_step:
            held_out[key][seed] = at_step[0]
        if (loss := _training_loss(train, step)) is not None:
            training[key][seed] = loss
    return dict(held_out), dict(training)


def final_training_losses(study: Study, records: list[dict]) -> Losses:
    """Each finished arm's training loss at its last logged step, keyed as results.final_losses."""
    training: Losses = defaultdict(dict)
    for record, (train, _) in zip(records, _curves(study, records)):
        if train and (loss := _training_loss(train, train[-1]["step"])) is not None:
            training[row_key(record)][record["arm"]["seed"]] = loss
    return dict(training)


def steps_rows(study: Study, records: list[dict]) -> list[dict]:
    """A row per (optimizer, momentum, EF λ, delayed mode, report step): its held-out and training-loss
    gaps (mean, standard deviation, seeds) and EF's share of the held-out gap."""
    rows, curves = [], _curves(study, records)
    for step in study.report_steps:
        held_out, training = losses_at(records, curves, step)
        for key in sorted(k for k in held_out if k[1] != "sync"):
            gaps, train_gaps = paired_gaps(held_out, key), paired_gaps(training, key)
            rows.append(dict(optimizer=key[0], mode=key[1], ef_lambda=key[2], momentum=key[3], step=step,
                             seeds=len(gaps), gap=mean_and_std(gaps), train_gap=mean_and_std(train_gaps),
                             train_seeds=len(train_gaps), ef_recovered=row_share(held_out, key)))
    return rows


def _gap(gap: tuple[float | None, float | None], seeds: int) -> str:
    return "–" if gap[0] is None else spread(gap[0], gap[1], seeds)


def steps_markdown(rows: list[dict], note: str = "") -> str:
    """steps.md: a line per row, held-out and training-loss gaps side by side."""
    lines = [*([note, ""] if note else []),
             "The gaps along the run: at each step, loss − the sync arm's (same optimizer, momentum and seed), mean ± "
             "standard deviation of the paired differences (seeds). Held out: the evaluation at that step. Training: the "
             f"mean logged training loss over the {TRAIN_WINDOW} steps up to it. EF's share: of the held-out gap.", "",
             *markdown_head(["optimizer", "momentum", "mode", "EF λ", "step", "held-out gap", "training-loss gap",
                             "EF's share"])]
    for r in rows:
        lines.append(markdown_row([r["optimizer"], f"{r['momentum']:g}", r["mode"], f"{r['ef_lambda']:g}", str(r["step"]),
                                   _gap(r["gap"], r["seeds"]), _gap(r["train_gap"], r["train_seeds"]),
                                   share_cell(r["ef_recovered"]) if r["ef_lambda"] > 0 else "–"]))
    return "\n".join(lines) + "\n"


def write_steps(study: Study, records: list[dict], note: str = "") -> list[Path]:
    """steps.md and steps.json when the study names report steps; nothing otherwise."""
    if not study.report_steps:
        return []
    rows = steps_rows(study, records)
    paths = [study.output_dir / "steps.md", study.output_dir / "steps.json"]
    paths[0].write_text(steps_markdown(rows, note))
    paths[1].write_text(json.dumps({"train_window": TRAIN_WINDOW, "rows": rows}, indent=1))
    return paths
