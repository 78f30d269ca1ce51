"""The study's summary: one line per (optimizer, momentum, EF λ), one column per delayed mode."""

from __future__ import annotations

from hf_asyncpp.study.grid import Arm
from hf_asyncpp.study.results import results_rows, summary_markdown


def _record(arm: Arm, loss: float) -> dict:
    return {"arm": arm.__dict__, "mode": arm.mode, "final_eval": {"eval_loss": loss}}


def _table(text: str, header_start: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    return [table[0], *table[2:]]


def test_the_summary_pivots_each_gap_and_ef_share_under_its_mode():
    losses = {  # (schedule, depth, ef, sync_steps): per seed
        ("sync", 1, 0.0, 0): (3.0, 3.2), ("pipedream-2bw", 2, 0.0, 0): (3.5, 3.6),
        ("pipedream-2bw", 2, 1.0, 0): (3.25, 3.35), ("pipedream", 4, 0.0, 0): (3.4, 3.8),
        ("pipedream-2bw", 2, 0.0, 100): (3.1, 3.3)}
    records = [_record(Arm("adamw", s, d, ef, 0.9, 1e-3, seed, n), loss)
               for (s, d, ef, n), per_seed in losses.items() for seed, loss in enumerate(per_seed)]
    summary = summary_markdown(results_rows(records))
    header, off, on = _table(summary, "| optimizer | momentum | EF λ | sync")
    # By schedule, then depth; sync start last.
    assert header[4:] == ["pipedream@4", "pipedream-2bw@2", "pipedream-2bw@2+sync100"]
    assert off[:4] == ["adamw", "0.9", "0", "3.100 ± 0.141 (2 seeds)"]
    # PipeDream: +0.4 and +0.6 → +0.5 ± 0.141; 2BW: +0.5 and +0.4 → +0.45 ± 0.071; sync start: +0.1 both.
    assert off[4:] == ["+0.500 ± 0.141 (2 seeds)", "+0.450 ± 0.071 (2 seeds)", "+0.100 ± 0.000 (2 seeds)"]
    assert on[2] == "1" and on[4:] == ["–", "+0.200 ± 0.071 (2 seeds)", "–"]  # EF ran on 2BW only
    header, share = _table(summary, "| optimizer | momentum | EF λ | pipedream")
    assert share == ["adamw", "0.9", "1", "–", "56%", "–"]  # (0.45 − 0.2) / 0.45


def test_a_summary_of_sync_arms_alone_is_a_well_formed_table():
    """Read part-way through a grid (only the tuning arms finished): one column per header cell."""
    records = [_record(Arm(opt, "sync", 1, 0.0, 0.9, 1e-3, 0, 0), 3.0) for opt in ("adamw", "muon")]
    lines = [line for line in summary_markdown(results_rows(records)).splitlines() if line.startswith("|")]
    assert lines[0] == "| optimizer | momentum | EF λ | sync val_loss |" and lines[1] == "|---|---|---|---|"
    assert all(line.count("|") == 5 for line in lines)
