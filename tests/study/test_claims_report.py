"""The two tables README Results and docs/studies.md quote: the headline (each optimizer's published numbers, with their
grades, beside the grid's seed means) and, under several learning-rate protocols, both tables with a line
per protocol (the claims' own tables are specified with their rule in test_claims.py)."""

from __future__ import annotations

from hf_asyncpp.study.claims_report import headline_by_protocol, headline_markdown, verdicts_by_protocol, verdicts_markdown
from hf_asyncpp.study.results import final_losses, results_rows
from tests.study.test_claims import _records, _study
from tests.study.test_results import _table


def test_the_headline_puts_each_optimizers_published_numbers_beside_its_seed_means(tmp_path):
    study = _study(tmp_path)
    header, adamw, muon = _table(headline_markdown(study, results_rows(_records())), "| optimizer |")
    assert header[2:] == ["here, momentum 0.9", "here, momentum 0.95"]
    # sync 3.0, 3.1, 3.2; AdamW's 2BW@2 gaps 0.51, 0.48, 0.50 (sd 0.015), with EF 0.21, 0.18, 0.20.
    # The published numbers, each with its grade: AdamW's all from one source, Muon's Table 1 from two.
    assert adamw == ["AdamW", "2.612 [S1], +0.278 [S1], +0.028 [S1]",
                     "3.100 ± 0.100, +0.497 ± 0.015, +0.197 ± 0.015 (3 seeds)",
                     "3.100 ± 0.100, +0.497 ± 0.015, +0.197 ± 0.015 (3 seeds)"]
    assert muon[:3] == ["Muon", "2.578 [V2], +0.012 [V2], +0.005 [S1]",
                        "3.100 ± 0.100, +0.047 ± 0.015, -0.003 ± 0.015 (3 seeds)"]


def test_a_headline_cell_counts_seeds_per_value_when_they_differ_and_waits_for_missing_arms(tmp_path):
    def kept(r):  # AdamW's EF arm of seed 2 not finished; Muon's EF arms at momentum 0.95 none
        a = r["arm"]
        if a["ef_lambda"] and a["optimizer"] == "adamw" and a["seed"] == 2:
            return False
        return not (a["ef_lambda"] and a["optimizer"] == "muon" and a["momentum"] == 0.95)
    rows = results_rows([r for r in _records() if kept(r)])
    _, adamw, muon = _table(headline_markdown(_study(tmp_path), rows), "| optimizer |")
    assert adamw[2] == "3.100 ± 0.100 (3 seeds), +0.497 ± 0.015 (3 seeds), +0.195 ± 0.021 (2 seeds)"
    assert muon[3] == "–"
    one_seed = results_rows([r for r in _records() if r["arm"]["seed"] == 0])
    assert _table(headline_markdown(_study(tmp_path), one_seed), "| optimizer |")[1][2] == "3.000, +0.510, +0.210 (1 seed)"


MEANINGS = {"sync": "the sync pick everywhere.", "per_mode": "each mode its own pick."}


def _per_mode_records():
    """The same arms with AdamW's delayed gaps 0.3 smaller (its delayed arms at a smaller rate, say)."""
    records = []
    for record in _records():
        delayed = record["arm"]["optimizer"] == "adamw" and record["arm"]["schedule"] != "sync"
        lower = {"final_eval": {"eval_loss": record["final_eval"]["eval_loss"] - 0.3}}
        records.append({**record, **lower} if delayed else record)
    return records


def test_under_two_protocols_each_claim_has_a_line_per_protocol_with_that_protocols_verdicts(tmp_path):
    study = _study(tmp_path)
    by_protocol = {"sync": final_losses(_records()), "per_mode": final_losses(_per_mode_records())}
    assert by_protocol["sync"] != by_protocol["per_mode"]
    text = verdicts_by_protocol(study, by_protocol, MEANINGS)
    table = _table(text, "| claim |")
    assert table[0] == ["claim", "published, with its grade (360M dense, PipeDream-2BW, unless said)", "protocol",
                        "effect here", "verdicts here"]
    alone = {p: {row[0]: row for row in _table(verdicts_markdown(study, losses), "| claim |")[1:]}
             for p, losses in by_protocol.items()}
    for sync_row, per_mode_row in zip(table[1::2], table[2::2]):
        claim = sync_row[0]
        assert sync_row[1:3] == [alone["sync"][claim][1], "`sync`"]
        assert per_mode_row[:3] == ["", "", "`per_mode`"]  # the claim and its published numbers once
        assert sync_row[3:] == alone["sync"][claim][2:] and per_mode_row[3:] == alone["per_mode"][claim][2:]
    assert len(table) == 1 + 2 * len(alone["sync"])
    assert "- Protocol `sync`: the sync pick everywhere." in text and "- Protocol `per_mode`: each mode its own pick." in text


def test_under_two_protocols_the_headline_has_a_line_per_optimizer_and_protocol(tmp_path):
    study = _study(tmp_path)
    rows = {"sync": results_rows(_records(), "sync"), "per_mode": results_rows(_per_mode_records(), "per_mode")}
    header, *lines = _table(headline_by_protocol(study, rows, MEANINGS), "| optimizer |")
    assert header[2] == "protocol"
    (_, adamw, muon) = _table(headline_markdown(study, rows["sync"]), "| optimizer |")
    assert lines[0] == [*adamw[:2], "`sync`", *adamw[2:]]
    # sync 3.0–3.2 unchanged; AdamW's gaps 0.497 and 0.197 become 0.197 and -0.103
    assert lines[1] == ["", "", "`per_mode`", *["3.100 ± 0.100, +0.197 ± 0.015, -0.103 ± 0.015 (3 seeds)"] * 2]
    assert lines[2] == [*muon[:2], "`sync`", *muon[2:]] and lines[3][:3] == ["", "", "`per_mode`"]
