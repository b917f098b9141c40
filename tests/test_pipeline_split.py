"""Pipeline split: the stages compose to the unsplit model, params map across, the split is balanced."""

import functools
import itertools
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import dsp as dsp_config
from ripples_jax.errors import ConfigError
from ripples_jax.models import MODEL_NAMES, apply_model, build_model, init_model, num_params, profile, split
from ripples_jax.pipeline import inputs as pipeline_inputs
from ripples_jax.runlog import records

B = 2
INPUTS = {
  "mlp": (40, 1),
  "mlp_gelu": (40, 1),
  "cnn1d": (40, 1),
  "cnn2d": (8, 8, 1),
  "resnet20": (32, 32, 3),
  "rescnn": (32, 32, 3),
}
MAX_STAGES = {"mlp": 3, "mlp_gelu": 3, "cnn1d": 4, "cnn2d": 4, "resnet20": 11, "resnet56": 29, "rescnn": 10}

# Tests check values, not speed: one jit per call with XLA's costly CPU passes off.
# Inits are the slow compiles (~2.5 s for ResNet-20), so most tests init the unsplit
# model once and lay its params out as the stages' (`params_from_model`).
_jit = functools.partial(
  jax.jit, compiler_options={"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
)


def _shapes(tree):
  return jax.tree.map(lambda a: tuple(a.shape), tree)


def _x(name):
  # numpy, not jax.random: eager jax ops compile one by one.
  return jnp.asarray(np.random.default_rng(7).normal(size=(B,) + INPUTS[name]), jnp.float32)


@functools.lru_cache(maxsize=None)
def _unsplit(name):
  """The unsplit model's (params, model_state, eval-mode logits) on _x(name)."""
  model = build_model(name, 10)

  def run(x):
    p, s = init_model(model, jax.random.key(42), x)
    return p, s, apply_model(model, p, s, x, train=False)[0]

  return _jit(run)(_x(name))


def _layout(stages, x):
  """Per-stage (params, model_state) as ShapeDtypeStructs: init traced, not run."""
  params, states = [], []
  for stage in stages:
    p, s = jax.eval_shape(lambda x, stage=stage: init_model(stage, jax.random.key(0), x), x)
    x, _ = jax.eval_shape(functools.partial(apply_model, stage, train=False), p, s, x)
    params.append(p)
    states.append(s)
  return params, states


def _from_model(name, layout_params, layout_states, model_params, model_state):
  """The model's params and batch_stats laid out as the stages'."""
  params = split.params_from_model(name, model_params, layout_params)
  if not model_state:
    return params, [{}] * len(params)
  stats = split.params_from_model(name, model_state["batch_stats"], [s["batch_stats"] for s in layout_states])
  return params, [{"batch_stats": bs} for bs in stats]


def _compose(stages, params, states, x, train=False):
  """Stage k applied to stage k-1's output; returns (logits, new model_states)."""

  def compose(params, states, x):
    new_states = []
    for stage, p, s in zip(stages, params, states):
      x, s = apply_model(stage, p, s, x, train=train)
      new_states.append(s)
    return x, new_states

  return _jit(compose)(params, states, x)


def _tree_equal(a, b):
  return jax.tree.structure(a) == jax.tree.structure(b) and jax.tree.all(
    jax.tree.map(lambda u, v: np.array_equal(np.asarray(u), np.asarray(v)), a, b)
  )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_max_stages_is_the_unit_count(name):
  assert split.max_stages(name) == len(split.model_units(name, 10)) == MAX_STAGES[name]


def test_units_follow_model_kwargs():
  assert split.max_stages("mlp", hidden=(8, 8, 8)) == 4
  assert split.max_stages("cnn1d", features=(8,)) == 2
  assert split.max_stages("cnn2d", features=(8, 8, 8)) == 5
  assert split.model_units("resnet20", 10, widths=(4, 8, 16))[-2].features == 16


@pytest.mark.parametrize(
  "name,k",
  [
    pytest.param(n, k, marks=pytest.mark.slow if n.startswith("res") else ())
    for n in INPUTS
    for k in range(1, 5)
    if k <= MAX_STAGES[n]
  ],
)
def test_stages_compose_to_the_unsplit_model(name, k):
  x = _x(name)
  model_params, model_state, want = _unsplit(name)
  stages = split.split_model(name, 10, k)
  assert len(stages) == k and all(stage.units for stage in stages)
  layout, layout_states = _layout(stages, x)
  assert sum(num_params(p) for p in layout) == num_params(model_params)
  params, states = _from_model(name, layout, layout_states, model_params, model_state)
  assert _shapes(params) == _shapes(layout)
  assert _tree_equal(split.params_to_model(params), model_params)
  logits, _ = _compose(stages, params, states, x)
  assert logits.shape == (B, 10)
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  shapes = split.stage_shapes(stages, x)
  assert len(shapes) == k and shapes[-1] == (B, 10)


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=pytest.mark.slow if n.startswith("res") else ()) for n in MODEL_NAMES]
)
def test_one_stage_is_the_whole_model(name):
  (stage,) = split.split_model(name, 10, 1)
  assert len(stage.units) == MAX_STAGES[name]
  x = jax.ShapeDtypeStruct((B,) + split.DEFAULT_SAMPLE_SHAPES[name], jnp.float32)
  init = lambda m: jax.eval_shape(lambda x: init_model(m, jax.random.key(0), x), x)
  (p, s), (mp, ms) = init(stage), init(build_model(name, 10))
  # Same layers, same shapes, under the same names (batch_stats too).
  assert _shapes(split.params_to_model([p])) == _shapes(mp)
  if ms:
    assert _shapes(split.params_to_model([s["batch_stats"]])) == _shapes(ms["batch_stats"])


