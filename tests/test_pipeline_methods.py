"""The method registry (pipeline/methods.py): its invariants, and every record through what reads it: the
validator, docs/config.md, the step tables and one tick in one process."""

import os

import jax
import numpy as np
import optax
import pytest

from configs import dsp as dsp_config
from ripples_jax.config import ConfigError, validate_dsp_config
from ripples_jax.pipeline import baselines, devices, methods, timing
from ripples_jax.pipeline import tick as tick_lib
from tests.test_pipeline_dsp import B, mlp_stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = methods.names()
# What each placement's validation needs of the job (a device per stage; a process per stage).
JOB = {"one_device": {}, "devices": {"local_devices": 8}, "per_process": {"num_processes": 2}}


def config_of(name, placement="one_device"):
  c = dsp_config.get_config(f"method={name},num_stages=2,dataset=synthetic,model=mlp")
  c.placement, c.batch_size = placement, B
  return c


def test_records_are_consistent():
  assert len(set(NAMES)) == len(NAMES) and NAMES == tuple(methods.BY_NAME)
  shapes = (
    methods.SEQUENTIAL,
    methods.FLUSH,
    methods.SCHEDULED,
    methods.GLOBAL_STEP,
    methods.ONE_F_ONE_B,
    methods.UNLOCKED,
  )
  for m in methods.REGISTRY:
    assert m.placements and set(m.placements) <= set(methods.PLACEMENTS), m
    assert set(m.ticks_in) <= set(m.placements), m
    ticks = any(m.runs_tick(p) for p in m.placements)
    assert (m.delays is not None) == ticks == (m.ring is not None), m  # a schedule where it ticks
    if m.delays is not None:
      assert len(m.delays) == 2 and all(
        d == methods.DELAY or (isinstance(d, int) and d >= 0) for d in m.delays
      )
      assert m.ring in tick_lib.MODES + (tick_lib.CORRECTED,), m
    assert m.process_ring in (None,) + tick_lib.PROCESS_MODES, m
    assert m.iteration in shapes and m.backward in (None, methods.KEPT, methods.RECOMPUTE, methods.SYNTHETIC)
    assert m.step in baselines.STEPS, m  # its whole-model step (or the tick's) in one process
    if "devices" in m.placements:
      assert m.step_in("devices") in devices.STEPS, m
  with pytest.raises(KeyError, match="not registered: one of bp, gpipe"):
    methods.get("nope")


@pytest.mark.parametrize("name", NAMES)
def test_every_method_validates_where_it_runs_and_is_refused_elsewhere(name):
  m = methods.get(name)
  for placement, job in JOB.items():
    config = config_of(name, placement)
    if placement in m.placements:
      validate_dsp_config(config, **job)
      assert (baselines.schedule_of(config) is not None) == m.runs_tick(placement)
    else:
      with pytest.raises(ConfigError, match=f"^config.method: '{name}' is not allowed: one of "):
        validate_dsp_config(config, **job)


def test_docs_list_every_method():
  with open(os.path.join(ROOT, "docs", "config.md")) as f:
    row = next(line for line in f if line.startswith("| `method` |"))
  allowed = row.split(" | ")[2]
  assert allowed == "one of " + ", ".join(NAMES)


@pytest.mark.parametrize("placement", list(JOB))
def test_an_unknown_method_is_refused_in_one_line_naming_the_registry(placement):
  with pytest.raises(ConfigError) as e:
    validate_dsp_config(config_of("pipedream_2bw", placement), **JOB[placement])
  assert str(e.value) == f"config.method: 'pipedream_2bw' is not allowed: one of {', '.join(NAMES)}"


@pytest.mark.parametrize("name", NAMES)
def test_every_method_runs_a_tick_in_one_process(name):
  config = config_of(name)
  stages, opt = mlp_stages(2), optax.sgd(0.1)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, 8)).astype(np.float32)
  y = rng.integers(0, 4, size=B).astype(np.int32)
  init_fn, step_fn = baselines.METHODS[name]
  state = init_fn(stages, opt, config, jax.random.key(0), x, 4)
  state, (loss, acc) = step_fn(stages, opt, config, 4)(state, x, y, 0)
  assert np.isfinite(float(loss)) and 0 <= float(acc) <= 1
  # The timing model knows its shape: a finite modeled iteration on two unequal stages.
  assert np.isfinite(timing.iteration_time(name, [1.0, 2.0], [2.0, 3.0], predictor_K=[0.5, 0.0]))
