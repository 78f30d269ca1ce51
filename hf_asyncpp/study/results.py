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
  (gap_off − gap_ef) / gap_off; undefined (None) when the twin shows no gap to recover.

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

__all__ = ["ef_share", "final_losses", "gap_cell", "results_rows", "row_share_cell", "share_cell", "spread",
           "summary_markdown", "write_results"]

COLUMNS = ("protocol", "optimizer", "mode", "ef_lambda", "momentum", "learning_rate", "seeds", "val_loss", "val_loss_std",
           "gap", "gap_std", "ef_recovered")


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


def share_cell(share: float | None) -> str:
    """EF's share of the gap (`ef_recovered`) as the tables print it, in whole percent; '–' without one."""
    return "–" if share is None else f"{100 * share:.0f}%"


def row_share_cell(row: dict | None) -> str:
    """A row's EF share as the tables print it; '–' without the row (an arm not finished or not in the grid)."""
    return share_cell(None if row is None else row["ef_recovered"])


def seeds_label(seeds: int) -> str:
    return "1 seed" if seeds == 1 else f"{seeds} seeds"


def final_losses(records: list[dict]) -> dict[tuple, dict[int, float]]:
    """Each arm's final validation loss: (optimizer, mode, EF λ, momentum) → seed → loss."""
    losses: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in records:
        a = r["arm"]
        losses[(a["optimizer"], r["mode"], a["ef_lambda"], a["momentum"])][a["seed"]] = r["final_eval"]["eval_loss"]
    return dict(losses)


def ef_share(gap_off: float | None, gap_ef: float | None) -> float | None:
    """The share of the EF-off gap that EF removes, (gap_off − gap_ef) / gap_off; None without a gap to
    remove (or a gap not measured)."""
    if gap_off is None or gap_ef is None or gap_off <= 0:
        return None
    return (gap_off - gap_ef) / gap_off


def results_rows(records: list[dict], protocol: str = "sync") -> list[dict]:
    """The table's rows, sync first within each optimizer, for the arms a learning-rate protocol reads."""
    losses = final_losses(records)
    learning_rates = {(r["arm"]["optimizer"], r["mode"], r["arm"]["ef_lambda"], r["arm"]["momentum"]):
                      r["arm"]["learning_rate"] for r in records}

    def gap(key) -> tuple[float | None, float | None]:
        sync = losses.get((key[0], "sync", 0.0, key[3]))
        if sync is None:
            return None, None
        paired = [loss - sync[s] for s, loss in losses[key].items() if s in sync]
        return (statistics.fmean(paired), _std(paired)) if paired else (None, None)

    rows = []
    for key in sorted(losses, key=lambda k: (k[0], k[3], k[1] != "sync", k[1], k[2])):
        values = list(losses[key].values())
        gap_mean, gap_std = gap(key)
        recovered = None
        if key[2] > 0 and (key[0], key[1], 0.0, key[3]) in losses:
            recovered = ef_share(gap((key[0], key[1], 0.0, key[3]))[0], gap_mean)
        rows.append(dict(zip(COLUMNS, (protocol, key[0], key[1], key[2], key[3], learning_rates[key], len(values),
                                       statistics.fmean(values), _std(values), gap_mean, gap_std, recovered))))
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
    if column in ("gap",):
        return f"{value:+.4f}"
    if column == "ef_recovered":
        return share_cell(value)
    if column in ("val_loss", "val_loss_std", "gap_std"):
        return f"{value:.4f}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def write_results(out_dir: Path, rows: list[dict], records: list[dict], failed: list[str],
                  stale: list[str] = ()) -> list[Path]:
    """results.json/.csv/.md and summary.md; `stale`: arms of the grid that finished under other settings or
    numerics than this code's (not in the table: a rerun of the study runs them again)."""
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
    paths[2].write_text("\n".join(lines) + "\n")
    paths[3].write_text(summary_markdown(rows))
    return paths

