"""The reference study's claims against a grid's arms (claims.md): each claim reads the per-seed
differences it names and is judged by its rule (tests/study/test_inference.py pins the rules), and the
verdicts say which rule, and when a claim holds by construction or is confounded."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hf_asyncpp.study import load_study
from hf_asyncpp.study.claims import CLAIMS, COMPARISONS
from hf_asyncpp.study.inference import PAIRED, POOLED, TOST
from hf_asyncpp.study.claims_report import claims_markdown, headline_markdown, verdicts_markdown
from hf_asyncpp.study.reference import MATCH_TOLERANCE, RUNS_360M
from hf_asyncpp.study.grid import Arm
from hf_asyncpp.study.results import final_losses, results_rows
from tests.ranks import run_ranks
from tests.study.test_grid import BASE
from tests.study.test_results import _record, _table


def test_matching_sync_is_judged_by_equivalence_within_the_reference_s_own_largest_gap_with_ef():
    """By a margin of 0 nothing could match; the reference's own results (+0.028 with EF at most) lie within
    its margin, and three seeds must show their interval inside it (inference.equivalence_verdict)."""
    from hf_asyncpp.study.inference import equivalence_verdict

    assert MATCH_TOLERANCE.cited == "+0.028 [S1]"
    own = [runs.gap("ef").value for runs in RUNS_360M.values()]  # AdamW +0.028, Muon +0.005, SOAP +0.009
    assert [equivalence_verdict([gap], MATCH_TOLERANCE.value) for gap in own] == ["agrees (1 seed)"] * 3
    claim = next(c for c in CLAIMS if c.statement == "with Error Feedback the delayed run matches the synchronous one")
    assert (claim.rule, claim.tolerance) == (TOST, MATCH_TOLERANCE)


def _study(tmp_path):
    raw = dict(name="t", base_config=str(BASE), base={"max_steps": 300},
               optimizers={"adamw": [1.0e-3], "muon": [2.0e-2]},
               modes=["sync", "pipedream-2bw@2", "pipedream-2bw@4", "pipedream@2", "pipedream@4",
                      "pipedream-2bw@2+sync50"],
               ef=[0, 1.0], momentum=[0.9, 0.95], seeds=[0, 1, 2], output_dir=str(tmp_path / "out"))
    (tmp_path / "study.yaml").write_text(json.dumps(raw))
    return load_study(tmp_path / "study.yaml")


# Gaps to sync by (optimizer, mode, EF λ), the same at both momentum values, seed noise ±0.01 around
# them: AdamW's delay costs 0.5, Muon's 0.05; EF halves AdamW's gap and more than halves Muon's; PipeDream's
# gap doubles from depth 2 to 4, 2BW's does not move; sync start costs 0.02.
GAPS = {("adamw", "pipedream-2bw@2", 0.0): 0.5, ("adamw", "pipedream-2bw@2", 1.0): 0.2,
        ("adamw", "pipedream-2bw@4", 0.0): 0.5, ("adamw", "pipedream@2", 0.0): 0.4, ("adamw", "pipedream@4", 0.0): 0.8,
        ("muon", "pipedream-2bw@2", 0.0): 0.05, ("muon", "pipedream-2bw@2", 1.0): 0.0,
        ("muon", "pipedream-2bw@4", 0.0): 0.05, ("muon", "pipedream@2", 0.0): 0.04, ("muon", "pipedream@4", 0.0): 0.08,
        ("adamw", "pipedream-2bw@2+sync50", 0.0): 0.02}
NOISE = (0.01, -0.01, 0.0)


def _records():
    records = []
    for optimizer in ("adamw", "muon"):
        for momentum in (0.9, 0.95):
            for seed, noise in enumerate(NOISE):
                sync = 3.0 + seed / 10
                records.append(_record(Arm(optimizer, "sync", 1, 0.0, momentum, 1e-3, seed), sync))
                for (o, mode, ef), gap in GAPS.items():
                    if o != optimizer:
                        continue
                    schedule, rest = mode.split("@")
                    depth, _, sync_steps = rest.partition("+sync")
                    arm = Arm(optimizer, schedule, int(depth), ef, momentum, 1e-3, seed, int(sync_steps or 0))
                    records.append(_record(arm, sync + gap + noise * (1 + seed)))
    return records


def test_each_claim_tallies_the_verdicts_of_its_effects(tmp_path):
    text = claims_markdown(_study(tmp_path), final_losses(_records()))
    header, *rows = _table(text, "| claim |")
    verdicts = {row[0]: row[-1] for row in rows}
    assert [row[0] for row in rows] == [claim.statement for claim in CLAIMS]
    assert verdicts["a one-step delay costs AdamW far more than Muon and SOAP"] == f"{PAIRED}: reproduced: 2"  # 2 momenta
    # AdamW keeps +0.2 with EF (not reproduced); Muon's −0.003 ± 0.015 reaches below −0.028 (not shown).
    assert verdicts["with Error Feedback the delayed run matches the synchronous one"] == \
        f"{TOST}; margin ±0.028 [S1]: not reproduced: 2; not shown: 2"
    # Shares: AdamW 1 − 0.197 / 0.497 = 60% at both momenta, Muon 1 − (−0.003) / 0.047 = 107%: pooled 84%, but
    # four lines at two values leave an interval (41% to 127%) that reaches below half.
    assert verdicts["Error Feedback removes at least half of the gap"] == \
        f"{POOLED}: share 84%, 95% CI 41% to 127% (4 lines), claimed ≥ 50%: not beyond noise"
    assert f"- {PAIRED} (a claim of an effect): reproduced when the effect's mean" in text
    assert f"- {TOST} (a claim that two things match" in text and f"- {POOLED} (a claim that EF" in text
    # The same gap at both momentum values: no effect.
    assert verdicts["a higher momentum tolerates the delay better"] == f"{PAIRED}: not beyond noise: 2"
    # The grid runs the emulator (launch: emulator): 2BW's depths are one update rule.
    assert verdicts["PipeDream-2BW's gap does not grow with the pipeline's depth"] == \
        "true by construction in the emulator: 4"
    assert verdicts["PipeDream's gap grows with the pipeline's depth"] == f"{PAIRED}: reproduced: 4"
    assert verdicts["at equal depth PipeDream's gap exceeds PipeDream-2BW's"] == f"{PAIRED}; confounded: reproduced: 4"


def _verdicts(table: str) -> dict[str, str]:
    return {row[0]: row[-1] for row in _table(table, "| claim |")[1:]}


def test_2bw_not_growing_with_depth_is_true_by_construction_in_the_emulator_and_judged_on_real_pipelines(tmp_path):
    """The emulator gives every stage of 2BW, at every depth, a delay of one update: two depths are one rule."""
    from hf_asyncpp.schedules.pipedream import PIPEDREAM_2BW

    assert {PIPEDREAM_2BW.delay(stage, depth, 8) for depth in (2, 4, 8, 16) for stage in range(depth)} == {1}
    claim, study, losses = "PipeDream-2BW's gap does not grow with the pipeline's depth", _study(tmp_path), \
        final_losses(_records())
    emulated = verdicts_markdown(study, losses)
    assert _verdicts(emulated)[claim] == "true by construction in the emulator: 4"
    assert "the same update rule and differ only in floating-point order" in emulated
    rows = [line for line in claims_markdown(study, losses).splitlines()
            if "pipedream-2bw@4 − pipedream-2bw@2 |" in line]
    assert [row.split("|")[-2].strip() for row in rows] == ["true by construction in the emulator"] * 4
    on_pipelines = dataclasses.replace(study, launch="pipeline")
    # Both depths' gaps are one number per seed: the difference is 0, within the margin however few seeds.
    assert _verdicts(verdicts_markdown(on_pipelines, losses))[claim] == f"{TOST}; margin ±0.028 [S1]: reproduced: 4"
    assert "true by construction" not in claims_markdown(on_pipelines, losses)


@pytest.mark.multirank
def test_emulated_2bw_at_two_depths_is_one_run_up_to_floating_point_order():
    """What "true by construction in the emulator" rests on: with the study's global clipping and a warm-up,
    2BW emulated at depth 2 and at depth 4 end with the same losses and weights."""
    import torch

    from tests.executors.test_asynchronous import TOL, _final_state

    (state_2, losses_2), (state_4, losses_4) = (run_ranks(1, _final_state, 1, "pipedream-2bw", depth, "global")[0]
                                                for depth in (2, 4))
    assert losses_2 == pytest.approx(losses_4, abs=TOL)
    assert max((torch.tensor(state_2[n]) - torch.tensor(state_4[n])).abs().max().item() for n in state_2) < TOL


def test_pipedream_against_2bw_is_labelled_confounded_by_its_updates_per_microbatch(tmp_path):
    """PipeDream updates after every microbatch at the learning rate tuned for whole steps; its own depth
    comparison (the same updates at every depth) is not confounded by that."""
    from hf_asyncpp.schedules.pipedream import PIPEDREAM, PIPEDREAM_2BW

    assert PIPEDREAM.per_microbatch_updates and not PIPEDREAM_2BW.per_microbatch_updates
    table = verdicts_markdown(_study(tmp_path), final_losses(_records()))
    assert _verdicts(table)["at equal depth PipeDream's gap exceeds PipeDream-2BW's"] == \
        f"{PAIRED}; confounded: reproduced: 4"
    assert _verdicts(table)["PipeDream's gap grows with the pipeline's depth"] == f"{PAIRED}: reproduced: 4"
    assert "m = n_microbatches times as many updates as 2BW, each on an m-times smaller batch, at the learning " \
           "rate tuned for whole steps" in table


def test_every_number_in_the_published_columns_carries_its_recorded_grade(tmp_path):
    """A value stripped of its grade, or given another grade than its record's, is left over as a digit."""
    import re

    from hf_asyncpp.study.reference import published_records

    study, records = _study(tmp_path), _records()
    cells = [row[1] for row in _table(verdicts_markdown(study, final_losses(records)), "| claim |")[1:]]
    cells += [row[1] for row in _table(headline_markdown(study, results_rows(records)), "| optimizer |")[1:]]
    cited = sorted({r.cited for r in published_records()}, key=len, reverse=True)
    for cell in cells:
        rest = cell
        for citation in cited:
            rest = rest.replace(citation, "")
        rest = re.sub(r"(Table|Figure|Section) \d|360M|10B|2BW", "", rest)
        assert not re.search(r"\d", rest), f"{cell!r} prints a number without its grade: {rest!r}"


