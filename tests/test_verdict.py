"""ripples_jax.verdict: the ledger's rule on paired, censored seeds."""

import math

import numpy as np
import pytest
from scipy import stats

from ripples_jax import verdict


def test_paired_is_the_t_interval_of_the_log_ratios():
  base, ours = [10.0, 12.0, 9.0, 11.0, 10.5], [5.0, 5.5, 4.0, 6.0, 5.0]
  e = verdict.paired(ours, base, budget=100.0)
  logs = np.log(np.array(base) / np.array(ours))
  half = stats.t.ppf(0.975, 4) * logs.std(ddof=1) / math.sqrt(5)
  assert e.mean == pytest.approx(math.exp(logs.mean()), rel=1e-12)
  assert (e.lo, e.hi) == pytest.approx(
    (math.exp(logs.mean() - half), math.exp(logs.mean() + half)), rel=1e-12
  )
  assert (e.seeds, e.reached, e.baseline_reached, e.censored) == (5, 5, 5, 0)


def test_a_miss_enters_at_the_budget_and_is_counted():
  e = verdict.paired([2.0, None, 2.0, 2.0, 2.0], [4.0, 4.0, None, None, 4.0], budget=8.0)
  logs = np.log([2.0, 0.5, 4.0, 4.0, 2.0])  # seed 1: 4 / 8 (an upper bound); 2, 3: 8 / 2 (lower ones)
  assert e.mean == pytest.approx(math.exp(logs.mean()))
  assert (e.reached, e.baseline_reached, e.censored) == (4, 3, 3)
  assert "method reached 4/5" in str(e) and "baseline reached 3/5" in str(e)
  assert verdict.judge(e, 2.0).endswith("(3 censored seeds)")
  # Each run censored at its own end: seed 1's method ran to 6, seeds 2 and 3's baselines to 9 and 10.
  own = verdict.paired(
    [2.0, None, 2.0, 2.0, 2.0], [4.0, 4.0, None, None, 4.0], ([0, 6.0, 0, 0, 0], [0, 0, 9.0, 10.0, 0])
  )
  assert own.mean == pytest.approx(math.exp(np.log([2.0, 4 / 6, 4.5, 5.0, 2.0]).mean()))
  with pytest.raises(ValueError):
    verdict.paired([1.0], [1.0, 2.0], budget=3.0)
  with pytest.raises(ValueError, match="cannot be censored"):
    verdict.paired([None], [1.0], budget=([None], [None]))


def est(lo, hi, n=5):
  return verdict.Estimate(math.sqrt(lo * hi), lo, hi, seeds=n, reached=n, baseline_reached=n, censored=0)


def test_judge_is_an_equivalence_rule_against_the_band():
  # The band of 2.0x: [2.0 / 1.1, 2.2] = [1.818, 2.2].
  assert verdict.judge(est(1.9, 2.15), 2.0) == "reproduced"  # inside
  assert verdict.judge(est(1.9, 2.3), 2.0) == "inconclusive"  # overlaps the upper edge
  assert verdict.judge(est(1.7, 2.1), 2.0) == "inconclusive"  # overlaps the lower edge
  assert verdict.judge(est(0.9, 2.1), 2.0) == "inconclusive"  # wide: holds the figure and 1.0
  assert verdict.judge(est(1.5, 3.0), 2.0) == "inconclusive"  # holds the whole band
  assert verdict.judge(est(2.3, 2.6), 2.0) == "larger"
  assert verdict.judge(est(1.4, 1.8), 2.0) == "smaller"
  assert verdict.judge(est(1.9, 2.1, n=3), 2.0) == "too few seeds (3 < 5)"


def test_parity_claims_go_through_the_same_rule_and_are_placed_against_one():
  # 1.1x: band [1.0, 1.21]. 0.97x [0.84, 1.12], a point estimate slower than the baseline, is not
  # "reproduced" against 1.1x any more.
  assert verdict.judge(est(0.84, 1.12), 1.1) == "inconclusive; not distinguishable from parity"
  assert verdict.judge(est(1.02, 1.15), 1.1) == "reproduced"
  assert verdict.judge(est(0.85, 0.95), 1.1) == "smaller; slower than the baseline"
  assert verdict.judge(est(0.85, 1.02), 1.2) == "smaller; not distinguishable from parity"


def censored(lo, hi, method_misses, baseline_misses, n=5):
  both = method_misses + baseline_misses
  return verdict.Estimate(
    math.sqrt(lo * hi), lo, hi, n, n - method_misses, n - baseline_misses, censored=min(both, n)
  )


def test_censored_seeds_support_only_the_direction_their_censoring_allows():
  # A method's misses make ratios upper bounds: they can support "smaller", nothing else.
  assert verdict.judge(censored(1.4, 1.8, 2, 0), 2.0) == "smaller (2 censored seeds)"
  assert verdict.judge(censored(2.3, 2.6, 2, 0), 2.0) == "inconclusive (censored) (2 censored seeds)"
  assert verdict.judge(censored(1.9, 2.1, 1, 0), 2.0) == "inconclusive (censored) (1 censored seed)"
  # A baseline's misses make ratios lower bounds: they can support "larger".
  assert verdict.judge(censored(2.3, 2.6, 0, 3), 2.0) == "larger (3 censored seeds)"
  assert verdict.judge(censored(1.4, 1.8, 0, 3), 2.0) == "inconclusive (censored) (3 censored seeds)"
  # Misses on both sides: no direction.
  assert verdict.judge(censored(1.4, 1.8, 1, 1), 2.0) == "inconclusive (censored) (2 censored seeds)"
  # The case: AD-PSGD (the baseline) reaches 68% in 0 of 5 seeds; "smaller" cannot stand.
  assert verdict.judge(censored(0.7, 0.9, 0, 5), 4.3).startswith("inconclusive (censored)")


def test_t_interval_and_the_verdict_on_a_published_difference():
  d = [1.0, 2.0, 3.0, 2.5, 1.5]
  mean, lo, hi = verdict.t_interval(d)
  half = stats.t.ppf(0.975, 4) * np.std(d, ddof=1) / math.sqrt(5)
  assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half), rel=1e-12)
  assert math.isnan(verdict.t_interval([1.0])[1])
  # The band of a difference: the figure +- 1 point.
  assert verdict.judge_difference(2.0, 1.5, 2.5, 2.2) == "reproduced"
  assert (
    verdict.judge_difference(mean, lo, hi, 2.5) == "inconclusive; the same sign"
  )  # [1.3, 2.7] vs [1.5, 3.5]
  assert verdict.judge_difference(mean, lo, hi, 5.93) == "smaller; the same sign"
  assert verdict.judge_difference(mean, lo, hi, -2.62) == "larger; the opposite sign"
  assert verdict.judge_difference(0.5, -0.5, 1.5, 5.93) == "smaller; the interval holds 0"
  # The case: -0.16 [-3.20, +2.88] against -2.62 holds 0 and the band's edge: inconclusive.
  assert verdict.judge_difference(-0.16, -3.20, 2.88, -2.62) == "inconclusive; the interval holds 0"
  assert verdict.judge_difference(1.0, math.nan, math.nan, 2.0) == "not judged: no interval"
