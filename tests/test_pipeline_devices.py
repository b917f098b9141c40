"""placement=devices: stage k on device k of this process computes one_device's tick (the forced CPU
devices of the conftest stand for a host's GPUs or TPU chips)."""

import json
import os

import jax
import numpy as np
import optax
import pytest

from ripples_jax import run as run_lib
from ripples_jax.config import ConfigError, validate_dsp_config
from ripples_jax.pipeline import devices as devices_lib
from ripples_jax.pipeline import tick as tick_lib
from tests.test_pipeline_dsp import batches, drive, mlp_stages, tick_case

CASES = [  # (method, mode, delay, K): every tick method, both ring modes, a longer link, a third stage
  ("dsp", "recompute", 1, 2),
  ("dsp", "stash", 1, 2),
  ("dsp", "recompute", 2, 3),
  ("ddg", None, 1, 2),
  ("pipedream", None, 1, 3),
  ("pipemare", None, 1, 2),
  ("fr", None, 1, 2),
]


@pytest.fixture(scope="module")
def data():
  from ripples_jax.data import load_dataset

  return load_dataset("synthetic", seed=0, num_train=256, num_test=64)


@pytest.mark.parametrize(
  "method,mode,delay,K", CASES[:1] + [pytest.param(*c, marks=pytest.mark.slow) for c in CASES[1:]]
)
def test_stages_on_their_devices_compute_the_one_device_tick(data, method, mode, delay, K):
  stages, opt, schedule, bs, init = tick_case(data, method, mode, delay, K)
  want = drive(tick_lib.make_tick(stages, opt, schedule, len(bs)), init(), schedule, bs)

  devs = devices_lib.stage_devices(K)
  assert len({d.id for d in devs}) == K
  step = devices_lib.make_device_tick(stages, opt, schedule, len(bs), devs)
  got = drive(step, devices_lib.place(init(), devs), schedule, bs)
  for k, (g, w) in enumerate(zip(got, want)):
    # Every array of stage k stayed on device k: its programs ran there, its links landed there.
    assert {d for a in jax.tree.leaves(g) for d in a.devices()} == {devs[k]}, k
    assert set(g) == set(w)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"stage {k}")


@pytest.mark.parametrize("K", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gpipe_on_devices_computes_the_one_device_gpipe_step(data, K):
  """GPipe with stage k on device k: the single-device step's updates (BP on the whole batch) to float
  tolerance (separate programs per stage and micro-batch, so XLA may order the sums differently)."""
  from ripples_jax.pipeline import baselines

  stages, opt, M = mlp_stages(K), optax.sgd(0.1, momentum=0.9), 4
  bs = batches(data, 6)
  init = lambda: tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", K), jax.random.key(0), bs[0][0]
  )
  one, dev = baselines.make_gpipe_step(stages, opt, M), None
  devs = devices_lib.stage_devices(K)
  dev = devices_lib.make_device_gpipe(stages, opt, M, devs)
  want, got = init(), devices_lib.place(init(), devs)
  for t, (x, y) in enumerate(bs):
    want, (wl, wa) = one(want, x, y)
    got, (gl, ga) = dev(got, x, y, t)
    np.testing.assert_allclose(float(gl), float(wl), rtol=1e-6)
    assert float(ga) == pytest.approx(float(wa))
  for k, (g, w) in enumerate(zip(got, want)):
    assert {d for a in jax.tree.leaves(g) for d in a.devices()} == {devs[k]}, k
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=f"stage {k}")


