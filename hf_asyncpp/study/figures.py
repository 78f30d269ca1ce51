"""A study's figures (PNG, matplotlib Agg), drawn from the results rows and the arms' metrics.

- loss_curves.png: per optimizer, the training loss (seed mean, smoothed) of every mode, EF on/off;
- gap_bars.png: a panel per optimizer, the gap to sync of each delayed mode, without and with EF;
- gap_vs_momentum.png: the gap of the main delayed mode (2BW at its smallest depth) against momentum,
  one line per optimizer;
- gap_vs_depth.png: per optimizer, each asynchronous schedule's gap against pipeline depth at each
  momentum (EF off; sync-start modes left out).

Each mode has one colour in every figure (sync black); its EF arms share it, dashed or hatched. A
figure whose axis the grid does not vary is not drawn.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .grid import Arm

__all__ = ["depth_trends", "pyplot", "save_figure", "write_figures"]


def pyplot():
    """pyplot on the Agg backend (files only, no display), imported when a figure is drawn, not with the package."""
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


def _colours(modes) -> dict[str, str]:
    """One colour per mode, shared by the figures (sync black); a mode's EF arms take its colour, dashed
    or hatched. Up to 10 delayed modes take the default cycle's colours, more the 20-colour map's."""
    delayed = sorted(set(modes) - {"sync"})
    if len(delayed) <= 10:
        return {"sync": "black", **{mode: f"C{i}" for i, mode in enumerate(delayed)}}
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"]
    return {"sync": "black", **{mode: matplotlib.colors.to_hex(tab20(i % 20)) for i, mode in enumerate(delayed)}}


def _loss_curves(plt, records, arms_dir: Path, colours: dict[str, str], out: Path, suffix: str) -> Path:
    optimizers = sorted({r["arm"]["optimizer"] for r in records})
    fig, axes = plt.subplots(1, len(optimizers), figsize=(5 * len(optimizers), 4), squeeze=False)
    momentum0 = min(r["arm"]["momentum"] for r in records)
    for ax, optimizer in zip(axes[0], optimizers):
        curves: dict[tuple[str, float], list[dict[int, float]]] = defaultdict(list)
        for r in records:
            a = r["arm"]
            if a["optimizer"] == optimizer and a["momentum"] == momentum0:
                curves[(r["mode"], a["ef_lambda"])].append(_train_curve(arms_dir / Arm.from_record(r).name))
        for (mode, ef), runs in sorted(curves.items()):
            steps = sorted(set.intersection(*(set(c) for c in runs)))
            ax.plot(steps, _smooth([sum(c[s] for c in runs) / len(runs) for s in steps]), label=_label(mode, ef),
                    color=colours[mode], linestyle="--" if ef else "-", linewidth=1.2)
        ax.set(title=f"{optimizer} (momentum {momentum0:g})", xlabel="step", ylabel="training loss (smoothed)")
        ax.legend(fontsize=7)
    return save_figure(plt, fig, out / f"loss_curves{suffix}.png")


def _gap_bars(plt, rows, colours: dict[str, str], out: Path, suffix: str) -> Path | None:
    """A panel per optimizer (their gaps differ by an order of magnitude), a bar per delayed mode."""
    delayed = [r for r in rows if r["mode"] != "sync" and r["gap"] is not None]
    if not delayed:
        return None
    optimizers = sorted({r["optimizer"] for r in delayed})
    bars = sorted({(r["mode"], r["ef_lambda"]) for r in delayed})
    momentum0 = min(r["momentum"] for r in delayed)
    fig, axes = plt.subplots(1, len(optimizers), figsize=(max(5, 0.45 * len(bars)) * len(optimizers), 4.5),
                             squeeze=False)
    for ax, optimizer in zip(axes[0], optimizers):
        by_bar = {(r["mode"], r["ef_lambda"]): r for r in delayed
                  if r["optimizer"] == optimizer and r["momentum"] == momentum0}
        values = [by_bar.get(bar) for bar in bars]
        ax.bar(range(len(bars)), [v["gap"] if v else 0 for v in values], 0.8,
               yerr=[v["gap_std"] if v else 0 for v in values], capsize=3, color=[colours[m] for m, _ in bars],
               hatch=["//" if ef else "" for _, ef in bars], edgecolor="white")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(bars)), [_label(mode, ef) for mode, ef in bars], rotation=55, ha="right", fontsize=7)
        ax.set(title=optimizer, ylabel="validation loss − sync")
    fig.suptitle(f"Gap to synchronous training (momentum {momentum0:g}; ± the seed spread)")
    return save_figure(plt, fig, out / f"gap_bars{suffix}.png")


def _gap_vs_momentum(plt, rows, main: str | None, out: Path, suffix: str) -> Path | None:
    """The gap of the main delayed mode (Study.main_delayed_mode) against momentum, EF off."""
    delayed = [r for r in rows if r["mode"] == main and not r["ef_lambda"] and r["gap"] is not None]
    lines: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for r in delayed:
        lines[r["optimizer"]].append((r["momentum"], r["gap"], r["gap_std"]))
    if not any(len(points) > 1 for points in lines.values()):
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(lines.items()):
        points.sort()
        ax.errorbar(*zip(*[(x, y) for x, y, _ in points]), yerr=[e for _, _, e in points], marker="o", capsize=3,
                    label=label)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xlabel="momentum", ylabel="validation loss − sync", title=f"Gap to synchronous training vs momentum ({main})")
    ax.legend(fontsize=7)
    return save_figure(plt, fig, out / f"gap_vs_momentum{suffix}.png")


def depth_trends(rows) -> dict[str, dict[tuple[str, float], list[tuple[int, float, float]]]]:
    """Per optimizer, per (schedule, momentum): its (depth, gap, gap spread) points by depth, EF off;
    sync-start modes are left out (a mode of their own, not a point of the trend)."""
    trends: dict[str, dict[tuple[str, float], list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["mode"] == "sync" or r["ef_lambda"] or r["gap"] is None or "+sync" in r["mode"]:
            continue
        schedule, depth = r["mode"].split("@")
        trends[r["optimizer"]][(schedule, r["momentum"])].append((int(depth), r["gap"], r["gap_std"]))
    return {o: {line: sorted(points) for line, points in lines.items()} for o, lines in trends.items()}


def _gap_vs_depth(plt, rows, out: Path, suffix: str) -> Path | None:
    """One panel per optimizer (their gaps differ by an order of magnitude): a line per schedule and
    momentum, PipeDream dashed, the others solid."""
    trends = depth_trends(rows)
    if not any(len(points) > 1 for lines in trends.values() for points in lines.values()):
        return None
    momenta = sorted({m for lines in trends.values() for _, m in lines})
    fig, axes = plt.subplots(1, len(trends), figsize=(4.5 * len(trends), 4), squeeze=False)
    for ax, (optimizer, lines) in zip(axes[0], sorted(trends.items())):
        for (schedule, momentum), points in sorted(lines.items()):
            ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                        capsize=3, linestyle="--" if schedule == "pipedream" else "-",
                        color=f"C{momenta.index(momentum)}", label=f"{schedule}, momentum {momentum:g}")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(sorted({p[0] for points in lines.values() for p in points}))
        ax.set(title=optimizer, xlabel="pipeline depth", ylabel="validation loss − sync")
        ax.legend(fontsize=7)
    fig.suptitle("Gap to synchronous training vs pipeline depth (EF off)")
    return save_figure(plt, fig, out / f"gap_vs_depth{suffix}.png")


def save_figure(plt, fig, path: Path) -> Path:
    """Write `fig` as a PNG at the study figures' resolution and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(out_dir: Path, rows: list[dict], records: list[dict], main_mode: str | None,
                  suffix: str = "") -> list[Path]:
    """Draw the study's figures into out_dir (main_mode: the name of the study's main delayed mode),
    each file's stem followed by `suffix` (a second learning-rate protocol's: `_per_mode`); returns the
    files written."""
    if not records:
        return []
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = _colours(r["mode"] for r in records)
    written = [_loss_curves(plt, records, out_dir / "arms", colours, out_dir, suffix),
               _gap_bars(plt, rows, colours, out_dir, suffix), _gap_vs_momentum(plt, rows, main_mode, out_dir, suffix),
               _gap_vs_depth(plt, rows, out_dir, suffix)]
    return [p for p in written if p is not None]
