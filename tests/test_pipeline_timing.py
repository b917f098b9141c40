"""Iteration-time model of DSP and its baselines: closed forms, recurrences, stragglers."""

import numpy as np
import pytest

from ripples_jax.pipeline import timing as T


def equal(k, f=1.0):
  return [f] * k, [2 * f] * k  # B = 2F


def unequal(seed=0, k=5):
  rng = np.random.default_rng(seed)
  return rng.uniform(0.5, 2.0, k), rng.uniform(1.0, 4.0, k)


@pytest.mark.parametrize("k", [2, 4])
def test_dsp_speedup_is_k_fused_and_three_quarters_k_unfused(k):
  f, b = equal(k, 0.37)
  assert T.speedup_vs_bp("dsp", f, b, fused=True) == pytest.approx(k, abs=1e-12)
  assert T.speedup_vs_bp("dsp", f, b, fused=False) == pytest.approx(3 * k / 4, abs=1e-12)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gpipe_equal_stages_match_the_bubble_closed_form(k, m):
  f, b = equal(k, 0.5)
  fk, bk = f[0], b[0]
  no_remat = T.iteration_time("gpipe", f, b, microbatches=m, remat=False)
  remat = T.iteration_time("gpipe", f, b, microbatches=m, remat=True)
  assert no_remat == pytest.approx((m + k - 1) / m * (fk + bk), abs=1e-9)
  assert remat == pytest.approx((m + k - 1) / m * (2 * fk + bk), abs=1e-9)
  assert T.speedup_vs_bp("gpipe", f, b, microbatches=m, remat=False) == pytest.approx(
    k * m / (m + k - 1), abs=1e-9
  )
  # B = 2F: BP per stage 3F, GPipe with remat 4F per stage-batch inside the bubble.
  assert T.speedup_vs_bp("gpipe", f, b, microbatches=m) == pytest.approx(
    3 * k * m / (4 * (m + k - 1)), abs=1e-9
  )


@pytest.mark.parametrize("remat", [True, False])
def test_gpipe_recurrence_matches_the_flow_shop_form_on_unequal_stages(remat):
  for seed in range(5):
    f, b = unequal(seed)
    m = 6
    fm, bm = f / m, (b + f * remat) / m
    want = fm.sum() + (m - 1) * fm.max() + bm.sum() + (m - 1) * bm.max()
    assert T.iteration_time("gpipe", f, b, microbatches=m, remat=remat) == pytest.approx(want, abs=1e-9)


def test_gpipe_with_one_microbatch_and_no_remat_is_bp():
  f, b = unequal(3)
  assert T.iteration_time("gpipe", f, b, microbatches=1, remat=False) == pytest.approx(
    T.iteration_time("bp", f, b), abs=1e-12
  )


def test_decoupled_closed_forms_and_fr_never_beats_ddg():
  for seed in range(5):
    f, b = unequal(seed)
    p = np.full_like(f, 0.3)
    assert T.iteration_time("ddg", f, b) == pytest.approx(f.sum() + b.max())
    assert T.iteration_time("fr", f, b) == pytest.approx(f.sum() + (f + b).max())
    assert T.iteration_time("dni", f, b, predictor_K=p) == pytest.approx(f.sum() + (b + p).max())
    assert T.iteration_time("dni", f, b) == T.iteration_time("ddg", f, b)
    assert T.iteration_time("fr", f, b) >= T.iteration_time("ddg", f, b)


def test_order_of_stages_does_not_change_bp_ddg_fr_dsp():
  f, b = unequal(1)
  perm = np.random.default_rng(0).permutation(f.size)
  for m in ("bp", "ddg", "fr", "dsp"):
    assert T.iteration_time(m, f[perm], b[perm]) == pytest.approx(T.iteration_time(m, f, b))