@pytest.mark.slow
def test_gpipe_on_devices_carries_batchnorm_statistics_as_the_one_device_step():
  """A BatchNorm model (ResNet-20 at one width of 4 channels: a stem, three blocks and a head, K=2): each micro-batch's forward sees the statistics the
  one before it left, and its recompute sees the same; the running statistics after every step equal
  the single-device step's."""
  from ripples_jax.models import split
  from ripples_jax.pipeline import baselines

  stages = split.split_model("resnet20", 10, 2, sample_shape=(8, 8, 3), widths=(4,))
  opt, M, K = optax.sgd(0.05, momentum=0.9), 2, 2
  rng = np.random.default_rng(0)
  bs = [(rng.normal(size=(8, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(3)]
  init = lambda: tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", K), jax.random.key(0), bs[0][0]
  )
  one, devs = baselines.make_gpipe_step(stages, opt, M), devices_lib.stage_devices(K)
  dev = devices_lib.make_device_gpipe(stages, opt, M, devs)
  want, got = init(), devices_lib.place(init(), devs)
  assert all(st["model_state"] for st in want)
  for t, (x, y) in enumerate(bs):
    want, _ = one(want, x, y)
    got, _ = dev(got, x, y, t)
  for g, w in zip(got, want):
    for key in ("model_state", "params"):
      for a, b in zip(jax.tree.leaves(g[key]), jax.tree.leaves(w[key])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.slow  # the fast tier's devices case is the unfused tick's; this one is 2.3 s
@pytest.mark.parametrize("delay,K", [(2, 2), (1, 3)])
def test_the_fused_dsp_tick_computes_the_one_device_tick(data, delay, K):
  """DSP's tick as one program per stage (the arrivals pushed by the receiver's next program): after
  settle, one_device's state bit for bit, settled mid-run too (a record or checkpoint between ticks)."""
  stages, opt = mlp_stages(K), optax.sgd(0.1, momentum=0.9)
  schedule = tick_lib.method_schedule("dsp", K, delay)
  assert devices_lib.fusable(schedule) and not devices_lib.fusable(tick_lib.method_schedule("pipedream", K))
  bs = batches(data, 8)
  init = lambda: tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), bs[0][0])
  want = drive(tick_lib.make_tick(stages, opt, schedule, len(bs)), init(), schedule, bs)
  devs = devices_lib.stage_devices(K)
  step = devices_lib.make_fused_device_tick(stages, opt, schedule, len(bs), devs)
  got, off = devices_lib.place(init(), devs), schedule.offsets[-1]
  for t in range(len(bs) + schedule.drain_ticks()):
    x = bs[t][0] if t < len(bs) else np.zeros_like(bs[0][0])
    got, _ = step(got, x, bs[min(max(t - off, 0), len(bs) - 1)][1], t)
    if t == 3:
      got = step.settle(got)
  got = step.settle(got)
  for k, (g, w) in enumerate(zip(got, want)):
    assert {d for a in jax.tree.leaves(g) for d in a.devices()} == {devs[k]}, k
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"stage {k}")
  assert devices_lib.dispatches_per_tick(schedule, fused=True) == K + 2 * (K - 1)


def dsp_config(**kw):
  from configs import dsp as dsp_config_lib

  c = dsp_config_lib.get_config("method=dsp,num_stages=2,model=mlp")
  for k, v in kw.items():
    setattr(c, k, v)
  return c


def test_devices_refuses_a_whole_model_method_and_more_stages_than_devices():
  with pytest.raises(
    ConfigError, match=r"config.method: 'bp' is not allowed: one of gpipe, ddg, .* with placement=devices"
  ):
    validate_dsp_config(dsp_config(placement="devices", method="bp"))
  validate_dsp_config(dsp_config(placement="devices", method="gpipe"))
  with pytest.raises(
    ConfigError, match=r"config.num_stages: 9 is not allowed: at most the 8 devices of this process"
  ):
    validate_dsp_config(dsp_config(placement="devices", num_stages=9, model="resnet56"))
  validate_dsp_config(dsp_config(placement="devices"))