def test_muons_reported_share_stands_beside_the_share_its_own_losses_give(tmp_path):
    table = verdicts_markdown(_study(tmp_path), final_losses(_records()))
    published = {row[0]: row[1] for row in _table(table, "| claim |")[1:]}[
        "Error Feedback removes at least half of the gap"]
    assert published.startswith("AdamW 90% [S1], Muon 71% [V2] (its losses give 58% [S1]†), SOAP 67% [S1] (Table 2)")
    [note] = [line for line in table.splitlines() if line.startswith("- †")]
    assert "Muon's reported 71% [V2]" in note and "they give 58% [S1]" in note


def test_the_verdicts_table_spans_each_claims_effects_with_their_seeds_and_opens_claims_md(tmp_path):
    """docs/studies.md quotes verdicts.md: per claim, the smallest and largest effect mean and their seed counts."""
    study = _study(tmp_path)
    records = [r for r in _records() if not (r["arm"]["schedule"] == "pipedream" and r["arm"]["seed"] > 0)]
    table = verdicts_markdown(study, final_losses(records))
    assert table in claims_markdown(study, final_losses(records))
    effects = {row[0]: row[2] for row in _table(table, "| claim |")[1:]}
    # AdamW − Muon: +0.450 at both momenta (the noise is the same on both sides of each seed's pair).
    assert effects["a one-step delay costs AdamW far more than Muon and SOAP"] == \
        "AdamW's gap − the other's: +0.450 (3 seeds)"
    # AdamW's EF gap 0.2 + noise, Muon's 0.0 + noise: the means over seeds are +0.197 and −0.003.
    assert effects["with Error Feedback the delayed run matches the synchronous one"] == \
        "the gap with EF: -0.003 to +0.197 (3 seeds)"
    # PipeDream has seed 0 only: its growth (Muon +0.04 + 0.00 noise … AdamW +0.4) on one seed.
    assert effects["PipeDream's gap grows with the pipeline's depth"] == \
        "the gap at the largest depth − at the smallest: +0.040 to +0.400 (1 seed)"
    # PipeDream against 2BW at depth 4: one seed on PipeDream's side, so the pairs have one.
    assert effects["at equal depth PipeDream's gap exceeds PipeDream-2BW's"].endswith("(1 seed)")
    sync_only = dataclasses.replace(study, modes=[("sync", 1, 0)])
    assert {row[2] for row in _table(verdicts_markdown(sync_only, {}), "| claim |")[1:]} == {"–"}


