"""The reference study's claims held against a study's finished arms: the rule and the claims
(claims_report.py writes them out as claims.md, verdicts.md and headline.md).

Each claim states what the reference study (Zmushko et al., ICML 2026) reports — numbers at 360M, dense,
PipeDream-2BW, from its Tables 1 and 2, each printed with its source grade (reference.py records them and
docs/studies.md lists them: a reconstruction from secondary sources) — and, for every optimizer and
momentum value the grid runs, one *effect*: a difference of final validation losses computed per seed
(paired by seed: the same data order and initial weights), whose sign the claim predicts. "The gap" is
an arm's loss minus the sync arm's of the same optimizer, momentum and seed; the delayed mode the claims
about optimizers and EF use is PipeDream-2BW at the grid's smallest depth.

Each claim names the rule its verdict follows (inference.py): a claim of an effect (a gap that grows,
one optimizer's gap above another's) the paired t-test against 0; a claim that two things match (a delayed
run with EF and sync; 2BW's gap at two depths) an equivalence test, TOST at 95%, within the reference's own
largest gap with EF at 360M, +0.028 [S1]; a claim that EF removes a share of the gap the lines' shares
pooled, the line a random effect, with their 95% interval. One seed has no spread: the verdict then says
only whether the mean is on the predicted side (`agrees (1 seed)`).

Two claims carry a caveat the verdicts print: PipeDream-2BW's gap not growing with depth is true by
construction in the emulator (every stage, at every depth, applies the same one-step-delayed update), so
with `launch: emulator` its effects get no verdict; PipeDream against 2BW is confounded (PipeDream makes
m updates per step on m-times smaller batches at the learning rate tuned for whole steps).

A sync start, which the reference study lists among its compared baselines without a result, is held to
the same rule in COMPARISONS (against delays from the first step, and against Error Feedback), apart
from the claims and the verdicts table.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .grid import Study, mode_name
from .inference import PAIRED, POOLED, TOST, equivalence_verdict, paired_verdict, pooled_share
from .reference import (FINDINGS, MATCH_TOLERANCE, NAMES, RUNS_10B, RUNS_360M, REPORTED_SHARES, Published,
                        share_shown, where_of)
from .results import ef_share

__all__ = ["CLAIMS", "COMPARISONS", "Caveat", "Claim", "Effect", "Grid", "Judged", "std"]

@dataclass(frozen=True)
class Effect:
    subject: str  # what is compared, e.g. "adamw − muon, momentum 0.9"
    values: list[float]  # per seed, paired
    measured: str  # what the arms show, in the claim's own terms
    gaps: tuple[list[float], list[float]] | None = None  # a share's line: per-seed gaps without, with EF


class Grid:
    """A study's finished arms, as the claims read them: per-seed gaps of its modes."""

    def __init__(self, study: Study, losses: dict[tuple, dict[int, float]]):
        self.losses, self.optimizers, self.momentums = losses, list(study.learning_rates), study.momentums
        self.launch = study.launch
        plain = [(schedule, depth) for schedule, depth, sync_steps in study.modes
                 if schedule != "sync" and not sync_steps]
        self.depths = {s: sorted({d for t, d in plain if t == s}) for s, _ in plain}
        self.ef = max(study.ef_lambdas, default=0.0)  # the EF arms the claims read
        main = study.main_delayed_mode()
        self.main = mode_name(*main) if main else None
        def with_ef(mode) -> bool:
            return self.ef > 0 and self.ef in study.mode_ef_lambdas(mode)
        # The mode the EF claims read: the main delayed mode, when the grid runs it with EF.
        self.ef_main = self.main if main and with_ef(main) else None
        # Each sync-start mode with its twin delayed from the first step, and whether the twin runs with EF.
        self.sync_starts = [(mode_name(*m), mode_name(*twin), with_ef(twin)) for m in study.modes if m[2]
                            for twin in [(m[0], m[1], 0)] if twin in study.modes]

    def mode(self, schedule: str, deepest: bool = False) -> str | None:
        depths = self.depths.get(schedule)
        return mode_name(schedule, depths[-1] if deepest else depths[0]) if depths else None

    def gap(self, optimizer: str, mode: str, momentum: float, ef: float = 0.0) -> dict[int, float]:
        arm = self.losses.get((optimizer, mode, ef, momentum), {})
        sync = self.losses.get((optimizer, "sync", 0.0, momentum), {})
        return {seed: loss - sync[seed] for seed, loss in arm.items() if seed in sync}


