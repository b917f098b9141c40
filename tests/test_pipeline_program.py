"""placement=spmd: the pipeline as one jitted program over a stage axis computes one_device's tick
(pipeline/program.py), its timetable satisfies every link, and a run of any length compiles once."""

import jax
import numpy as np
import optax
import pytest

from ripples_jax.pipeline import program
from ripples_jax.pipeline import tick as tick_lib
from tests.test_pipeline_dsp import batches, drive, mlp_stages, tick_case

CASES = [  # (method, mode, delay, K): every tick method, both ring modes, a longer link, a third stage
  ("dsp", "recompute", 1, 2),
  ("ddg", None, 1, 2),
  ("pipedream", None, 1, 3),
  ("dsp", "stash", 1, 2),
  ("dsp", "recompute", 2, 3),
  ("pipemare", None, 1, 2),
  ("fr", None, 1, 2),
]


@pytest.fixture(scope="module")
def data():
  from ripples_jax.data import load_dataset

  return load_dataset("synthetic", seed=0, num_train=256, num_test=64)


def run_program(stages, opt, schedule, bs, ticks, init):
  """The program over every batch of `bs` and the drain, `ticks` a dispatch: (stage trees, losses)."""
  state = program.spmd_state(init(), program.timetable(schedule))
  prog = program.Program(stages, opt, schedule, state, jax.devices(), ticks=ticks)
  end = len(bs) + schedule.drain_ticks()
  x_of = lambda t: bs[t][0] if t < len(bs) else np.zeros_like(bs[0][0])
  labels_of = lambda i: bs[min(max(i, 0), len(bs) - 1)][1]
  bufs, outs = prog.advance(prog.place(state), 0, end, x_of, labels_of, len(bs))
  return prog.state(bufs), program.losses_of(outs), prog


@pytest.mark.parametrize(
  "method,mode,delay,K", CASES[:2] + [pytest.param(*c, marks=pytest.mark.slow) for c in CASES[2:]]
)
def test_the_program_computes_the_one_device_tick(data, method, mode, delay, K):
  stages, opt, schedule, bs, init = tick_case(data, method, mode, delay, K)
  one, losses = tick_lib.make_tick(stages, opt, schedule, len(bs)), []

  def logged(state, x, y, t):
    state, (loss, _) = one(state, x, y, t)
    losses.append((t, float(loss)))
    return state, None

  want = drive(logged, init(), schedule, bs)
  got, got_losses, _ = run_program(stages, opt, schedule, bs, 4, init)  # 4 does not divide the ticks
  for k, (g, w) in enumerate(zip(got, want)):
    assert set(g) - {"up_ring", "down_ring"} == set(w) - {"fwd_fifo", "bwd_fifo"}, k
    for key in set(g) & set(w):
      for a, b in zip(jax.tree.leaves(g[key]), jax.tree.leaves(w[key])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"stage {k} {key}")
  if method == "dsp":  # DSP's link rings hold what its FIFOs held: d ticks a link
    assert tick_lib.stored_bytes(got) == tick_lib.stored_bytes(want)
  # The last stage's loss of every tick, as the tick's (NaN where no batch's backward ran).
  assert [t for t, _, _ in got_losses] == [t for t, _ in losses]
  np.testing.assert_array_equal([loss for _, loss, _ in got_losses], [loss for _, loss in losses])


def test_timetables_of_the_methods():
  """DSP: one fused unit a tick, no skew; a locked forward: 1F1B's lockstep, stage k a unit later."""
  dsp = program.timetable(tick_lib.method_schedule("dsp", 4, 1, "recompute"))
  assert (dsp.period, dsp.fwd_unit, dsp.extra_units) == (1, (0, 0, 0, 0), 0)
  assert dsp.up_len == (0, 1, 1, 1) and dsp.down_len == (1, 1, 1, 0)  # d = 1: one tick a link
  pd = program.timetable(tick_lib.method_schedule("pipedream", 4))
  assert (pd.period, pd.fwd_unit, pd.bwd_unit, pd.extra_units) == (2, (0, 1, 2, 3), (1, 2, 3, 4), 3)
  with pytest.raises(ValueError, match="f \\+ b >= 1"):
    program.timetable(tick_lib.method_schedule("bp", 2))