def test_dsp_is_limited_by_its_slowest_stage():
  f, b = [1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0]
  assert T.iteration_time("dsp", f, b, fused=True) == 9.0
  assert T.iteration_time("dsp", f, b) == 12.0  # unfused, the default: the recompute is its own call
  assert T.speedup_vs_bp("dsp", f, b, fused=True) == pytest.approx(18 / 9)  # far from K = 4
  assert T.steady_spacing(T.simulate("dsp", f, b, 100, fused=True)) == pytest.approx(9.0, abs=1e-9)
  assert T.steady_spacing(T.simulate("dsp", f, b, 100)) == pytest.approx(12.0, abs=1e-9)


@pytest.mark.parametrize("method", T.METHODS)
@pytest.mark.parametrize("fused", [True, False])
def test_simulated_spacing_equals_iteration_time(method, fused):
  for f, b in (equal(4), unequal(2), unequal(7, k=3)):
    kw = dict(microbatches=3, fused=fused, remat=fused)
    times = T.simulate(method, f, b, 120, **kw)
    assert np.all(np.diff(times) > 0)
    assert T.steady_spacing(times, warmup=20) == pytest.approx(T.iteration_time(method, f, b, **kw), abs=1e-6)


def test_fixed_straggler_bp_grows_by_the_stage_extra_work():
  f, b = unequal(4)
  k, s = 2, 3.0
  base = T.steady_spacing(T.simulate("bp", f, b, 50))
  slowed = T.steady_spacing(T.simulate("bp", f, b, 50, straggler_stage=k, slowdown=s))
  assert slowed - base == pytest.approx((s - 1) * (f[k] + b[k]), abs=1e-9)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fixed_straggler_dsp_runs_at_the_straggler_pace(stage):
  f, b = equal(4)
  s = 3.0
  times = T.simulate("dsp", f, b, 200, fused=True, straggler_stage=stage, slowdown=s)
  assert T.steady_spacing(times) == pytest.approx(s * (f[0] + b[0]), abs=1e-9)
  times = T.simulate("dsp", f, b, 200, fused=False, straggler_stage=stage, slowdown=s)
  assert T.steady_spacing(times) == pytest.approx(s * (2 * f[0] + b[0]), abs=1e-9)


def test_dsp_slack_absorbs_a_straggler_that_bp_pays_for():
  # Stage 2 has half the others' work: slowing it 1.5x stays under the slowest stage.
  f, b = [1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 1.0, 2.0]
  kw = dict(straggler_stage=2, slowdown=1.5)
  rep = T.straggler_report(f, b, num_iters=200, methods=("bp", "dsp"), **kw)
  assert rep["dsp"]["ratio"] == pytest.approx(1.0, abs=1e-9)
  assert rep["bp"]["slowed"] - rep["bp"]["base"] == pytest.approx(0.5 * 1.5, abs=1e-9)


def test_random_slowdowns_are_deterministic_under_a_seed():
  f, b = unequal(5)
  kw = dict(random_p=0.2, slowdown=2.5)
  for m in T.METHODS:
    a = T.simulate(m, f, b, 60, seed=3, **kw)
    np.testing.assert_array_equal(a, T.simulate(m, f, b, 60, seed=3, **kw))
    assert not np.array_equal(a, T.simulate(m, f, b, 60, seed=4, **kw))
    # p = 1 slows every stage every iteration: time scales exactly by the slowdown.
    np.testing.assert_allclose(
      T.simulate(m, f, b, 60, random_p=1.0, slowdown=2.5), 2.5 * T.simulate(m, f, b, 60), rtol=1e-12
    )


def test_random_slowdowns_cost_dsp_less_than_a_lockstep_tick():
  # Equal stages, each slowed w.p. p per tick. A lockstep pipeline waits for the slowest stage every
  # tick: 1 + (s-1)(1-(1-p)^K). DSP couples only neighbours one tick apart, so it pays less, and
  # never less than one stage's own mean 1 + (s-1) p; BP pays exactly that mean.
  k, p, s = 8, 0.1, 3.0
  f, b = equal(k)
  rep = T.straggler_report(f, b, num_iters=3000, methods=("bp", "dsp"), random_p=p, slowdown=s)
  lockstep = 1 + (s - 1) * (1 - (1 - p) ** k)
  assert 1 + (s - 1) * p < rep["dsp"]["ratio"] < lockstep
  assert rep["bp"]["ratio"] == pytest.approx(1 + (s - 1) * p, abs=0.05)
  assert rep["dsp"]["speedup"] > 0.5 * k