def test_an_effect_row_shows_the_seed_means_and_the_paired_effect(tmp_path):
    text = claims_markdown(_study(tmp_path), final_losses(_records()))
    rows = _table(text, "| compared |")  # the first claim's effects
    # AdamW's gaps per seed: 0.51, 0.48, 0.50 (noise × (1 + seed)); Muon's: 0.06, 0.03, 0.05.
    assert rows[1] == ["adamw − muon, momentum 0.9", "adamw +0.497, muon +0.047", "+0.450 ± 0.000 (3 seeds)", "reproduced"]


def test_the_means_beside_an_effect_are_over_the_seeds_it_pairs(tmp_path):
    """Depth 4 has seed 0 only: the depth-2 mean beside the effect is seed 0's too, not all three seeds'
    (which would show a growth of +0.013 where the paired effect is zero). On real pipelines, where the
    effect gets a verdict."""
    records = [r for r in _records() if not (r["arm"]["depth"] == 4 and r["arm"]["seed"] > 0)]
    text = claims_markdown(dataclasses.replace(_study(tmp_path), launch="pipeline"), final_losses(records))
    rows = [row for line in text.splitlines() if line.startswith("| adamw, momentum 0.9, pipedream-2bw@4")
            for row in [[cell.strip() for cell in line.strip("|").split("|")]]]
    assert rows == [["adamw, momentum 0.9, pipedream-2bw@4 − pipedream-2bw@2", "+0.510 → +0.510", "+0.000 (1 seed)",
                     "agrees (1 seed)"]]