@pytest.mark.parametrize("name", ["dsp", "pipedream"])
def test_every_link_is_read_after_its_arrival_and_before_its_slot_is_reused(name):
  """The timetable's invariant, checked by enumerating sends and reads over many ticks: the read of
  sender tick t - f happens after that arrival (unit > send unit) and before the send that reuses
  its ring slot (t - f + L)."""
  for K in (2, 3, 4):
    for delay in (1, 2, 3):
      sch = tick_lib.method_schedule(name, K, delay, "recompute")
      tab = program.timetable(sch)
      P = tab.period
      for j in range(K - 1):
        for t in range(10, 30):
          src, read = t - sch.fwd_delays[j], P * t + tab.fwd_unit[j + 1]
          assert P * src + tab.fwd_unit[j] < read < P * (src + tab.up_len[j + 1]) + tab.fwd_unit[j] + 1
          src, read = t - sch.bwd_delays[j], P * t + tab.bwd_unit[j]
          assert P * src + tab.bwd_unit[j + 1] < read < P * (src + tab.down_len[j]) + tab.bwd_unit[j + 1] + 1


def test_a_run_of_any_length_compiles_once(data, compile_counter):
  stages, opt = mlp_stages(2), optax.sgd(0.1, momentum=0.9)
  schedule = tick_lib.method_schedule("pipedream", 2)
  bs = batches(data, 12)
  init = lambda: tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), bs[0][0])
  state = program.spmd_state(init(), program.timetable(schedule))
  prog = program.Program(stages, opt, schedule, state, jax.devices(), ticks=3)
  x_of = lambda t: bs[t][0] if t < len(bs) else np.zeros_like(bs[0][0])
  labels_of = lambda i: bs[min(max(i, 0), len(bs) - 1)][1]
  bufs = prog.place(state)
  bufs, _ = prog.advance(bufs, 0, 2, x_of, labels_of, len(bs))  # the compile
  before = len(compile_counter)
  for t0, t1, n in [(2, 9, 12), (9, 13, 12), (0, 5, 4), (5, 7, 4)]:  # other spans, another run length
    bufs, outs = prog.advance(bufs, t0, t1, x_of, labels_of, n)
  jax.block_until_ready(bufs)
  assert len(compile_counter) == before


# ----------------------------------------------------------------------------------------------------
# The flush methods: GPipe, 1F1B, ZB-H1.


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (4, 4), (8, 16), (3, 7)])
def test_flush_timetables_have_the_published_lengths_and_memory(K, M):
  """With F, B and W one unit each: 1F1B's step is 3M + 3(K-1) units, ZB-H1's 3M + (K-1), a third
  of 1F1B's bubble; ZB-H1 holds at most K micro-batches on any stage (1F1B's peak), 1F1B K-k on stage
  k. Every op runs once, after what it reads."""
  from ripples_jax.pipeline import flush

  tables = {m: flush.timetable(m, K, M) for m in flush.METHODS}
  assert tables["1f1b"].units == 3 * M + 3 * (K - 1)
  assert tables["zbh1"].units == 3 * M + K - 1
  assert [tables["1f1b"].in_flight(k) for k in range(K)] == [min(K - k, M) for k in range(K)]
  assert max(tables["zbh1"].in_flight(k) for k in range(K)) == min(K, M)
  for name, t in tables.items():
    when = {(k, kind): t.when(k, kind) for k in range(K) for kind in (flush.F, flush.B, flush.W)}
    for k in range(K):
      for m in range(M):
        f, b, w = (when[(k, kind)][m] for kind in (flush.F, flush.B, flush.W))
        assert f < b < w, (name, k, m)
        if k > 0:
          assert when[(k - 1, flush.F)][m] < f
        if k < K - 1:
          above = flush.W if name == "1f1b" else flush.B
          assert when[(k + 1, above)][m] < b


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (8, 16)])
def test_the_timing_model_runs_the_same_orders(K, M):
  """timing.scheduled_iteration on K equal stages with B = 2F (W half of it: F, B and W equal) takes
  the published step lengths: 1F1B (3M + 3(K-1)) F / M, ZB-H1 (3M + (K-1)) F / M."""
  from ripples_jax.pipeline import timing

  f, b = [1.0] * K, [2.0] * K
  assert timing.iteration_time("1f1b", f, b, microbatches=M) == pytest.approx((3 * M + 3 * (K - 1)) / M)
  assert timing.iteration_time("zbh1", f, b, microbatches=M) == pytest.approx((3 * M + K - 1) / M)


