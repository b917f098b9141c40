"""Verdicts on a paper's claims from paired seeds: the claims ledger's rule (docs/design.md 3.11).

A claim is a published ratio: a baseline's time to a target over the method's. Ours is measured per
seed, the two runs of a seed paired (same seed, same data order, same clock noise):
  - A run that misses the target within its budget is censored: its time enters as the budget, so a
    missing baseline makes that seed's ratio a lower bound and a missing method an upper bound. The
    misses are counted (`reached` m of n for each side).
  - The interval is a 95% Student-t interval of the mean log ratio (ratios multiply, so the mean is
    geometric), over at least MIN_SEEDS seeds.
The rule is one of equivalence, for speedups, parity claims and differences alike:
  - the band: the published figure widened by TOLERANCE either way for a ratio (the paper's figures
    are read off bar charts to one or two significant figures; its own run-to-run spread is not
    reported), DIFFERENCE_BAND accuracy points either way for a difference;
  - `reproduced` only when the interval lies inside the band; `larger` / `smaller` only when it lies
    wholly outside it on that side; otherwise `inconclusive`. A noisier interval can therefore never
    earn `reproduced` more easily, only `inconclusive`.
  - Censored seeds support only the direction their censoring allows: a method's misses (ratios that
    are upper bounds) can support `smaller`, a baseline's misses (lower bounds) `larger`; any other
    verdict with censored seeds, or misses on both sides, is `inconclusive (censored)`.
  - A parity claim (a figure within 2 x TOLERANCE of 1: "as fast as All-Reduce, a little faster") is
    also placed against 1.0: an interval wholly below 1.0 is slower than the baseline, one that holds
    1.0 cannot tell it from parity.
Every published figure (arXiv and ASPLOS) is judged on its own.
"""

import dataclasses
import math

import numpy as np
from scipy import stats

MIN_SEEDS = 5
TOLERANCE = 0.10  # the paper's figure widened by 10% either way (a figure read off a bar chart)
DIFFERENCE_BAND = 1.0  # accuracy points either way: the paper's accuracies are single runs, to 0.1
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A paired ratio over seeds: geometric mean and its interval; misses of either side counted."""

  mean: float
  lo: float
  hi: float
  seeds: int
  reached: int  # seeds whose method run reached the target
  baseline_reached: int  # ... whose baseline run did
  censored: int  # seeds whose ratio is a bound (either side missed the target), not a measurement

  def __str__(self) -> str:
    s = f"{self.mean:.2f}x [{self.lo:.2f}, {self.hi:.2f}]"
    misses = []
    if self.reached < self.seeds:
      misses.append(f"method reached {self.reached}/{self.seeds}")
    if self.baseline_reached < self.seeds:
      misses.append(f"baseline reached {self.baseline_reached}/{self.seeds}")
    return s + (f" ({', '.join(misses)}; misses at the budget)" if misses else "")


def paired(method_times, baseline_times, budget, level: float = LEVEL) -> Estimate:
  """The ratio baseline / method per seed and its interval. A time None missed the target and is
  censored at the budget: one number for every run, or (method_ends, baseline_ends), each run's own
  end (a run of a fixed number of steps ends when its clock does)."""
  n = len(method_times)
  if len(baseline_times) != n:
    raise ValueError(f"{n} method seeds against {len(baseline_times)} baseline seeds")
  ends_m, ends_b = ([budget] * n, [budget] * n) if np.isscalar(budget) else budget

  def at(t, end):
    if t is not None:
      return float(t)
    if end is None:
      raise ValueError("a run missed the target and its end time is not recorded: it cannot be censored")
    return float(end)

  logs = np.array(
    [math.log(at(b, eb) / at(m, em)) for m, b, em, eb in zip(method_times, baseline_times, ends_m, ends_b)]
  )
  n = len(logs)
  mean = float(np.mean(logs))
  half = (
    float(stats.t.ppf(0.5 + level / 2, n - 1) * np.std(logs, ddof=1) / math.sqrt(n)) if n > 1 else math.inf
  )
  return Estimate(
    mean=math.exp(mean),
    lo=math.exp(mean - half),
    hi=math.exp(mean + half),
    seeds=n,
    reached=sum(t is not None for t in method_times),
    baseline_reached=sum(t is not None for t in baseline_times),
    censored=sum(m is None or b is None for m, b in zip(method_times, baseline_times)),
  )


def t_interval(values, level: float = LEVEL) -> tuple[float, float, float]:
  """The mean of values and its Student-t interval; (mean, nan, nan) under two values (a paired
  difference's interval: accuracy points, where a ratio's log does not apply)."""
  v = np.asarray(values, np.float64)
  mean = float(v.mean())
  if len(v) < 2:
    return mean, math.nan, math.nan
  half = float(stats.t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
  return mean, mean - half, mean + half


def _equivalence(lo: float, hi: float, low: float, high: float) -> str:
  """The interval [lo, hi] against the band [low, high] (module docstring)."""
  if low <= lo and hi <= high:
    return "reproduced"
  if hi < low:
    return "smaller"
  if lo > high:
    return "larger"
  return "inconclusive"


def judge_difference(mean: float, lo: float, hi: float, figure: float, band: float = DIFFERENCE_BAND) -> str:
  """The verdict on a published difference (accuracy points): the interval against the figure +-
  `band` points; outside it, whether ours has the published sign at all."""
  if math.isnan(hi):
    return "not judged: no interval"
  out = _equivalence(lo, hi, figure - band, figure + band)
  if out == "reproduced":
    return out
  if lo <= 0 <= hi:
    return f"{out}; the interval holds 0"
  return f"{out}; {'the same' if (mean > 0) == (figure > 0) else 'the opposite'} sign"


def judge(e: Estimate, figure: float, tolerance: float = TOLERANCE, min_seeds: int = MIN_SEEDS) -> str:
  """The verdict on one published figure (module docstring)."""
  if e.seeds < min_seeds:
    return f"too few seeds ({e.seeds} < {min_seeds})"
  out = _equivalence(e.lo, e.hi, figure / (1 + tolerance), figure * (1 + tolerance))
  if e.censored:
    method_missed, baseline_missed = e.reached < e.seeds, e.baseline_reached < e.seeds
    allowed = None if method_missed and baseline_missed else ("smaller" if method_missed else "larger")
    if out != allowed:
      out = "inconclusive (censored)"
  if abs(figure - 1) <= 2 * tolerance:  # parity: "as fast as the baseline, a little faster"
    if e.hi < 1:
      out += "; slower than the baseline"
    elif e.lo <= 1:
      out += "; not distinguishable from parity"
  if e.censored:
    out += f" ({e.censored} censored seed{'s' * (e.censored != 1)})"
  return out