@pytest.mark.parametrize(
  "name,k", [("mlp", 2), ("cnn1d", 2), ("cnn2d", 2), pytest.param("resnet20", 3, marks=pytest.mark.slow)]
)
def test_stage_init_is_the_model_init(name, k):
  """Stages initialised on their own draw each layer from the model's distribution."""
  x = _x(name)
  stages = split.split_model(name, 10, k)

  def init(x):
    params = []
    for i, stage in enumerate(stages):
      p, s = init_model(stage, jax.random.key(i), x)
      x, _ = apply_model(stage, p, s, x, train=False)
      params.append(p)
    return params, x

  params, logits = _jit(init)(x)
  assert logits.shape == (B, 10)
  model_params = _unsplit(name)[0]

  def close(a, b):
    np.testing.assert_allclose(np.std(a), np.std(b), rtol=0.25)
    np.testing.assert_allclose(np.mean(a), np.mean(b), atol=0.25 * np.std(b) + 1e-7)

  jax.tree.map(close, split.params_to_model(params), model_params)


@pytest.mark.slow  # in process, too long for the fast tier
def test_resnet20_stages_in_train_mode_are_the_model_and_update_batchnorm():
  x = _x("resnet20") * 2.0 + 1.0
  model = build_model("resnet20", 10)
  mp, ms, _ = _unsplit("resnet20")
  mp = jax.tree.map(lambda a: a + 0.01, mp)  # BN scale and bias off their init too.
  want, want_state = _jit(functools.partial(apply_model, model, train=True))(mp, ms, x)
  stages = split.split_model("resnet20", 10, 3)
  params, states = _from_model("resnet20", *_layout(stages, x), mp, ms)
  got, new_states = _compose(stages, params, states, x, train=True)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  got_stats = split.params_to_model([s["batch_stats"] for s in new_states])
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_stats, want_state["batch_stats"]
  )
  for before, after in zip(states, new_states):
    assert set(after) == {"batch_stats"}
    # Every BatchNorm's running mean and var moved.
    assert all(
      jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), before, after))
    )
  _, eval_states = _compose(stages, params, states, x, train=False)
  assert _tree_equal(eval_states, states)


@pytest.mark.parametrize("name", ["mlp", "resnet20"])
def test_bad_num_stages_raise_one_line(name):
  n = MAX_STAGES[name]
  with pytest.raises(ValueError) as e:
    split.split_model(name, 10, n + 1)
  assert str(e.value) == f"num_stages: {n + 1} is not allowed: {name} splits into at most {n} stages"
  with pytest.raises(ValueError) as e:
    split.split_model(name, 10, 0)
  assert str(e.value) == f"num_stages: 0 is not allowed: {name} splits into 1 to {n} stages"


def test_mlp_message_as_documented():
  with pytest.raises(ValueError, match="^num_stages: 9 is not allowed: mlp splits into at most 3 stages$"):
    split.split_model("mlp", 10, 9)


def test_resnets_split_at_stage_boundaries_when_k_is_3():
  for name, n in [("resnet20", 3), ("resnet56", 9)]:
    stages = split.split_model(name, 10, 3)
    assert [len(s.units) for s in stages] == [1 + n, n, n + 1]
  stages = split.split_model("resnet20", 10, 3)
  assert split.stage_shapes(stages, jnp.zeros((B, 32, 32, 3))) == [(B, 32, 32, 16), (B, 16, 16, 32), (B, 10)]


