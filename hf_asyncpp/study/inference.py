"""The three rules the study's verdicts rest on, each named in every verdict it gives.

- `paired_verdict` (PAIRED): a claim of an effect. Per-seed differences (paired by seed: the same data
  order and initial weights) against the claim's threshold t: `reproduced` when their mean exceeds t by
  more than the two-sided 95% Student-t bound t(n − 1) · sd / √n, `opposite` when it lies that far below
  t, else `not beyond noise`.
- `equivalence_verdict` (TOST): a claim that two things match within a tolerance ±m. Two one-sided
  t-tests at 5% each (Schuirmann's TOST): `reproduced` (equivalent) when the one-sided 95% bounds of the
  mean, mean ± t₀.₉₅(n − 1) · sd / √n, both lie inside (−m, m); `not reproduced` when the mean exceeds m
  (or falls below −m) by more than the two-sided 95% bound; else `not shown` (the seeds can tell neither).
  An absence is never read off a mean alone: three seeds at a spread comparable to m rarely show it.
- `pooled_share` (POOLED): a claim that Error Feedback removes at least a share of the gap. Each line
  (optimizer and momentum) gives its share, 1 − (mean gap with EF) / (mean gap without), over its seeds;
  the lines are a random sample of settings, so the pooled share is the mean of the lines' shares and its
  95% interval is the Student-t interval over lines (the random-intercept model's estimate for balanced
  lines: each line's share already carries its seeds' noise). `reproduced` when the interval lies above
  the claimed share, `opposite` when below, else `not beyond noise`.

One seed (or one line) has no spread: the verdicts then read only the side of the threshold the mean is on
(`agrees` / `disagrees`, with the count).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["PAIRED", "POOLED", "TOST", "Pooled", "equivalence_verdict", "paired_verdict", "pooled_share",
           "t_quantile"]

PAIRED = "paired t-test, 95%"
TOST = "equivalence, two one-sided t-tests at 5%"
POOLED = "pooled over lines, 95% t interval"

# Upper quantiles of Student's t by degrees of freedom, to 3 decimals: 0.975 (two-sided 95%) and 0.95
# (one-sided 95%, TOST's).
_TABLES = {0.975: {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262},
           0.95: {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}}
_NORMAL = {0.975: 1.959964, 0.95: 1.644854}


def t_quantile(df: int, p: float = 0.975) -> float:
    """Student's t quantile `p` (0.975 or 0.95) at `df` degrees of freedom: the table, and beyond it the
    expansion about the normal quantile (Abramowitz & Stegun 26.7.5, three terms), within 5e-4 of the
    exact quantile everywhere."""
    if df in _TABLES[p]:
        return _TABLES[p][df]
    z = _NORMAL[p]
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def _bound(values: list[float], p: float) -> float:
    """t_p(n − 1) · sd / √n: the half-width of the mean's interval."""
    return t_quantile(len(values) - 1, p) * statistics.stdev(values) / math.sqrt(len(values))


def _one_value(excess: float, expect_positive: bool, unit: str) -> str:
    agrees = excess > 0 if expect_positive else excess <= 0
    return f"{'agrees' if agrees else 'disagrees'} (1 {unit})"


def paired_verdict(values: list[float], threshold: float = 0.0) -> str:
    """PAIRED: per-seed differences against a claim that they exceed `threshold`."""
    if not values:
        return "not measured yet"
    excess = statistics.fmean(values) - threshold
    if len(values) == 1:
        return _one_value(excess, True, "seed")
    bound = _bound(values, 0.975)
    return "reproduced" if excess > bound else "opposite" if excess < -bound else "not beyond noise"


def equivalence_verdict(values: list[float], margin: float) -> str:
    """TOST: per-seed differences against a claim that they lie within ±`margin`."""
    if not values:
        return "not measured yet"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return _one_value(abs(mean) - margin, False, "seed")
    one_sided = _bound(values, 0.95)
    if -margin < mean - one_sided and mean + one_sided < margin:
        return "reproduced"
    if abs(mean) - margin > _bound(values, 0.975):
        return "not reproduced"
    return "not shown"


@dataclass(frozen=True)
class Pooled:
    """A share pooled over lines: its mean, 95% interval (None for one line) and the lines it pools."""
    share: float
    interval: tuple[float, float] | None
    lines: int

    def verdict(self, claimed: float) -> str:
        """POOLED: against a claim that the share is at least `claimed`."""
        if self.interval is None:
            return _one_value(self.share - claimed, True, "line")
        low, high = self.interval
        return "reproduced" if low > claimed else "opposite" if high < claimed else "not beyond noise"

    def shown(self) -> str:
        interval = "" if self.interval is None else f", 95% CI {self.interval[0]:.0%} to {self.interval[1]:.0%}"
        return f"{self.share:.0%}{interval} ({self.lines} line{'s' if self.lines != 1 else ''})"


def pooled_share(lines: list[tuple[list[float], list[float]]]) -> Pooled | None:
    """POOLED: the share of the gap EF removes, from each line's per-seed gaps (without EF, with EF), the
    line as a random effect. Lines without a gap to remove (mean ≤ 0) are left out; None without any."""
    shares = [1 - statistics.fmean(on) / statistics.fmean(off) for off, on in lines
              if off and on and statistics.fmean(off) > 0]
    if not shares:
        return None
    mean = statistics.fmean(shares)
    if len(shares) == 1:
        return Pooled(mean, None, 1)
    bound = _bound(shares, 0.975)
    return Pooled(mean, (mean - bound, mean + bound), len(shares))