def std(values) -> float:
    """The sample standard deviation of per-seed values (0 for one seed)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _paired(a: dict[int, float], b: dict[int, float], scale_a: float = 1.0) -> list[float]:
    """scale_a · a − b, seed by seed, over the seeds both have."""
    return [scale_a * a[seed] - b[seed] for seed in sorted(a) if seed in b]


def _mean(values: dict[int, float]) -> str:
    return f"{statistics.fmean(values.values()):+.3f}" if values else "–"


def _common(a: dict[int, float], b: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """a and b on the seeds both have: the seeds an effect pairs, so the means shown beside it are
    taken over the same seeds as the effect (a seed run on one side only would move them apart)."""
    return {s: v for s, v in a.items() if s in b}, {s: v for s, v in b.items() if s in a}


def _optimizer_gaps(g: Grid) -> list[Effect]:
    mode = g.main
    if mode is None or "adamw" not in g.optimizers:
        return []
    return [Effect(f"adamw − {other}, momentum {m:g}", _paired(adamw, theirs),
                   f"adamw {_mean(adamw)}, {other} {_mean(theirs)}")
            for m in g.momentums for other in g.optimizers if other != "adamw"
            for adamw, theirs in [_common(g.gap("adamw", mode, m), g.gap(other, mode, m))]]


def _ef_matches_sync(g: Grid) -> list[Effect]:
    mode = g.ef_main
    if mode is None:
        return []
    return [Effect(f"{o}, momentum {m:g}", list(gap.values()), f"gap with EF {_mean(gap)}")
            for o in g.optimizers for m in g.momentums for gap in [g.gap(o, mode, m, g.ef)]]


def _ef_removes_half(g: Grid) -> list[Effect]:
    mode = g.ef_main
    if mode is None:
        return []
    effects = []
    for o in g.optimizers:
        for m in g.momentums:
            off, on = _common(g.gap(o, mode, m), g.gap(o, mode, m, g.ef))
            values = _paired(off, on, scale_a=0.5)  # > 0: EF's gap is below half the gap without it
            shown = "–"
            if values:
                mean_off, mean_on = statistics.fmean(off.values()), statistics.fmean(on.values())
                removed = ef_share(mean_off, mean_on)
                share = "no gap to remove" if removed is None else f"{removed:.0%}"
                shown = f"{share} (gap {mean_off:+.3f} → {mean_on:+.3f})"
            effects.append(Effect(f"{o}, momentum {m:g}", values, shown, (list(off.values()), list(on.values()))))
    return effects


def _momentum(g: Grid) -> list[Effect]:
    mode = g.main
    if mode is None or len(g.momentums) < 2:
        return []
    low, high = min(g.momentums), max(g.momentums)
    return [Effect(f"{o}, momentum {low:g} − {high:g}", _paired(a, b), f"{_mean(a)} → {_mean(b)}")
            for o in g.optimizers for a, b in [_common(g.gap(o, mode, low), g.gap(o, mode, high))]]


def _growth_with_depth(schedule: str) -> Callable[[Grid], list[Effect]]:
    def effects(g: Grid) -> list[Effect]:
        if len(g.depths.get(schedule, [])) < 2:
            return []
        shallow, deep = g.mode(schedule), g.mode(schedule, deepest=True)
        return [Effect(f"{o}, momentum {m:g}, {deep} − {shallow}", _paired(b, a), f"{_mean(a)} → {_mean(b)}")
                for o in g.optimizers for m in g.momentums for a, b in [_common(g.gap(o, shallow, m), g.gap(o, deep, m))]]
    return effects


def _pipedream_against_2bw(g: Grid) -> list[Effect]:
    common = sorted(set(g.depths.get("pipedream", [])) & set(g.depths.get("pipedream-2bw", [])))
    if not common:
        return []
    pd, bw = mode_name("pipedream", common[-1]), mode_name("pipedream-2bw", common[-1])
    return [Effect(f"{o}, momentum {m:g}, depth {common[-1]}", _paired(a, b), f"pipedream {_mean(a)}, 2bw {_mean(b)}")
            for o in g.optimizers for m in g.momentums for a, b in [_common(g.gap(o, pd, m), g.gap(o, bw, m))]]


def _sync_start_against_delays(g: Grid) -> list[Effect]:
    return [Effect(f"{o}, momentum {m:g}, {twin} − {start}", _paired(a, b), f"{twin} {_mean(a)}, {start} {_mean(b)}")
            for start, twin, _ in g.sync_starts for o in g.optimizers for m in g.momentums
            for a, b in [_common(g.gap(o, twin, m), g.gap(o, start, m))]]


def _sync_start_against_ef(g: Grid) -> list[Effect]:
    return [Effect(f"{o}, momentum {m:g}, {start} − {twin} with EF", _paired(a, b),
                   f"{start} {_mean(a)}, {twin} with EF {_mean(b)}")
            for start, twin, with_ef in g.sync_starts if with_ef for o in g.optimizers for m in g.momentums
            for a, b in [_common(g.gap(o, start, m), g.gap(o, twin, m, g.ef))]]


def _per_optimizer(shown: dict[str, str], records: list[Published]) -> str:
    """Published values per optimizer, each as `shown` prints it, then where the records are reported."""
    return ", ".join(f"{NAMES[o]} {value}" for o, value in shown.items()) + f" ({where_of(records)})"


def _published_gaps(run: str) -> str:
    """Each optimizer's published gap of `run` at 360M, with its grade."""
    gaps = {o: runs.gap(run) for o, runs in RUNS_360M.items()}
    return _per_optimizer({o: gap.cited for o, gap in gaps.items()}, list(gaps.values()))


