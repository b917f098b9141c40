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


def test_judge_against_the_figure_widened_by_the_tolerance():
  assert verdict.judge(est(1.9, 2.3), 2.0) == "reproduced"
  assert verdict.judge(est(2.15, 2.5), 2.0) == "reproduced"  # overlaps 2.2, the figure's upper edge
  assert verdict.judge(est(2.3, 2.6), 2.0) == "larger"
  assert verdict.judge(est(1.4, 1.8), 2.0) == "smaller"
  assert verdict.judge(est(0.9, 2.1), 2.0).startswith("inconclusive")
  assert verdict.judge(est(1.9, 2.3, n=3), 2.0) == "too few seeds (3 < 5)"


def test_parity_claims_are_also_judged_against_one():
  assert verdict.judge(est(1.05, 1.15), 1.1) == "reproduced"
  assert verdict.judge(est(0.95, 1.15), 1.1) == "reproduced; not distinguishable from parity"
  assert verdict.judge(est(0.85, 0.95), 1.1) == "smaller; slower than the baseline"
  assert verdict.judge(est(0.85, 1.02), 1.2) == "smaller; not distinguishable from parity"


def test_t_interval_and_the_verdict_on_a_published_difference():
  d = [1.0, 2.0, 3.0, 2.5, 1.5]
  mean, lo, hi = verdict.t_interval(d)
  half = stats.t.ppf(0.975, 4) * np.std(d, ddof=1) / math.sqrt(5)
  assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half), rel=1e-12)
  assert math.isnan(verdict.t_interval([1.0])[1])
  assert verdict.judge_difference(mean, lo, hi, 2.5) == "reproduced"
  assert verdict.judge_difference(mean, lo, hi, 5.93) == "smaller; the same sign"
  assert verdict.judge_difference(mean, lo, hi, -2.62) == "larger; the opposite sign"
  assert verdict.judge_difference(0.5, -0.5, 1.5, 5.93) == "smaller; the interval holds 0"
  assert verdict.judge_difference(1.0, math.nan, math.nan, 2.0) == "not judged: no interval"
