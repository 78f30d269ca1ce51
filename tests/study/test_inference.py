"""The rules the study's verdicts follow (hf_asyncpp/study/inference.py), each checked against scipy's
tests on random data and by hand where the answer is known: the paired t-test, the equivalence test (two
one-sided t-tests, TOST) and the share pooled over lines with the line as a random effect."""

from __future__ import annotations

import random
import statistics

import pytest
from scipy import stats

from hf_asyncpp.study.inference import equivalence_verdict, paired_verdict, pooled_share, t_quantile


@pytest.mark.parametrize("df", [1, 2, 3, 5, 9, 10, 20, 60, 1000])
@pytest.mark.parametrize("p", [0.975, 0.95])
def test_the_t_quantiles_are_scipy_s_to_5e_4(df, p):
    assert t_quantile(df, p) == pytest.approx(stats.t.ppf(p, df), abs=5e-4)


@pytest.mark.parametrize("n", [2, 3, 5, 10, 40])
def test_an_effect_counts_exactly_when_a_two_sided_paired_t_test_rejects_zero_at_5_percent(n):
    rng = random.Random(n)
    for _ in range(200):
        values = [rng.gauss(rng.choice([0.0, 0.1, -0.1]), 0.1) for _ in range(n)]
        result = stats.ttest_1samp(values, 0.0)
        if abs(result.pvalue - 0.05) < 1e-3:
            continue  # the rule's table holds t to 3 decimals
        expected = ("reproduced" if sum(values) > 0 else "opposite") if result.pvalue < 0.05 else "not beyond noise"
        assert paired_verdict(values) == expected


def test_by_hand_three_seeds_need_a_mean_above_4_303_standard_errors():
    # [1, 2, 3]: mean 2, sd 1, bound 4.303 / √3 = 2.484; [2, 3, 4]: mean 3 > 2.484.
    assert paired_verdict([1.0, 2.0, 3.0]) == "not beyond noise"
    assert paired_verdict([2.0, 3.0, 4.0]) == "reproduced"
    assert paired_verdict([-2.0, -3.0, -4.0]) == "opposite"
    assert paired_verdict([]) == "not measured yet"
    assert paired_verdict([0.2]) == "agrees (1 seed)" and paired_verdict([-0.2]) == "disagrees (1 seed)"


@pytest.mark.parametrize("n", [2, 3, 5, 10])
def test_equivalence_is_both_one_sided_tests_rejecting_at_5_percent(n):
    """TOST within ±m: equivalent exactly when H0 mean ≤ −m and H0 mean ≥ m are both rejected at 5%; shown
    not equivalent when the two-sided test rejects a mean at the nearer edge; else neither."""
    rng, margin = random.Random(10 + n), 0.028
    for _ in range(300):
        values = [rng.gauss(rng.choice([0.0, 0.02, 0.05, -0.04]), rng.choice([0.005, 0.02])) for _ in range(n)]
        above = stats.ttest_1samp(values, -margin, alternative="greater").pvalue
        below = stats.ttest_1samp(values, margin, alternative="less").pvalue
        edge = margin if statistics.fmean(values) > 0 else -margin
        outside = stats.ttest_1samp(values, edge).pvalue < 0.05 and abs(statistics.fmean(values)) > margin
        if min(abs(p - 0.05) for p in (above, below, stats.ttest_1samp(values, edge).pvalue)) < 1e-3:
            continue
        expected = "reproduced" if max(above, below) < 0.05 else "not reproduced" if outside else "not shown"
        assert equivalence_verdict(values, margin) == expected


def test_an_absence_needs_its_interval_inside_the_margin_not_a_mean_below_it():
    """Three seeds at +0.020/+0.025/+0.030 lie inside ±0.028, but their upper one-sided bound (0.025 +
    2.920 · 0.005 / √3 = 0.0334) does not: not shown, where the old rule (a mean at most the tolerance)
    said reproduced. A tighter spread shows it; a mean beyond the margin by more than its bound refutes it."""
    assert equivalence_verdict([0.020, 0.025, 0.030], 0.028) == "not shown"
    assert equivalence_verdict([0.001, 0.002, 0.003], 0.028) == "reproduced"
    assert equivalence_verdict([-0.001, 0.0, 0.001], 0.028) == "reproduced"
    assert equivalence_verdict([0.047, 0.050, 0.053], 0.028) == "not reproduced"
    assert equivalence_verdict([-0.047, -0.050, -0.053], 0.028) == "not reproduced"
    assert equivalence_verdict([0.005], 0.028) == "agrees (1 seed)"
    assert equivalence_verdict([0.05], 0.028) == "disagrees (1 seed)"


def test_a_pooled_share_is_the_lines_mean_with_a_t_interval_over_lines():
    """Each line's share is 1 − its mean gap with EF over its mean gap without; the interval is scipy's
    t interval over the lines' shares; lines without a gap to remove are left out."""
    lines = [([0.50, 0.48, 0.52], [0.20, 0.25, 0.15]),  # 60%
             ([0.10, 0.12, 0.08], [0.03, 0.05, 0.04]),  # 60%
             ([0.20, 0.22, 0.18], [0.10, 0.12, 0.08]),  # 50%
             ([0.05, 0.04, 0.06], [0.01, 0.02, 0.00]),  # 80%
             ([-0.01, 0.0, -0.02], [0.0, 0.01, 0.0])]  # no gap: left out
    pooled = pooled_share(lines)
    shares = [0.6, 0.6, 0.5, 0.8]
    low, high = stats.t.interval(0.95, len(shares) - 1, loc=statistics.fmean(shares), scale=stats.sem(shares))
    assert pooled.lines == 4 and pooled.share == pytest.approx(0.625)
    assert pooled.interval == pytest.approx((low, high), abs=1e-3)
    # 62.5% ± 20.0%: the claim of half is not shown (its interval reaches 42%); of a fifth it is; of 90% it is refuted
    assert pooled.verdict(0.5) == "not beyond noise"
    assert pooled.verdict(0.2) == "reproduced" and pooled.verdict(0.9) == "opposite"
    assert pooled.shown() == "62%, 95% CI 42% to 83% (4 lines)"
    one = pooled_share(lines[:1])
    assert (one.interval, one.verdict(0.5), one.verdict(0.7)) == (None, "agrees (1 line)", "disagrees (1 line)")
    assert pooled_share(lines[4:]) is None