def _sourced(finding: Published) -> str:
    return f"{finding.cited} ({finding.where})"


@dataclass(frozen=True)
class Caveat:
    """What a claim's effects can show in this grid, when not what the t-test verdict would suggest."""
    label: str
    reason: str
    replaces_verdict: bool  # the effects test nothing: no verdict is drawn from them


# schedules/pipedream.py: PipeDream2BW.delay is 1 for every stage at every depth, and the emulator
# (emulation.py, optim/delay.py) only cuts the model into that many stages, each one update stale.
BY_CONSTRUCTION = Caveat(
    "true by construction in the emulator",
    "every stage at every emulated depth applies PipeDream-2BW's update one step delayed, so runs at two depths "
    "follow the same update rule and differ only in floating-point order: these effects are that noise, grown "
    "over training; real pipelines (launch: pipeline) would test the claim", True)
CONFOUNDED = Caveat(
    "confounded",
    "PipeDream updates after every microbatch: m = n_microbatches times as many updates as 2BW, each on an m-times "
    "smaller batch, at the learning rate tuned for whole steps (not corrected for it), so the delay is not the only "
    "difference", False)


@dataclass(frozen=True)
class Claim:
    statement: str
    published: str
    effect: str  # the per-seed difference its effects measure
    rule: str  # inference.PAIRED (an effect > 0), TOST (a match within ±tolerance) or POOLED (a share)
    effects: Callable[[Grid], list[Effect]]
    tolerance: Published | None = None  # TOST's margin
    caveat: Callable[[Grid], Caveat | None] = lambda grid: None
    share: float = 0.5  # POOLED: the share claimed

    @property
    def unpublished(self) -> bool:
        """A comparison without a published result (COMPARISONS): its verdicts read "holds"."""
        return not self.published


_DEPTHS = f"{_sourced(FINDINGS['depth_shown'])}, no numbers"
CLAIMS = [
    Claim("a one-step delay costs AdamW far more than Muon and SOAP",
          f"gap: {_published_gaps('delayed')}",
          "AdamW's gap − the other's", PAIRED, _optimizer_gaps),
    Claim("with Error Feedback the delayed run matches the synchronous one",
          f"gap with EF: {_published_gaps('ef')}; 10B MoE, Muon: {RUNS_10B.gap('ef').cited} "
          f"({RUNS_10B.ef.cited} with EF, {RUNS_10B.sync.cited} sync; {RUNS_10B.ef.where})",
          "the gap with EF", TOST, _ef_matches_sync, tolerance=MATCH_TOLERANCE),
    Claim("Error Feedback removes at least half of the gap",
          _per_optimizer({o: share_shown(o) for o in REPORTED_SHARES}, list(REPORTED_SHARES.values()))
          + f"; across optimizers {_sourced(FINDINGS['ef_share_range'])}",
          "½ · the gap without EF − the gap with EF", POOLED, _ef_removes_half),
    Claim("a higher momentum tolerates the delay better",
          f"the gap at a higher momentum: {_sourced(FINDINGS['momentum'])}, no numbers",
          "the gap at the lower momentum − at the higher", PAIRED, _momentum),
    Claim("PipeDream-2BW's gap does not grow with the pipeline's depth",
          f"{FINDINGS['depth_2bw'].cited} up to {_DEPTHS}",
          "the gap at the largest depth − at the smallest", TOST, _growth_with_depth("pipedream-2bw"),
          tolerance=MATCH_TOLERANCE,
          caveat=lambda grid: BY_CONSTRUCTION if grid.launch == "emulator" else None),
    Claim("PipeDream's gap grows with the pipeline's depth",
          f"{FINDINGS['depth_pipedream'].cited}, shown at {_DEPTHS}",
          "the gap at the largest depth − at the smallest", PAIRED, _growth_with_depth("pipedream")),
    Claim("at equal depth PipeDream's gap exceeds PipeDream-2BW's",
          f"PipeDream's {FINDINGS['depth_pipedream'].cited}, 2BW's {FINDINGS['depth_2bw'].cited}, at {_DEPTHS}",
          "PipeDream's gap − PipeDream-2BW's, at the largest depth both run", PAIRED, _pipedream_against_2bw,
          caveat=lambda grid: CONFOUNDED),
]