def test_rescnn_blocks_cost_alike_and_split_evenly_at_k_2_and_4():
  # The speed model of the pipeline benchmarks: 8 blocks of equal MACs (the stride-2 block 3/4 of one)
  # between a small stem and head, cut at the width change for K=2.
  units = split.model_units("rescnn", 10)
  costs = split.unit_costs(units, (32, 32, 3))
  block = 2 * 16 * 16 * 9 * 16 * 16
  assert costs[1:9] == [block] * 4 + [3 * block // 4] + [block] * 3
  assert costs[0] < block / 10 and costs[-1] < block / 1000
  assert split.partition(costs, 2, [5]) == [(0, 5), (5, 10)]
  ranges = split.partition(costs, 4, [5])
  assert [sum(costs[a:b]) / sum(costs) for a, b in ranges] == pytest.approx([0.25] * 4, abs=0.06)
  x = jnp.zeros((B, 32, 32, 3))
  assert split.stage_shapes(split.split_model("rescnn", 10, 2), x) == [(B, 16, 16, 16), (B, 10)]


def test_unit_costs_are_macs():
  # MLP: 40*256, 256*256, 256*10; a ResNet-20 block is two 32x32x16 convs; stride 2 -> 3/4.
  assert split.unit_costs(split.model_units("mlp", 10), (40, 1)) == [10240, 65536, 2560]
  costs = split.unit_costs(split.model_units("resnet20", 10), (32, 32, 3))
  block = 2 * 32 * 32 * 9 * 16 * 16
  assert costs[1] == block and costs[4] == costs[7] == 3 * block // 4 and costs[-1] == 640


def _bottleneck(costs, ranges):
  return max(sum(costs[a:b]) for a, b in ranges)


def test_partition_is_contiguous_and_minimises_the_bottleneck():
  rng = random.Random(0)
  for _ in range(200):
    n = rng.randint(1, 8)
    costs = [rng.randint(1, 20) for _ in range(n)]
    k = rng.randint(1, n)
    ranges = split.partition(costs, k)
    assert len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    brute = min(
      _bottleneck(costs, list(zip((0,) + c, c + (n,)))) for c in itertools.combinations(range(1, n), k - 1)
    )
    assert _bottleneck(costs, ranges) == brute


def test_partition_prefers_cuts_within_slack():
  costs = [10, 1, 10, 10]
  assert split.partition(costs, 2) == [(0, 2), (2, 4)]  # bottleneck 20
  assert split.partition(costs, 2, preferred=[3]) == [(0, 3), (3, 4)]  # 21 <= 20 * 1.1
  assert split.partition(costs, 2, preferred=[3], slack=0.0) == [(0, 2), (2, 4)]
  assert split.partition([1, 1, 1, 1], 2, preferred=[1]) == [(0, 2), (2, 4)]  # 3 > 2.2


# ---------------------------------------------------------------------------------------------------
# The split by measured time (models/profile.py), cached per machine, pinned per run (pipeline/inputs.py).


def test_unit_times_measure_every_unit():
  units = split.model_units("mlp", 10)
  times = profile.unit_times(units, (40, 1), batch_size=8, reps=3, warmup=1)
  assert len(times) == len(units) and all(t > 0 for t in times)


def test_write_json_once_keeps_the_first_writer(tmp_path):
  path = str(tmp_path / "sub" / "x.json")
  assert records.write_json_once(path, lambda: {"a": 1}) == {"a": 1}
  assert records.write_json_once(path, lambda: {"a": 2}) == {"a": 1}  # not rewritten
  assert json.load(open(path)) == {"a": 1} and os.listdir(tmp_path / "sub") == ["x.json"]


def _fake_times(monkeypatch, costs, calls, forward=None):
  """profile.unit_times returning `costs` (forward=True: `forward`, default a third of each)."""

  def fake(units, sample_shape, batch_size, **kw):
    if kw.get("forward"):
      return list(forward) if forward is not None else [c / 3 for c in costs]
    calls.append(len(units))
    return list(costs)

  monkeypatch.setattr(profile, "unit_times", fake)


def test_measured_costs_are_cached_and_a_run_keeps_its_split(tmp_path, monkeypatch):
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path / "cache"))
  config = dsp_config.get_config("model=cnn2d,num_stages=2")
  calls = []
  _fake_times(monkeypatch, [1.0, 1.0, 1.0, 3.0], calls, forward=[0.0] * 4)  # the head is the costly unit
  shape = (8, 8, 1)
  run = str(tmp_path / "run")
  os.makedirs(run)
  first = pipeline_inputs.split_stages(config, 10, shape, run)
  assert [len(s.units) for s in first] == [3, 1] and calls == [4]
  assert pipeline_inputs.split_stages(config, 10, shape) and calls == [4]  # cached: not measured again
  # Another machine (a new cache) measures other costs: a fresh split follows them, the run keeps its own.
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path / "cache2"))
  _fake_times(monkeypatch, [3.0, 1.0, 1.0, 1.0], calls, forward=[0.0] * 4)
  assert [len(s.units) for s in pipeline_inputs.split_stages(config, 10, shape)] == [1, 3]
  assert [len(s.units) for s in pipeline_inputs.split_stages(config, 10, shape, run)] == [3, 1]
  assert json.load(open(os.path.join(run, "split.json")))["ranges"] == [[0, 3], [3, 4]]


