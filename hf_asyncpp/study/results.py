"""A study's results table: per (optimizer, mode, EF λ, momentum), over seeds.

A mode is `sync`, `schedule@depth`, or a sync-start mode `schedule@depth+syncN` (synchronous for N steps,
then delayed): every mode but `sync` is a delayed mode, with its own row, its gap to the sync arm of the
same optimizer, momentum and seed, and its EF share against its own EF-off twin (same mode).

- `val_loss`: the mean final validation loss over seeds, `val_loss_std` its sample standard deviation
  (the seed spread);
- `gap`: val_loss − the matching sync arm's (same optimizer, momentum), averaged over the seeds both
  finished (paired by seed: the same data order and initial weights, so seed noise largely cancels),
  `gap_std` the standard deviation of those paired differences;
- `ef_recovered`: for an EF arm, the share of its EF-off twin's gap that EF removes,
  (gap_off − gap_ef) / gap_off; undefined (None) when the twin shows no gap to recover;
- `train_gap`, `train_gap_std`: the same paired gap of the training loss over the run's last steps
  (steps.py reads it from the arms' logs): a held-out split that the sync arm fits better than it
  generalises moves the two gaps apart, and the report shows both.

Written as results.json (rows and every arm's loss), results.csv and results.md, and summary.md: the
same rows pivoted to one line per (optimizer, momentum, EF λ) and one column per delayed mode, each
cell the gap ± its paired seed spread (seeds), and a second table of EF's share per mode — the
comparison across depths and schedules that the study's claims are about, at a glance.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

from .grid import Arm

__all__ = ["Losses", "ef_share", "final_losses", "gap_cell", "mean_and_std", "paired_gaps", "results_rows", "row_key",
           "row_share", "row_share_cell", "seeds_note", "share_cell", "spread", "summary_markdown", "write_results"]

COLUMNS = ("protocol", "optimizer", "mode", "ef_lambda", "momentum", "learning_rate", "seeds", "val_loss", "val_loss_std",
           "gap", "gap_std", "ef_recovered", "train_gap", "train_gap_std")

Losses = dict[tuple, dict[int, float]]  # (optimizer, mode, EF λ, momentum) → seed → loss


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def spread(mean: float, std: float, seeds: int, signed: bool = True, count: bool = True) -> str:
    """A seed mean as the reports print it: `mean ± sample std (seeds)`; one seed has no spread to show.
    Without `count`, the seed count is left for the caller to print once for several values."""
    value = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    if seeds > 1:
        value += f" ± {std:.3f}"
    return f"{value} ({seeds_label(seeds)})" if count else value


def gap_cell(row: dict | None) -> str:
    """A row's gap to sync as the tables print it; '–' without the row or without a paired sync arm."""
    return "–" if row is None or row["gap"] is None else spread(row["gap"], row["gap_std"], row["seeds"])


def _train_gap_cell(row: dict | None) -> str:
    if row is None or row.get("train_gap") is None:
        return "–"
    return spread(row["train_gap"], row["train_gap_std"], row["seeds"])


def share_cell(share: float | None) -> str:
    """EF's share of the gap (`ef_recovered`) as the tables print it, in whole percent; '–' without one."""
    return "–" if share is None else f"{100 * share:.0f}%"


def row_share_cell(row: dict | None) -> str:
    """A row's EF share as the tables print it; '–' without the row (an arm not finished or not in the grid)."""
    return share_cell(None if row is None else row["ef_recovered"])


def seeds_label(seeds: int) -> str:
    return "1 seed" if seeds == 1 else f"{seeds} seeds"


def seeds_note(study) -> str:
    """Which seeds the tables read, and why (grid.py: `Study.reported_seeds`)."""
    reported = ", ".join(map(str, study.reported_seeds))
    if study.tuning_seed is None:
        return f"Seeds {reported}: no arm chose a learning rate (each was fixed before any ran)."
    return (f"Seeds {reported}: seed {study.tuning_seed}'s arms chose the learning rates, and no number here comes "
            "from them.")