def test_claims_without_their_arms_say_so_and_a_grid_without_their_modes_has_none(tmp_path):
    study = _study(tmp_path)
    records = [r for r in _records() if r["arm"]["optimizer"] == "adamw" and r["arm"]["seed"] == 0]
    verdicts = {row[0]: row[-1] for row in _table(claims_markdown(study, final_losses(records)), "| claim |")[1:]}
    assert verdicts["a one-step delay costs AdamW far more than Muon and SOAP"] == "not measured yet: 2"
    assert verdicts["PipeDream's gap grows with the pipeline's depth"] == \
        f"{PAIRED}: agrees (1 seed): 2; not measured yet: 2"
    sync_only = dataclasses.replace(study, modes=[("sync", 1, 0)])
    verdicts = {row[0]: row[-1] for row in _table(claims_markdown(sync_only, {}), "| claim |")[1:]}
    assert set(verdicts.values()) == {"not in this grid"}


def test_a_sync_start_is_compared_with_delays_from_the_first_step_and_with_ef_apart_from_the_claims(tmp_path):
    """No result is published for a sync start: claims.md compares it under its own heading, by the same
    rule, and the verdicts table docs/studies.md quotes leaves it out."""
    study = _study(tmp_path)
    text = claims_markdown(study, final_losses(_records()))
    claims, comparisons = text.split("## Sync start: no published result")
    assert "sync start" not in verdicts_markdown(study, final_losses(_records()))
    header, *rows = _table(comparisons, "| comparison |")
    verdicts = {row[0]: row[-1] for row in rows}
    assert [row[0] for row in rows] == [comparison.statement for comparison in COMPARISONS]
    # AdamW: delayed from the first step +0.5, after the sync start +0.02, with EF +0.2; Muon has no sync-start arms.
    assert verdicts["a synchronous start leaves a smaller gap than delays from the first step"] == \
        f"{PAIRED}: holds: 2; not measured yet: 2"
    assert verdicts["Error Feedback leaves a smaller gap than a synchronous start"] == f"{PAIRED}: opposite: 2; not measured yet: 2"
    effect = _table(comparisons, "| compared |")[1]
    # The noise is the same on both sides of each seed's pair: 0.497 − 0.017 = +0.480 exactly.
    assert effect == ["adamw, momentum 0.9, pipedream-2bw@2 − pipedream-2bw@2+sync50",
                      "pipedream-2bw@2 +0.497, pipedream-2bw@2+sync50 +0.017", "+0.480 ± 0.000 (3 seeds)", "holds"]
    one_seed = [r for r in _records() if r["arm"]["seed"] == 0]
    assert "| adamw, momentum 0.9, pipedream-2bw@2+sync50 − pipedream-2bw@2 with EF | " \
           "pipedream-2bw@2+sync50 +0.030, pipedream-2bw@2 with EF +0.210 | -0.180 (1 seed) | does not hold (1 seed) |" \
        in claims_markdown(study, final_losses(one_seed))
    no_sync_start = dataclasses.replace(study, modes=[m for m in study.modes if not m[2]])
    assert "Sync start" not in claims_markdown(no_sync_start, final_losses(_records()))