@pytest.mark.slow
def test_the_split_backward_is_the_vjp():
  """B (input gradient, saving the cotangents W needs) then W (weight gradient) equal jax.vjp of a
  stage with convolutions and BatchNorm, at the forward's weights."""
  from ripples_jax.models import apply_model, init_model, split
  from ripples_jax.pipeline import flush, pipemare

  stage = split.split_model("resnet20", 10, 2, sample_shape=(8, 8, 3), widths=(4,))[0]
  x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype(np.float32)
  params, ms = init_model(stage, jax.random.key(1), x)
  fn = lambda p, x: apply_model(stage, p, ms, x, train=True)[0]
  y, pull = jax.vjp(fn, params, x)
  cot = np.random.default_rng(1).normal(size=y.shape).astype(np.float32)
  want_p, want_x = pull(cot)
  spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
  plan = pipemare.make_plan(stage, spec(params), spec(ms), spec(x))
  _, kept = pipemare.forward(plan, params, ms, x)
  g_x, saved = flush.backward_input(plan, params, kept, cot)
  g_p = flush.backward_weights(plan, params, kept, saved)
  np.testing.assert_allclose(g_x, want_x, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(want_p)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def flush_run(stages, opt, method, bs, M, init):
  prog = program.FlushProgram(stages, opt, method, init(), jax.devices(), M, steps=2)
  bufs = prog.place(prog.initial)
  xs, ys = np.stack([b[0] for b in bs] + [bs[0][0]]), np.stack([b[1] for b in bs] + [bs[0][1]])
  bufs, first = prog.run(bufs, xs[:2], ys[:2], 2)
  bufs, then = prog.run(bufs, xs[2:4], ys[2:4], 1)  # a dispatch of one step of two
  return prog.state(bufs), np.concatenate([np.asarray(first), np.asarray(then)[:1]])


@pytest.mark.parametrize(
  "method,K",
  [("zbh1", 2)]
  + [pytest.param(m, k, marks=pytest.mark.slow) for m, k in [("zbh1", 3), ("1f1b", 3), ("gpipe", 2)]],
)
def test_flush_programs_update_as_bp_on_the_whole_batch(data, method, K):
  """A step of GPipe, 1F1B or ZB-H1 in the program is BP on the whole batch with micro-batches
  (baselines.make_gpipe_step, the one-device reference): parameters, optimizer state, losses."""
  from ripples_jax.pipeline import baselines

  stages, opt, M = mlp_stages(K), optax.sgd(0.1, momentum=0.9), 4
  bs = batches(data, 3)
  init = lambda: tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", K), jax.random.key(0), bs[0][0]
  )
  want, step, losses = init(), baselines.make_gpipe_step(stages, opt, M), []
  for x, y in bs:
    want, (loss, _) = step(want, x, y)
    losses.append(float(loss))
  got, sums = flush_run(stages, opt, method, bs, M, init)
  np.testing.assert_allclose(sums[:, 0], losses, rtol=1e-6)
  for g, w in zip(got, want):
    for key in ("params", "opt_state", "model_state"):
      for a, b in zip(jax.tree.leaves(g[key]), jax.tree.leaves(w[key])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.nightly  # the slow tier has the split on a ResNet stage (test_the_split_backward_is_the_vjp)
def test_flush_programs_on_a_resnet_with_batchnorm(data):
  """Convolutions, BatchNorm's model state chained through the micro-batches, GPipe's recompute."""
  from ripples_jax.models import split
  from ripples_jax.pipeline import baselines

  stages = split.split_model("resnet20", 10, 2, sample_shape=(8, 8, 3), widths=(4,))
  opt, M = optax.sgd(0.05, momentum=0.9), 2
  rng = np.random.default_rng(0)
  bs = [
    (rng.normal(size=(8, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int32))
    for _ in range(3)
  ]
  init = lambda: tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", 2), jax.random.key(0), bs[0][0]
  )
  want, step = init(), baselines.make_gpipe_step(stages, opt, M)
  for x, y in bs:
    want, _ = step(want, x, y)
  for method in ("zbh1", "gpipe"):
    got, _ = flush_run(stages, opt, method, bs, M, init)
    for g, w in zip(got, want):
      for key in ("params", "model_state"):
        for a, b in zip(jax.tree.leaves(g[key]), jax.tree.leaves(w[key])):
          np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=method)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pipedream", pytest.param("zbh1", marks=pytest.mark.nightly)])
