"""claims.md, verdicts.md and headline.md: the claims judged in claims.py, written out as the tables
README Results (headline) and docs/studies.md (verdicts) quote, and the effects under them."""

from __future__ import annotations

import statistics

from .claims import CLAIMS, COMPARISONS, Claim, Effect, Grid, Judged, std
from .inference import PAIRED, POOLED, TOST
from .grid import Study
from .reference import NAMES, RUNS_360M, grade_legend, share_notes
from .results import markdown_head, markdown_row, seeds_label, seeds_note, spread

__all__ = ["claims_markdown", "headline_by_protocol", "headline_markdown", "verdicts_by_protocol", "verdicts_markdown"]


def _effect_range(claim: Claim, effects: list[Effect]) -> str:
    """The claim's effect as its effects' means span, with their seed counts: the table's one number."""
    measured = [e.values for e in effects if e.values]
    if not measured:
        return "–"
    means = sorted(statistics.fmean(values) for values in measured)
    seeds = sorted({len(values) for values in measured})
    low, high = f"{means[0]:+.3f}", f"{means[-1]:+.3f}"
    span = low if low == high else f"{low} to {high}"
    count = seeds_label(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]} seeds"
    return f"{claim.effect}: {span} ({count})"


def _verdict_rows(judged: dict[str | None, list[Judged]]) -> list[str]:
    """The verdicts table: a line per claim (or per comparison, without the published column); under
    several protocols (the keys of `judged`, None for a study's one) a line per claim and protocol, the
    claim and what is published printed on its first."""
    protocols = list(judged)
    first = judged[protocols[0]]
    published = not any(j.claim.unpublished for j in first)
    lines = markdown_head(["claim" if published else "comparison",
                           *(["published, with its grade (360M dense, PipeDream-2BW, unless said)"]
                             if published else []),
                           *(["protocol"] if protocols != [None] else []), "effect here", "verdicts here"])
    for i, claim in enumerate(j.claim for j in first):
        for protocol in protocols:
            lead = [claim.statement, *([claim.published] if published else [])] if protocol == protocols[0] else \
                [""] * (1 + published)
            j = judged[protocol][i]
            lines.append(markdown_row([*lead, *([f"`{protocol}`"] if protocol else []),
                                       _effect_range(claim, j.effects), j.verdicts()]))
    return lines


def _notes(judged: list[Judged], protocols: dict[str, str] | None = None) -> list[str]:
    """What the verdicts table's cells rest on: the protocols it reads (name → meaning), the grades, the
    contradicted shares, the tolerance, the caveats."""
    notes = [*(f"Protocol `{name}`: {meaning}" for name, meaning in (protocols or {}).items()), grade_legend(),
             *share_notes()]
    rules = {j.claim.rule for j in judged if j.effects}
    if PAIRED in rules:
        notes.append(f"{PAIRED} (a claim of an effect): reproduced when the effect's mean over seeds exceeds 0 by "
                     "more than the 95% t bound (t(n − 1) · sd / √n over n seeds), opposite when it lies that far "
                     "below 0, else not beyond noise; from one seed only its sign is read (agrees / disagrees).")
    if TOST in rules:
        notes.append(f"{TOST} (a claim that two things match, within the margin ±m): reproduced when the mean's "
                     "one-sided 95% bounds (mean ± t₀.₉₅(n − 1) · sd / √n) both lie inside (−m, m); not reproduced "
                     "when the mean is beyond ±m by more than the two-sided 95% bound; else not shown: the seeds "
                     "tell neither.")
    if POOLED in rules:
        notes.append(f"{POOLED} (a claim that EF removes a share of the gap): each line (optimizer, momentum) gives "
                     "1 − its mean gap with EF / its mean gap without, the line is a random effect, and the pooled "
                     "share is the lines' mean with its 95% t interval over lines; reproduced when the interval lies "
                     "above the claimed share, opposite when below, else not beyond noise.")
    for j in judged:
        if j.claim.tolerance and j.effects:
            notes.append(f"\"{j.claim.statement}\" is judged with a margin of {j.claim.tolerance.cited}, "
                         f"{j.claim.tolerance.what} (a margin of 0 could never be shown).")
        if j.caveat and j.effects:
            notes.append(f"\"{j.claim.statement}\": {j.caveat.label}: {j.caveat.reason}.")
    return ["", *(f"- {note}" for note in notes)]


def _effect_tables(judged: list[Judged]) -> list[str]:
    """Each claim's effects, a table of them under its statement."""
    lines = []
    for j in judged:
        if not j.effects:
            continue
        lines += ["", f"**{j.claim.statement}**: effect = {j.claim.effect}, {j.prediction()}", ""]
        if j.caveat:
            lines += [f"{j.caveat.label.capitalize()}: {j.caveat.reason}.", ""]
        lines += markdown_head(["compared", "measured (means over the effect's seeds)", "effect", "verdict"])
        for e in j.effects:
            effect = spread(statistics.fmean(e.values), std(e.values), len(e.values)) if e.values else "–"
            lines.append(markdown_row([e.subject, e.measured, effect, j.verdict(e.values)]))
    return lines


def verdicts_markdown(study: Study, losses: dict[tuple, dict[int, float]]) -> str:
    """verdicts.md, the table docs/studies.md quotes: a line per claim (what is published with its grade, the
    span of its effects here, the verdicts' tally with the tolerance or caveat they are read under), and the
    notes those rest on; claims.md opens with it."""
    judged = [Judged(claim, Grid(study, losses)) for claim in CLAIMS]
    return "\n".join([*_verdict_rows({None: judged}), *_notes(judged)]) + "\n"