def row_key(record: dict) -> tuple:
    """What a finished arm's record is a row of: (optimizer, mode, EF λ, momentum)."""
    a = record["arm"]
    return a["optimizer"], record["mode"], a["ef_lambda"], a["momentum"]


def final_losses(records: list[dict]) -> Losses:
    """Each arm's final validation loss: (optimizer, mode, EF λ, momentum) → seed → loss."""
    losses: Losses = defaultdict(dict)
    for r in records:
        losses[row_key(r)][r["arm"]["seed"]] = r["final_eval"]["eval_loss"]
    return dict(losses)


def paired_gaps(losses: Losses, key: tuple) -> list[float]:
    """The row's per-seed gaps to the sync arm of its optimizer and momentum, over the seeds both have."""
    sync = losses.get((key[0], "sync", 0.0, key[3]))
    if sync is None or key not in losses:
        return []
    return [loss - sync[seed] for seed, loss in sorted(losses[key].items()) if seed in sync]


def mean_and_std(values: list[float]) -> tuple[float | None, float | None]:
    return (statistics.fmean(values), _std(values)) if values else (None, None)


def ef_share(gap_off: float | None, gap_ef: float | None) -> float | None:
    """The share of the EF-off gap that EF removes, (gap_off − gap_ef) / gap_off; None without a gap to
    remove (or a gap not measured)."""
    if gap_off is None or gap_ef is None or gap_off <= 0:
        return None
    return (gap_off - gap_ef) / gap_off


def row_share(losses: Losses, key: tuple) -> float | None:
    """EF's share of the gap for an EF row (None for a row without EF, or without its EF-off twin)."""
    twin = (key[0], key[1], 0.0, key[3])
    if key[2] <= 0 or twin not in losses:
        return None
    return ef_share(mean_and_std(paired_gaps(losses, twin))[0], mean_and_std(paired_gaps(losses, key))[0])


def results_rows(records: list[dict], protocol: str = "sync", train_losses: Losses | None = None) -> list[dict]:
    """The table's rows, sync first within each optimizer, for the arms a learning-rate protocol reads;
    `train_losses` (same keys, each arm's training loss at its end) gives the training-loss gaps."""
    losses = final_losses(records)
    learning_rates = {row_key(r): r["arm"]["learning_rate"] for r in records}
    rows = []
    for key in sorted(losses, key=lambda k: (k[0], k[3], k[1] != "sync", k[1], k[2])):
        values = list(losses[key].values())
        train_gap = mean_and_std(paired_gaps(train_losses or {}, key))
        rows.append(dict(zip(COLUMNS, (protocol, key[0], key[1], key[2], key[3], learning_rates[key], len(values),
                                       statistics.fmean(values), _std(values), *mean_and_std(paired_gaps(losses, key)),
                                       row_share(losses, key), *train_gap))))
    return rows


def _delayed_modes(rows: list[dict]) -> list[str]:
    """The delayed modes in the order of the table's rows (schedule, then depth, sync start last)."""
    modes = {r["mode"] for r in rows if r["mode"] != "sync"}
    return sorted(modes, key=lambda m: ("+" in m, m.split("@")[0], int(m.split("@")[1].split("+")[0])))


def markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_head(columns: list[str]) -> list[str]:
    return [markdown_row(columns), "|" + "---|" * len(columns)]


def summary_markdown(rows: list[dict]) -> str:
    """summary.md: per learning-rate protocol, gaps per (optimizer, momentum, EF λ) × delayed mode, then
    EF's share per mode."""
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    if len(protocols) > 1:
        return "\n".join(f"Protocol `{p}`:\n\n" + _protocol_summary([r for r in rows if r["protocol"] == p])
                         for p in protocols)
    return _protocol_summary(rows)