def test_one_f_one_b_runs_k_minus_1_minus_k_ticks_between_a_batch_s_forward_and_backward():
  """Unit work: every stage's tick takes F + B = 2, and stage 0's first backward (a tick after the
  last stage's first tick) ends once the forward has crossed every stage and the gradient came back."""
  K, n = 3, 6
  ends = T.one_f_one_b(np.ones((n, K)), np.ones((n, K)))
  np.testing.assert_allclose(np.diff(ends[2:], axis=0), 2.0)  # steady: one F and one B a tick
  assert ends[0, 2] == 3 + 1  # the last stage: three forwards in a row, then its backward
  assert ends[1, 1] == ends[0, 2] + 1  # stage 1's backward of batch 0 waits for it, tick 1
  assert ends[2, 0] == ends[1, 1] + 1  # stage 0's, at tick 2 = K-1-0


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="unknown method"):
    T.iteration_time("pipedream_2bw", [1.0], [2.0])
  with pytest.raises(ValueError, match="equal-length"):
    T.iteration_time("bp", [1.0, 1.0], [2.0])
  with pytest.raises(ValueError, match="straggler_stage"):
    T.simulate("dsp", [1.0], [2.0], 5, straggler_stage=3, slowdown=2.0)


def _stage(forward=0.0, backward=0.0, fused=0.0, update=0.0, lower=None, upper=None):
  calls = {k: v for k, v in dict(forward=forward, backward=backward, fused=fused, update=update).items() if v}
  links = {k: v for k, v in dict(lower=lower, upper=upper).items() if v is not None}
  return {"median_s": calls, "transfer_s": links}


def test_runtime_model_charges_the_calls_each_method_makes():
  x = 0.01  # one transfer on the link
  two = [_stage(forward=1.0, backward=2.0, upper=x), _stage(forward=0.5, backward=3.0, lower=x)]
  assert T.runtime_iteration("bp", two) == pytest.approx(1.0 + 2.0 + 0.5 + 3.0 + 2 * x)
  # The 1F1B methods (and ddg, fr as this runtime runs them): each stage one forward and one backward
  # a tick, so the slower stage's calls set the pace; transfers run beside compute.
  for m in ("fr", "ddg", "pipedream", "pipemare"):
    assert T.runtime_iteration(m, two) == pytest.approx(max(1.0 + 2.0, 0.5 + 3.0))
  # A transfer longer than the slack it has joins the two-tick cycle F0 -> stage 1 -> B0.
  slow = [_stage(forward=1.0, backward=2.0, upper=2.0), _stage(forward=0.5, backward=3.0, lower=2.0)]
  assert T.runtime_iteration("pipedream", slow) == pytest.approx((1.0 + 2.0 + 3.5 + 2.0 + 2.0) / 2)
  # DSP: every stage busy every tick, one swap per link it has; the slower stage sets the pace.
  assert T.runtime_iteration("dsp", two) == pytest.approx(max(1.0 + 2.0, 0.5 + 3.0) + x)
  fused = [_stage(fused=4.0, upper=x), _stage(forward=0.5, backward=3.0, lower=x)]
  assert T.runtime_iteration("dsp", fused) == pytest.approx(4.0 + x)
  # GPipe, M micro-batch calls: one micro-batch and no transfers is the plain chain plus the update.
  gp = [_stage(forward=1.0, backward=2.0, update=0.1, upper=0.0), _stage(backward=3.0, update=0.2, lower=0.0)]
  assert T.runtime_iteration("gpipe", gp, microbatches=1) == pytest.approx(1.0 + 3.0 + 2.0 + 0.2)
  with pytest.raises(ValueError, match="dni"):
    T.runtime_iteration("dni", two)