def verdicts_by_protocol(study: Study, losses: dict[str, dict[tuple, dict[int, float]]],
                         meanings: dict[str, str]) -> str:
    """verdicts.md of a study run under several learning-rate protocols: one table, each claim's line per
    protocol (`losses`: its finished arms' per protocol), and under it what each protocol means
    (`meanings`) beside the notes."""
    judged = {protocol: [Judged(claim, Grid(study, by_arm)) for claim in CLAIMS] for protocol, by_arm in losses.items()}
    every = [j for js in judged.values() for j in js]
    return "\n".join([*_verdict_rows(judged), *_notes(_with_effects(every), meanings)]) + "\n"


def _with_effects(judged: list[Judged]) -> list[Judged]:
    """One Judged per claim, the first with effects where any has: the notes a claim needs, once."""
    by_claim: dict[str, Judged] = {}
    for j in judged:
        if j.claim.statement not in by_claim or (j.effects and not by_claim[j.claim.statement].effects):
            by_claim[j.claim.statement] = j
    return list(by_claim.values())


def claims_markdown(study: Study, losses: dict[tuple, dict[int, float]]) -> str:
    """claims.md: the verdicts table (verdicts_markdown), then each claim's effects; then, when the grid
    runs a sync start, the comparisons no result is published for, the same way."""
    grid = Grid(study, losses)
    judged = [Judged(claim, grid) for claim in CLAIMS]
    lines = ["The reference study's claims against this grid's finished arms (rule: hf_asyncpp/study/claims.py).",
             "An effect is a per-seed difference of final validation losses; each claim's verdict names its",
             "rule (hf_asyncpp/study/inference.py): a paired t-test, an equivalence test (TOST) or a share",
             "pooled over lines.", "",
             *_verdict_rows({None: judged}), *_notes(judged), *_effect_tables(judged)]
    compared = [j for j in (Judged(comparison, grid) for comparison in COMPARISONS) if j.effects]
    if compared:
        lines += ["", "## Sync start: no published result", "",
                  "The reference study lists a synchronous start among the baselines it compares and reports no",
                  "result for it. The same rule, its \"reproduced\" read as \"holds\" (\"agrees\" as \"holds\"",
                  "on one seed):", "", *_verdict_rows({None: compared}), *_effect_tables(compared)]
    return "\n".join(lines) + "\n"


def _headline_cell(values: list[tuple[dict | None, str, bool]]) -> str:
    """Seed means ± their spread, each from a results row (row, column, signed), with the seed count
    printed once when all have the same; "–" when any is not measured yet."""
    if any(row is None or row[column] is None for row, column, _ in values):
        return "–"
    counts = {row["seeds"] for row, _, _ in values}
    shown = [spread(row[column], row[column + "_std"], row["seeds"], signed, count=len(counts) > 1)
             for row, column, signed in values]
    return ", ".join(shown) + (f" ({seeds_label(counts.pop())})" if len(counts) == 1 else "")


def headline_markdown(study: Study, rows: list[dict]) -> str:
    """headline.md, the table README Results quotes: per optimizer, the published sync loss, gap and gap
    with EF (each with its grade) beside this grid's at each momentum, for PipeDream-2BW at the grid's
    smallest depth; under it, what the grades mean."""
    return "\n".join([*_headline_rows(study, {None: rows}), "", f"- {seeds_note(study)}", f"- {grade_legend()}"]) + "\n"


def headline_by_protocol(study: Study, rows: dict[str, list[dict]], meanings: dict[str, str]) -> str:
    """headline.md of a study run under several learning-rate protocols: one table, each optimizer's line
    per protocol (`rows`: its results rows per protocol), and under it what each protocol means."""
    notes = [*(f"- Protocol `{name}`: {meaning}" for name, meaning in meanings.items()), f"- {seeds_note(study)}",
             f"- {grade_legend()}"]
    return "\n".join([*_headline_rows(study, rows), "", *notes]) + "\n"


def _headline_rows(study: Study, rows: dict[str | None, list[dict]]) -> list[str]:
    """The headline table; a line per optimizer, or per optimizer and protocol (the keys of `rows`, None
    for a study's one), the published numbers on its first."""
    grid = Grid(study, {})
    mode, ef_mode = grid.main, grid.ef_main
    protocols = list(rows)
    by_key = {protocol: {(r["optimizer"], r["momentum"], r["ef_lambda"], r["mode"]): r for r in protocol_rows}
              for protocol, protocol_rows in rows.items()}
    lines = markdown_head(["optimizer", "published, 360M dense (Tables 1–2): sync, gap, gap with EF",
                           *(["protocol"] if protocols != [None] else []),
                           *(f"here, momentum {m:g}" for m in study.momentums)])
    for o in study.learning_rates:
        published = "–"
        if o in RUNS_360M:
            runs = RUNS_360M[o]
            published = ", ".join(r.cited for r in (runs.sync, runs.gap(), runs.gap("ef")))
        for protocol in protocols:
            found = by_key[protocol]
            cells = []
            for m in study.momentums:
                values = [(found.get((o, m, 0.0, "sync")), "val_loss", False), (found.get((o, m, 0.0, mode)), "gap", True)]
                if ef_mode is not None:
                    values.append((found.get((o, m, grid.ef, ef_mode)), "gap", True))
                cells.append(_headline_cell(values))
            lead = [NAMES.get(o, o), published] if protocol == protocols[0] else ["", ""]
            lines.append(markdown_row([*lead, *([f"`{protocol}`"] if protocol else []), *cells]))
    return lines