def _protocol_summary(rows: list[dict]) -> str:
    modes = _delayed_modes(rows)
    by_key = {(r["optimizer"], r["momentum"], r["ef_lambda"], r["mode"]): r for r in rows}
    pairs = sorted({(r["optimizer"], r["momentum"]) for r in rows})
    lambdas = sorted({r["ef_lambda"] for r in rows})

    lines = ["Gap to sync: validation loss − the sync arm's (same optimizer, momentum and seed), mean ± standard",
             "deviation of the paired differences (seeds); '–': not finished, or not in the grid.", "",
             *markdown_head(["optimizer", "momentum", "EF λ", "sync val_loss", *modes])]
    for optimizer, momentum in pairs:
        sync = by_key.get((optimizer, momentum, 0.0, "sync"))
        base = spread(sync["val_loss"], sync["val_loss_std"], sync["seeds"], signed=False) if sync else "–"
        for ef in lambdas:
            cells = [gap_cell(by_key.get((optimizer, momentum, ef, mode))) for mode in modes]
            lines.append(markdown_row([optimizer, f"{momentum:g}", f"{ef:g}", base, *cells]))
    if any(r["train_gap"] is not None for r in rows):
        lines += ["", "The same gap in training loss, over the run's last steps (steps.py): held-out and training",
                  "gaps apart show a held-out split that the arms fit unequally.", "",
                  *markdown_head(["optimizer", "momentum", "EF λ", *modes])]
        for optimizer, momentum in pairs:
            for ef in lambdas:
                cells = [_train_gap_cell(by_key.get((optimizer, momentum, ef, mode))) for mode in modes]
                lines.append(markdown_row([optimizer, f"{momentum:g}", f"{ef:g}", *cells]))
    if any(ef > 0 for ef in lambdas):
        lines += ["", "Share of the EF-off gap that Error Feedback removes, (gap_off − gap_ef) / gap_off ('–': no",
                  "gap to remove, an arm not finished, or not in the grid).", "",
                  *markdown_head(["optimizer", "momentum", "EF λ", *modes])]
        for optimizer, momentum in pairs:
            for ef in (ef for ef in lambdas if ef > 0):
                cells = [row_share_cell(by_key.get((optimizer, momentum, ef, mode)))
                         for mode in modes]
                lines.append(markdown_row([optimizer, f"{momentum:g}", f"{ef:g}", *cells]))
    return "\n".join(lines) + "\n"


def _cell(column: str, value) -> str:
    if value is None:
        return "–"
    if column in ("gap", "train_gap"):
        return f"{value:+.4f}"
    if column == "ef_recovered":
        return share_cell(value)
    if column in ("val_loss", "val_loss_std", "gap_std", "train_gap_std"):
        return f"{value:.4f}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def write_results(out_dir: Path, rows: list[dict], records: list[dict], failed: list[str],
                  stale: list[str] = (), note: str = "") -> list[Path]:
    """results.json/.csv/.md and summary.md; `stale`: arms of the grid that finished under other settings or
    numerics than this code's (not in the table: a rerun of the study runs them again); `note` heads the
    tables (which seeds they read)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.csv", out_dir / "results.md", out_dir / "summary.md"]
    per_arm = {Arm.from_record(r).name: r["final_eval"]["eval_loss"] for r in records}
    paths[0].write_text(json.dumps({"rows": rows, "arms": per_arm, "failed_arms": failed, "stale_arms": list(stale)},
                                   indent=1))
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = markdown_head(COLUMNS) + [markdown_row([_cell(c, row[c]) for c in COLUMNS]) for row in rows]
    if failed:
        lines += ["", f"Failed arms (not in the table): {', '.join(failed)}"]
    if stale:
        lines += ["", f"Stale arms, finished under other settings or numerics (not in the table; a rerun of the study "
                      f"runs them again): {', '.join(stale)}"]
    head = f"{note}\n\n" if note else ""
    paths[2].write_text(head + "\n".join(lines) + "\n")
    paths[3].write_text(head + summary_markdown(rows))
    return paths

