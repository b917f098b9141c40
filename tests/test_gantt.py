"""The Gantt chart of a long run: a window of its first steps as bars, and every worker's share of time
computing over the whole run, measured exactly from the intervals."""

import numpy as np

from ripples_jax import analysis


def trace(num_workers, steps, step_s=0.1, wait_s=0.02):
  """Worker w computes for step_s x (1 + w), then waits wait_s, then communicates 0.01 s, `steps` times."""
  out = []
  for w in range(num_workers):
    t = 0.0
    for _ in range(steps):
      c = step_s * (1 + w)
      out += [(w, "compute", t, t + c), (w, "wait", t + c, t + c + wait_s)]
      out.append((w, "comm", t + c + wait_s, t + c + wait_s + 0.01))
      t += c + wait_s + 0.01
  return out


def test_utilisation_is_the_exact_share_of_each_span():
  intervals = trace(3, 50)
  t_end = max(t1 for *_, t1 in intervals)
  util = analysis.utilisation(intervals, 3, t_end, bins=7)
  # Reference: a fine grid of instants, each classified by the interval holding it.
  grid = (np.arange(700_000) + 0.5) * (t_end / 700_000)
  for kind in analysis.COLORS:
    ref = np.zeros((3, 7))
    for w, k, t0, t1 in intervals:
      if k == kind:
        inside = grid[(grid >= t0) & (grid < t1)]
        np.add.at(ref[w], np.minimum((inside // (t_end / 7)).astype(int), 6), 1)
    np.testing.assert_allclose(util[kind], ref / 100_000, atol=2e-4)
  total = sum(util.values())
  assert np.all(total <= 1 + 1e-9) and np.allclose(total[2], 1.0)  # the slowest is busy to the end


def test_a_long_run_gets_a_window_and_the_utilisation_panel(tmp_path):
  short, long_ = trace(2, analysis.LONG_STEPS), trace(2, analysis.LONG_STEPS + 1)
  assert analysis.gantt_window(short) is None
  window = analysis.gantt_window(long_)
  worker0 = [t0 for w, k, t0, _ in long_ if w == 0 and k == "compute"]
  assert window == worker0[analysis.WINDOW_STEPS]  # the busiest worker's first WINDOW_STEPS steps
  assert analysis.gantt(short, 2, str(tmp_path / "a.png"), "short") == 1
  assert analysis.gantt(long_, 2, str(tmp_path / "b.png"), "long") == 2
  assert analysis.gantt(long_, 2, str(tmp_path / "c.png"), "asked", t_max=3.0) == 1  # t_max: as asked
  assert all((tmp_path / f).stat().st_size > 0 for f in ("a.png", "b.png", "c.png"))