def test_runtime_with_stragglers_from_a_calm_run():
  x = 0.01
  two = [_stage(forward=1.0, backward=2.0, upper=x), _stage(forward=0.5, backward=2.5, lower=x)]
  calm = np.ones((40, 2))
  for m in ("dsp", "pipedream", "bp"):  # no slowdown: the calm model's iteration
    assert T.runtime_with_stragglers(m, two, calm) == pytest.approx(T.runtime_iteration(m, two), rel=1e-9)
  slow = calm.copy()
  slow[:, 1] = 3.0  # stage 1 three times slower every tick: it sets the pace alone
  assert T.runtime_with_stragglers("dsp", two, slow) == pytest.approx(3 * 3.0 + x)
  assert T.runtime_with_stragglers("pipedream", two, slow) == pytest.approx(3 * 3.0)
  assert T.runtime_with_stragglers("bp", two, slow) == pytest.approx(3.0 + 3 * 3.0 + 2 * x)
  # One slow tick in two, alternating between the stages: slack (delay 2) absorbs what lockstep pays.
  alt = np.ones((40, 2))
  alt[0::2, 0] = alt[1::2, 1] = 3.0
  lock = T.runtime_with_stragglers("dsp", two, alt, delay=1, slack=False)
  loose = T.runtime_with_stragglers("dsp", two, alt, delay=2, slack=True)
  assert lock == pytest.approx(9.0 + x)  # every tick waits for that tick's slow stage
  assert loose < lock and loose == pytest.approx((9.0 + 3.0) / 2 + x, rel=0.05)


def test_straggler_factor_is_one_draw_of_seed_tick_and_stage():
  assert T.straggler_factor(0, 1, 5, 3.0, stage=1) == 3.0 and T.straggler_factor(0, 0, 5, 3.0, stage=1) == 1.0
  hits = np.mean([T.straggler_factor(7, k, t, 3.0, p=0.2) == 3.0 for t in range(3000) for k in range(2)])
  assert abs(hits - 0.2) < 0.02
  assert T.straggler_factor(7, 0, 5, 1.0, p=1.0) == 1.0  # no slowdown, no straggler


def test_the_per_tick_overhead_is_paid_where_each_method_pays_a_tick():
  x, o = 0.01, 0.05
  two = [_stage(forward=1.0, backward=2.0, upper=x), _stage(forward=0.5, backward=3.0, lower=x)]
  # BP: every stage's tick in turn; DSP and 1F1B (calls the critical path holds): once a tick.
  assert T.runtime_iteration("bp", two, overhead_s=o) == pytest.approx(T.runtime_iteration("bp", two) + 2 * o)
  assert T.runtime_iteration("dsp", two, overhead_s=o) == pytest.approx(max(3.0, 3.5) + x + o)
  assert T.runtime_iteration("pipedream", two, overhead_s=o) == pytest.approx(3.5 + o)
  fused = [_stage(fused=4.0, upper=x), _stage(forward=0.5, backward=3.0, lower=x)]
  assert T.runtime_iteration("dsp", fused, overhead_s=o) == pytest.approx(4.0 + x + o)
  gp = [_stage(forward=1.0, backward=2.0, update=0.1, upper=0.0), _stage(backward=3.0, update=0.2, lower=0.0)]
  assert T.runtime_iteration("gpipe", gp, microbatches=1, overhead_s=o) == pytest.approx(6.2 + 4 * o / 2)
  # tick_overhead inverts it: the overhead a measured iteration implies, for every method.
  for m, st in (("bp", two), ("dsp", fused), ("pipedream", two), ("fr", two), ("gpipe", gp)):
    measured = T.runtime_iteration(m, st, overhead_s=0.0123)
    assert T.tick_overhead(m, st, measured) == pytest.approx(0.0123, abs=1e-9)
  assert T.tick_overhead("dsp", fused, 4.0 + x - 0.02) == pytest.approx(-0.02, abs=1e-9)