def test_a_spmd_run_records_what_the_one_device_run_records(tmp_path, method):
  """experiments.train_dsp's loop with placement=spmd (dispatches read back at records only) against
  placement=one_device: the same records (train loss, test accuracy and loss at every eval), the
  tick methods bit for bit, a flush method to float tolerance (BP's step with micro-batches)."""
  import json

  from configs import dsp as dsp_config
  from ripples_jax import run as run_lib

  got = {}
  for placement in ("one_device", "spmd"):
    c = dsp_config.get_config(f"method={method},num_stages=2,dataset=synthetic,model=mlp,epochs=1")
    c.batch_size, c.log_every, c.eval_every, c.spmd_ticks, c.placement = 32, 2, 4, 3, placement
    c.split = "macs"
    run_lib.train_and_evaluate(c, str(tmp_path / placement))
    got[placement] = [json.loads(line) for line in open(tmp_path / placement / "metrics.jsonl")]
  one, spmd = got["one_device"], got["spmd"]
  assert [r["step"] for r in spmd] == [r["step"] for r in one] == list(range(2, 17, 2))
  for a, b in zip(one, spmd):
    assert set(a) == set(b)
    for key in ("train_loss", "test_accuracy", "test_loss"):
      if key in a and method == "pipedream":
        assert b[key] == a[key], (key, a["step"])
      elif key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5)


def test_the_program_loop_stops_at_every_record():
  """The spmd loop's next stop standing at a tick: the first later multiple of log_every or
  eval_every past the batches every stage has applied, or the end (a run with log_every=1 records its
  first batch; with a drain of 1, tick 3 has applied 2 batches)."""
  from types import SimpleNamespace

  from ripples_jax.pipeline.train import _next_record

  c = SimpleNamespace(log_every=1, eval_every=5)
  assert [_next_record(c, t, 0, 3) for t in (0, 1, 2)] == [1, 2, 3]
  assert [_next_record(c, t, 1, 3) for t in (0, 1, 2, 3)] == [1, 1, 2, 3]
  c = SimpleNamespace(log_every=4, eval_every=6)
  assert [_next_record(c, t + 1, 1, 13) for t in (0, 4, 6, 8, 12)] == [4, 6, 8, 12, 13]


def test_the_gpu_script_stops_in_one_line_without_a_gpu_backend(tmp_path):
  """benchmarks/gpu_pipeline_spmd.sh on a machine whose jax has no GPU backend (this one): exit 1,
  one line saying so, nothing run."""
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    ["bash", os.path.join(root, "benchmarks", "gpu_pipeline_spmd.sh")],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 1
  assert out.stdout.strip().splitlines() == [
    "gpu_pipeline_spmd: jax has no GPU backend here (install jax[cuda12] of requirements.txt's version)"
  ]
  assert os.listdir(tmp_path / "out") == ["failed.txt"]
