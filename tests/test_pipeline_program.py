"""placement=spmd: the pipeline as one jitted program over a stage axis computes one_device's tick
(pipeline/program.py), its timetable satisfies every link, and a run of any length compiles once."""

import jax
import numpy as np
import optax
import pytest

from ripples_jax.pipeline import program
from ripples_jax.pipeline import tick as tick_lib
from tests.test_pipeline_dsp import batches, drive, mlp_stages

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
  stages, opt = mlp_stages(K), optax.sgd(0.1, momentum=0.9)
  schedule = tick_lib.method_schedule(method, K, delay, mode, lr_anneal=5)
  bs = batches(data, 10)
  init = lambda: tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), bs[0][0])
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