# Comparisons the reference study reports no result for: it lists a synchronous start among the baselines
# it compares (docs/studies.md). They follow the claims' rule; "holds" reads its "reproduced".
COMPARISONS = [
    Claim("a synchronous start leaves a smaller gap than delays from the first step", "",
          "the gap delayed from the first step − the gap after a sync start", PAIRED, _sync_start_against_delays),
    Claim("Error Feedback leaves a smaller gap than a synchronous start", "",
          "the gap after a sync start − the gap delayed from the first step with EF", PAIRED,
          _sync_start_against_ef),
]
_COMPARISON_WORDS = {"reproduced": "holds", "agrees (1 seed)": "holds (1 seed)",
                     "disagrees (1 seed)": "does not hold (1 seed)"}


def _tally(verdicts: list[str]) -> str:
    if not verdicts:
        return "not in this grid"
    return "; ".join(f"{v}: {verdicts.count(v)}" for v in dict.fromkeys(verdicts))


class Judged:
    """A claim with its effects in one grid, and the verdicts the tables print for them."""

    def __init__(self, claim: Claim, grid: Grid):
        self.claim, self.effects, self.caveat = claim, claim.effects(grid), claim.caveat(grid)

    def verdict(self, values: list[float]) -> str:
        """An effect's verdict: TOST for a match; otherwise the paired test against 0 (for a share, the
        line's own check that EF removes more than half, beside the pooled verdict)."""
        if values and self.caveat and self.caveat.replaces_verdict:
            return self.caveat.label
        if self.claim.rule == TOST:
            said = equivalence_verdict(values, self.claim.tolerance.value)
        else:
            said = paired_verdict(values)
        return _COMPARISON_WORDS.get(said, said) if self.claim.unpublished else said

    def pooled(self):
        """POOLED: the lines' shares pooled (inference.Pooled), None before a line has a gap to remove."""
        return pooled_share([e.gaps for e in self.effects if e.gaps])

    def verdicts(self) -> str:
        """The claim's verdict, after the rule (and margin, and caveat) it is read under: for a share the
        pooled one; otherwise the tally of its effects' verdicts. Only the tally before an effect is
        measured, or where a caveat replaces the verdicts."""
        tally = _tally([self.verdict(e.values) for e in self.effects])
        if not any(e.values for e in self.effects) or (self.caveat and self.caveat.replaces_verdict):
            return tally
        if self.claim.rule == POOLED:
            pooled = self.pooled()
            if pooled is None:
                return f"{POOLED}: no gap to remove"
            return f"{POOLED}: share {pooled.shown()}, claimed ≥ {self.claim.share:.0%}: {pooled.verdict(self.claim.share)}"
        qualifiers = [self.claim.rule, *([f"margin ±{self.claim.tolerance.cited.lstrip('+')}"] if self.claim.rule == TOST else []),
                      *([self.caveat.label] if self.caveat else [])]
        return f"{'; '.join(qualifiers)}: {tally}"

    def prediction(self) -> str:
        if self.claim.rule == TOST:
            return f"predicted within ±{self.claim.tolerance.cited.lstrip('+')} (the margin; {TOST})"
        if self.claim.rule == POOLED:
            return (f"predicted > 0 in each line ({PAIRED}), and the share pooled over lines ≥ "
                    f"{self.claim.share:.0%} ({POOLED})")
        return f"{'holds when' if self.claim.unpublished else 'predicted'} > 0 ({PAIRED})"