@pytest.mark.slow
def test_a_devices_run_records_one_device_s_curve_and_resumes_from_a_checkpoint(tmp_path):
  """The entry point's library call with placement=devices: one_device's records (train loss, test
  accuracy and loss, epochs); then the run cut back to its first checkpoint (later checkpoints
  and the summary removed, as a kill leaves it) resumes onto the devices and writes the same records."""
  import shutil

  def train(placement, wd):
    c = dsp_config(placement=placement, num_epochs=2, log_every=25, eval_every=50, checkpoint_every=50)
    return run_lib.train_and_evaluate(c, str(wd))

  def records(wd):
    drop = ("time", "modeled_time")
    return [{k: v for k, v in json.loads(l).items() if k not in drop} for l in open(wd / "metrics.jsonl")]

  train("one_device", tmp_path / "one")
  train("devices", tmp_path / "dev")
  one, dev = records(tmp_path / "one"), records(tmp_path / "dev")
  assert len(dev) >= 4 and any("test_accuracy" in r for r in dev)
  assert dev == one  # the same numbers, bit for bit (the programs compute the tick's float order here)

  cut = tmp_path / "cut"
  shutil.copytree(tmp_path / "dev", cut)
  steps = sorted(int(d) for d in os.listdir(cut / "ckpt") if d.isdigit())
  assert len(steps) >= 2
  for step in steps[1:]:
    shutil.rmtree(cut / "ckpt" / str(step))
  os.remove(cut / "summary.json")
  train("devices", cut)
  assert records(cut) == dev  # resumed at steps[0] on the stages' devices, the rest redone the same


def test_the_dispatch_count_and_the_ceiling_the_benchmark_charges():
  from benchmarks.pipeline_devices import ceiling_s, one_core_per_stage_s

  # DSP, K=2: 4 stage programs, the batch and labels, a copy and a push per delayed link direction.
  assert devices_lib.dispatches_per_tick(tick_lib.method_schedule("dsp", 2)) == 10
  # PipeDream, K=3: 6 programs, batch and labels, 2 locked forward copies, 2 x (copy + push) down.
  assert devices_lib.dispatches_per_tick(tick_lib.method_schedule("pipedream", 3)) == 14
  costs = {"forward_s": [1.0, 0.5], "backward_s": [2.0, 1.0], "forward_all_s": [0.9, 0.3]}
  costs["backward_all_s"] = [1.5, 0.6]
  assert ceiling_s(costs, cores=2) == pytest.approx(2.4)  # the slower stage alone with every core
  assert ceiling_s(costs, cores=1) == pytest.approx(4.5)  # the single-core work on one core
  assert ceiling_s(dict(costs, microbatches=4), cores=2) == pytest.approx(5 * 2.4)  # M + K - 1 slots
  assert ceiling_s(dict(costs, microbatches=4), cores=1) == pytest.approx(4 * 4.5)
  assert one_core_per_stage_s(costs, cores=2) == 3.0  # the slower stage on one core
  assert one_core_per_stage_s(costs, cores=1) == 4.5  # one core runs both
  with pytest.raises(ConfigError, match="chunks: 3 is not allowed: a divisor of batch_size"):
    validate_dsp_config(dsp_config(placement="devices", method="pipedream", chunks=3))
  validate_dsp_config(dsp_config(placement="devices", method="pipedream", chunks=4))


@pytest.mark.slow  # three compiles
def test_stage_zero_never_computes_its_input_gradient(data):
  """Stage 0's backward program returns no input gradient, and XLA then computes none: its compiled
  flops are fewer than the same backward's that returns it (the tick's stage_backward)."""
  stages, opt = mlp_stages(2, width=64), optax.sgd(0.1, momentum=0.9)
  schedule = tick_lib.method_schedule("pipedream", 2)
  bs = batches(data, 2)
  state = tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), bs[0][0])
  program = devices_lib._stage_programs(stages[0], opt, schedule, 0, 2)[1]
  cot = np.ones((bs[0][0].shape[0], 64), np.float32)
  st, g_x, _ = program(jax.tree.map(lambda a: a.copy(), state[0]), cot, None, 1)
  assert g_x is None

  def with_input_gradient(st, cot, t):
    return tick_lib.stage_backward(stages[0], opt, schedule, 0, st, cot, None, t, 2)

  flops = lambda lowered: lowered.compile().cost_analysis()["flops"]
  without = flops(program.lower(state[0], cot, None, 1))
  assert without < flops(jax.jit(with_input_gradient).lower(state[0], cot, 1))
