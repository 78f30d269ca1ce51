"""A study's figures: a line per schedule and momentum against depth (sync start left out), and one
colour per mode shared by every figure — sync black, a mode's EF arms in its colour, dashed or hatched."""

from __future__ import annotations

import json

import pytest
from matplotlib.colors import to_hex

from hf_asyncpp.study import figures
from hf_asyncpp.study.figures import depth_trends, write_figures
from hf_asyncpp.study.grid import Arm
from hf_asyncpp.study.results import results_rows
from tests.study.test_results import _record


def _arms(tmp_path, modes, seeds=(0, 1), momenta=(0.9, 0.95)):
    """Records of finished arms (schedule, depth, sync steps, EF λ, final loss), each with a training curve."""
    records = []
    for seed in seeds:
        for momentum in momenta:
            for schedule, depth, sync_steps, ef, loss in modes:
                arm = Arm("adamw", schedule, depth, ef, momentum, 1.0e-3, seed, sync_steps)
                directory = tmp_path / "arms" / arm.name
                directory.mkdir(parents=True)
                (directory / "metrics.jsonl").write_text("".join(
                    json.dumps({"step": s, "loss": loss + 1 / s}) + "\n" for s in range(1, 6)))
                records.append(_record(arm, loss + seed / 10 + (momentum == 0.95) / 100))
    return records


def test_the_depth_figure_has_a_line_per_schedule_and_momentum_without_sync_start(tmp_path):
    records = _arms(tmp_path, [("sync", 1, 0, 0.0, 3.0), ("pipedream-2bw", 2, 0, 0.0, 3.5),
                               ("pipedream-2bw", 4, 0, 0.0, 3.6), ("pipedream", 2, 0, 0.0, 3.1),
                               ("pipedream-2bw", 2, 100, 0.0, 3.2)])
    rows = results_rows(records)
    trends = depth_trends(rows)
    assert set(trends) == {"adamw"}
    assert set(trends["adamw"]) == {(s, m) for s in ("pipedream-2bw", "pipedream") for m in (0.9, 0.95)}
    two_bw = trends["adamw"][("pipedream-2bw", 0.95)]
    assert [d for d, _, _ in two_bw] == [2, 4]  # sync start (2BW at depth 2 after 100 sync steps) is no point
    assert [g for _, g, _ in two_bw] == pytest.approx([0.5, 0.6])
    drawn = {p.name for p in write_figures(tmp_path, rows, records, "pipedream-2bw@2")}
    assert {"gap_vs_depth.png", "gap_vs_momentum.png"} <= drawn
    assert "gap_vs_momentum.png" not in {p.name for p in write_figures(tmp_path, rows, records, None)}


# cpu_scale's grid: sync and 7 delayed modes, EF on the three 2BW ones: 11 curves, one more than the
# default colour cycle holds.
GRID = [("sync", 1, 0, 0.0, 3.0), *[("pipedream-2bw", d, 0, ef, 3.5 - ef / 4) for d in (2, 4, 8) for ef in (0.0, 1.0)],
        ("pipedream-2bw", 2, 100, 0.0, 3.2), *[("pipedream", d, 0, 0.0, 3.1 + d / 100) for d in (2, 4, 8)]]


def test_every_mode_has_its_own_colour_in_the_curves_and_bars_and_its_ef_arms_share_it(tmp_path, monkeypatch):
    drawn = {}
    save = figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda plt, fig, path: drawn.setdefault(path.name, fig) and save(plt, fig, path))
    records = _arms(tmp_path, GRID, seeds=(0,), momenta=(0.9,))
    write_figures(tmp_path, results_rows(records), records, "pipedream-2bw@2")

    [curves] = drawn["loss_curves.png"].axes
    style = {line.get_label(): (to_hex(line.get_color()), line.get_linestyle()) for line in curves.get_lines()}
    assert len(style) == 11 and style["sync"] == ("#000000", "-")
    plain = {label: colour for label, (colour, dashes) in style.items() if "EF" not in label}
    assert len(set(plain.values())) == len(plain) == 8  # sync and 7 delayed modes, no colour twice
    for label, (colour, dashes) in style.items():
        if "EF" in label:
            assert (colour, dashes) == (plain[label.split(" + EF")[0]], "--"), label

    [bars] = drawn["gap_bars.png"].axes
    names = [tick.get_text() for tick in bars.get_xticklabels()]
    assert len(names) == 10  # the delayed arms
    for name, patch in zip(names, bars.patches):
        assert to_hex(patch.get_facecolor()) == style[name][0]
        assert (patch.get_hatch() == "//") == ("EF" in name), name


def test_more_modes_than_the_colour_cycle_holds_still_get_colours_of_their_own():
    modes = ["sync", *(f"pipedream@{d}" for d in range(2, 18))]
    colours = figures._colours(modes)
    assert colours["sync"] == "black" and len(set(colours.values())) == len(modes)
