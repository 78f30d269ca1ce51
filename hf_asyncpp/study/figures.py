"""A study's figures (PNG, matplotlib Agg), drawn from the results rows and the arms' metrics.

- loss_curves.png: per optimizer, the training loss (seed mean, smoothed) of every mode, EF on/off;
- gap_bars.png: per optimizer, the gap to sync of each delayed mode, without and with EF;
- gap_vs_momentum.png: the gap of the main delayed mode against momentum, one line per optimizer;
- gap_vs_depth.png: PipeDream's and PipeDream-2BW's gap against pipeline depth (EF off; sync-start modes
  left out).

A figure whose axis the grid does not vary is not drawn.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .grid import Arm

__all__ = ["write_figures"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _train_curve(arm_directory: Path) -> dict[int, float]:
    path = arm_directory / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def _smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def _label(mode: str, ef: float) -> str:
    return mode + (f" + EF λ={ef:g}" if ef else "")


def _loss_curves(plt, records, arms_dir: Path, out: Path) -> Path:
    optimizers = sorted({r["arm"]["optimizer"] for r in records})
    fig, axes = plt.subplots(1, len(optimizers), figsize=(5 * len(optimizers), 4), squeeze=False)
    momentum0 = min(r["arm"]["momentum"] for r in records)
    for ax, optimizer in zip(axes[0], optimizers):
        curves: dict[str, list[dict[int, float]]] = defaultdict(list)
        for r in records:
            a = r["arm"]
            if a["optimizer"] == optimizer and a["momentum"] == momentum0:
                curves[_label(r["mode"], a["ef_lambda"])].append(_train_curve(arms_dir / Arm.from_record(r).name))
        for label, runs in sorted(curves.items()):
            steps = sorted(set.intersection(*(set(c) for c in runs)))
            ax.plot(steps, _smooth([sum(c[s] for c in runs) / len(runs) for s in steps]), label=label)
        ax.set(title=f"{optimizer} (momentum {momentum0:g})", xlabel="step", ylabel="training loss (smoothed)")
        ax.legend(fontsize=7)
    return _save(plt, fig, out / "loss_curves.png")


def _gap_bars(plt, rows, out: Path) -> Path | None:
    delayed = [r for r in rows if r["mode"] != "sync" and r["gap"] is not None]
    if not delayed:
        return None
    optimizers = sorted({r["optimizer"] for r in delayed})
    labels = sorted({_label(r["mode"], r["ef_lambda"]) for r in delayed})
    momentum0 = min(r["momentum"] for r in delayed)
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(optimizers) * len(labels) / 2), 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [next((r for r in delayed if r["optimizer"] == o and r["momentum"] == momentum0
                        and _label(r["mode"], r["ef_lambda"]) == label), None) for o in optimizers]
        ax.bar([k + i * width for k in range(len(optimizers))], [v["gap"] if v else 0 for v in values], width,
               yerr=[v["gap_std"] if v else 0 for v in values], label=label, capsize=3)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(optimizers))], optimizers)
    ax.set(ylabel="validation loss − sync", title=f"Gap to synchronous training (momentum {momentum0:g})")
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "gap_bars.png")


def _gap_vs(plt, rows, out: Path, axis: str) -> Path | None:
    """Gap against momentum (one line per optimizer) or depth (per optimizer × schedule), EF off."""
    delayed = [r for r in rows if r["mode"] != "sync" and not r["ef_lambda"] and r["gap"] is not None]
    lines: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    if axis == "momentum":
        main = min((r["mode"] for r in delayed), key=lambda m: (not m.startswith("pipedream-2bw"), m), default=None)
        for r in delayed:
            if r["mode"] == main:
                lines[r["optimizer"]].append((r["momentum"], r["gap"], r["gap_std"]))
    else:
        momentum0 = min((r["momentum"] for r in delayed), default=None)
        for r in delayed:
            if "+sync" in r["mode"]:
                continue  # sync start: its own mode, not a point of the depth trend
            schedule, depth = r["mode"].split("@")
            if schedule in ("pipedream", "pipedream-2bw") and r["momentum"] == momentum0:
                lines[f"{r['optimizer']} {schedule}"].append((int(depth), r["gap"], r["gap_std"]))
    if not any(len({x for x, _, _ in points}) > 1 for points in lines.values()):
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(lines.items()):
        points.sort()
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                    capsize=3, label=label)
    ax.axhline(0, color="black", linewidth=0.8)
    if axis == "depth":
        ax.set_xticks(sorted({p[0] for points in lines.values() for p in points}))
    ax.set(xlabel=axis if axis == "momentum" else "pipeline depth", ylabel="validation loss − sync",
           title=f"Gap to synchronous training vs {axis}" + (" (EF off)" if axis == "depth" else ""))
    ax.legend(fontsize=7)
    return _save(plt, fig, out / f"gap_vs_{axis}.png")


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(out_dir: Path, rows: list[dict], records: list[dict]) -> list[Path]:
    """Draw the study's figures into out_dir; returns the files written."""
    if not records:
        return []
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_loss_curves(plt, records, out_dir / "arms", out_dir), _gap_bars(plt, rows, out_dir),
               _gap_vs(plt, rows, out_dir, "momentum"), _gap_vs(plt, rows, out_dir, "depth")]
    return [p for p in written if p is not None]