def test_a_run_from_before_pinned_splits_resumes_with_the_macs_split(tmp_path, monkeypatch):
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path / "cache"))
  _fake_times(monkeypatch, [1.0, 1.0, 1.0, 30.0], [])
  config = dsp_config.get_config("model=cnn2d,num_stages=2")
  monkeypatch.setattr(pipeline_inputs, "newest_meta", lambda workdir: {"step": 1})  # it holds a checkpoint
  got = pipeline_inputs.split_stages(config, 10, (32, 32, 3), str(tmp_path))
  macs = split.split_model("cnn2d", 10, 2, sample_shape=(32, 32, 3))
  assert [s.units for s in got] == [s.units for s in macs]
  assert json.load(open(tmp_path / "split.json"))["split"] == "macs"


def test_a_pinned_split_of_another_run_is_refused_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path / "cache"))
  _fake_times(monkeypatch, [1.0, 1.0, 1.0, 3.0], [])
  run = str(tmp_path / "run")
  os.makedirs(run)
  pipeline_inputs.split_stages(dsp_config.get_config("model=cnn2d,num_stages=2"), 10, (8, 8, 1), run)
  with pytest.raises(
    ConfigError, match=r"split.json holds the split of cnn2d into 2 stages, not cnn2d into 3"
  ):
    pipeline_inputs.split_stages(dsp_config.get_config("model=cnn2d,num_stages=3"), 10, (8, 8, 1), run)


def test_the_last_stage_has_costs_of_its_own():
  # Four equal units; below the last stage each costs 2 (a recompute runs its forward again), in the
  # last 1: one unit below and three in the last (bottleneck 3) beats two and two (4).
  assert split.partition([2, 2, 2, 2], 2, last_costs=[1, 1, 1, 1]) == [(0, 1), (1, 4)]
  assert split.partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
  assert split.partition([2, 2, 2, 2, 2], 3, last_costs=[1] * 5) == [(0, 1), (1, 2), (2, 5)]
  assert split.method_costs([3.0, 6.0], [1.0, 2.0], recomputes=True) == ([4.0, 8.0], [3.0, 6.0])
  assert split.method_costs([3.0, 6.0], [1.0, 2.0], recomputes=False) == ([3.0, 6.0], [3.0, 6.0])


@pytest.mark.parametrize(
  "method,mode,placement,want",
  [
    ("dsp", "recompute", "one_device", [1, 3]),  # below the last: forward + forward again + backward
    ("gpipe", "recompute", "one_device", [1, 3]),  # its remat
    ("pipemare", "recompute", "one_device", [2, 2]),  # the forward's activations kept
    ("dsp", "residuals", "per_process", [2, 2]),  # the vjp kept
    ("pipedream", "recompute", "per_process", [2, 2]),  # its stored graph (residuals per process)
    ("pipedream", "recompute", "one_device", [1, 3]),  # stash: recomputed at the stashed weights
  ],
)
def test_the_split_balances_each_methods_own_work(tmp_path, monkeypatch, method, mode, placement, want):
  """Four units of equal forward + backward time, the forward alone as much (so a recompute doubles
  a unit's cost below the last stage): a recomputing method puts one unit below and three in the
  last stage; a method that keeps what its backward needs splits two and two."""
  monkeypatch.setenv("RIPPLES_JAX_CACHE", str(tmp_path / "cache"))
  config = dsp_config.get_config(f"model=cnn2d,num_stages=2,method={method},mode={mode}")
  config.placement = placement
  _fake_times(monkeypatch, [1.0] * 4, [], forward=[1.0] * 4)
  assert [len(s.units) for s in pipeline_inputs.split_stages(config, 10, (8, 8, 1))] == want
