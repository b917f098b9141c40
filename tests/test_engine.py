"""The engine against references: single-model SGD, a per-worker numpy loop, exact equalities."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ripples_jax import collectives as C
from ripples_jax import engine
from ripples_jax.data import batch_at, load_dataset, shard_indices
from ripples_jax.models import apply_model, build_model, init_model
from ripples_jax.schedule.static import allreduce_layouts, static_gg_layouts

N, B = 8, 4


@pytest.fixture(scope="module")
def setup():
  data = load_dataset("synthetic", seed=0)
  shards = shard_indices(data["y_train"], N, "iid", seed=0)
  model = build_model("mlp", data["num_classes"], hidden=(16,))
  batches = [batch_at(data["x_train"], data["y_train"], shards, B, 0, s) for s in range(6)]
  return model, data, batches


def run_engine(model, data, batches, layouts, optimizer, impl="auto", n=N, mesh=None, masks=None):
  mesh = mesh or C.make_worker_mesh(n)
  state = engine.init_state(model, optimizer, jax.random.key(0), data["x_train"][:1], n, mesh)
  round_fn = engine.make_round_fn(model, optimizer, mesh, layouts, impl)
  for t, (x, y) in enumerate(batches):
    mask = np.ones(n, bool) if masks is None else masks[t]
    state, _ = round_fn(state, jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask), t % len(layouts))
  return jax.tree.map(np.asarray, state)


@pytest.mark.slow  # 4-7 s: the fast tier's 2 minutes (WORKSPACE.md section 41)
def test_allreduce_equals_single_model_sgd_on_the_concatenated_batch(setup):
  model, data, batches = setup
  opt = optax.sgd(0.1, momentum=0.9)  # momentum is linear, so averaging params = averaging gradients
  state = run_engine(model, data, batches, allreduce_layouts(N), opt)

  params, model_state = init_model(model, jax.random.key(0), data["x_train"][:1])
  opt_state = opt.init(params)
  for x, y in batches:

    def loss_fn(p):
      logits, _ = apply_model(model, p, model_state, x.reshape(N * B, -1), train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y.reshape(-1)).mean()

    updates, opt_state = opt.update(jax.grad(loss_fn)(params), opt_state, params)
    params = optax.apply_updates(params, updates)
  for w in range(N):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a[w], b, rtol=2e-5, atol=2e-6), state["params"], params
    )


def test_ripples_one_group_of_all_workers_equals_allreduce_exactly(setup):
  model, data, batches = setup
  one_node = static_gg_layouts(N, workers_per_node=N)  # a single node: its group is every worker
  assert one_node == allreduce_layouts(N)
  a = run_engine(model, data, batches, one_node, optax.sgd(0.1))
  b = run_engine(model, data, batches, allreduce_layouts(N), optax.sgd(0.1))
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("impl", ["collective", pytest.param("segment", marks=pytest.mark.slow)])
def test_static_gg_matches_a_per_worker_reference_loop(setup, impl):
  """Local step per worker (separately, unstacked), then x <- W x with the round's mixing matrix."""
  model, data, batches = setup
  layouts = static_gg_layouts(N, 4)
  opt = optax.sgd(0.1, momentum=0.9)
  state = run_engine(model, data, batches, layouts, opt, impl=impl)

  params, model_state = init_model(model, jax.random.key(0), data["x_train"][:1])
  ps = [params] * N
  os_ = [opt.init(params)] * N
  for t, (x, y) in enumerate(batches):
    for w in range(N):

      def loss_fn(p):
        logits, _ = apply_model(model, p, model_state, x[w], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[w]).mean()

      u, os_[w] = opt.update(jax.grad(loss_fn)(ps[w]), os_[w], ps[w])
      ps[w] = optax.apply_updates(ps[w], u)
    W = C.mixing_matrix(layouts[t % len(layouts)], N)
    stacked = jax.tree.map(lambda *a: np.stack(a), *ps)
    mixed = jax.tree.map(lambda a: np.tensordot(W, a, axes=1), stacked)
    ps = [jax.tree.map(lambda a: a[w], mixed) for w in range(N)]
  ref = jax.tree.map(lambda *a: np.stack(a), *ps)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), state["params"], ref)
  # the optimizer state stays local: momenta differ across workers
  assert not np.allclose(
    state["opt_state"][0].trace["Dense_0"]["kernel"][0], state["opt_state"][0].trace["Dense_0"]["kernel"][1]
  )


def test_sixteen_workers_on_eight_devices_match_the_segment_reference(setup):
  """Two workers per device (the simulation placement) give the same result as 16 on one device."""
  model, data, _ = setup
  shards = shard_indices(data["y_train"], 16, "iid", seed=0)
  batches = [batch_at(data["x_train"], data["y_train"], shards, B, 0, s) for s in range(4)]
  layouts = static_gg_layouts(16, 4)
  on_8 = run_engine(model, data, batches, layouts, optax.sgd(0.1), n=16)
  on_1 = run_engine(
    model, data, batches, layouts, optax.sgd(0.1), n=16, mesh=C.make_worker_mesh(16, jax.devices()[:1])
  )
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), on_8, on_1)


def test_masked_workers_keep_their_state_exactly(setup):
  model, data, batches = setup
  alone = (tuple((i,) for i in range(N)),)  # no averaging: only the mask acts
  masks = [np.arange(N) % 2 == 0] * len(batches)
  opt = optax.sgd(0.1, momentum=0.9)
  state = run_engine(model, data, batches, alone, opt, masks=masks)
  params0 = run_engine(model, data, [], alone, opt)["params"]
  for w in range(N):
    same = all(
      np.array_equal(a[w], b[w]) for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params0))
    )
    assert same == (w % 2 == 1)


def test_switching_layouts_does_not_recompile_the_round(setup, compile_counter):
  model, data, batches = setup
  layouts = static_gg_layouts(N, 4) + static_gg_layouts(N, 2)  # 8 layouts, 7 distinct
  opt = optax.sgd(0.1)
  mesh = C.make_worker_mesh(N)
  for impl in ("collective", "segment"):
    state = engine.init_state(model, opt, jax.random.key(0), data["x_train"][:1], N, mesh)
    round_fn = engine.make_round_fn(model, opt, mesh, layouts, impl)
    x, y = (jnp.asarray(a) for a in batches[0])
    mask = jnp.ones(N, bool)
    state, _ = round_fn(state, x, y, mask, 0)
    seen = len(compile_counter)
    for t in range(1, 3 * len(layouts)):
      state, loss = round_fn(state, x, y, mask, t % len(layouts))
    loss.block_until_ready()
    assert len(compile_counter) == seen, impl


def test_eval_reports_consensus_distance(setup):
  model, data, batches = setup
  opt = optax.sgd(0.1)
  alone = (tuple((i,) for i in range(N)),)
  state = run_engine(model, data, batches, alone, opt)
  ev = engine.make_eval_fn(model)(state, data["x_test"], data["y_test"])
  flat = np.concatenate([a.reshape(N, -1) for a in jax.tree.leaves(state["params"])], axis=1)
  expect = np.mean(np.linalg.norm(flat - flat.mean(0), axis=1))
  np.testing.assert_allclose(float(ev["consensus_distance"]), expect, rtol=1e-4)
  assert expect > 0
  assert 0 <= float(ev["test_accuracy"]) <= 1


@pytest.mark.slow  # in process, too long for the fast tier
def test_eval_in_chunks_is_the_whole_test_set_and_workers_use_its_head(setup, monkeypatch):
  """The averaged model is scored over the whole test set chunk by chunk (the chunks' means weighted
  by their sizes), each worker on the first WORKER_EVAL_EXAMPLES examples, WORKER_CHUNK at a time."""
  model, data, batches = setup
  alone = (tuple((i,) for i in range(N)),)
  state = run_engine(model, data, batches, alone, optax.sgd(0.1))
  x, y = data["x_test"], data["y_test"]
  whole = engine.make_eval_fn(model)(state, x, y)
  monkeypatch.setattr(engine, "EVAL_CHUNK", 7)  # uneven chunks, a short last one
  monkeypatch.setattr(engine, "WORKER_EVAL_EXAMPLES", 40)
  monkeypatch.setattr(engine, "WORKER_CHUNK", 3)
  got = engine.make_eval_fn(model)(state, x, y)
  np.testing.assert_allclose(float(got["test_accuracy"]), float(whole["test_accuracy"]), rtol=1e-6)
  np.testing.assert_allclose(float(got["test_loss"]), float(whole["test_loss"]), rtol=1e-5)
  per_worker = []
  for w in range(N):
    p = jax.tree.map(lambda a: a[w], state["params"])
    ms = jax.tree.map(lambda a: a[w], state["model_state"])
    logits, _ = apply_model(model, p, ms, x[:40], train=False)
    per_worker.append(np.mean(np.argmax(np.asarray(logits), -1) == y[:40]))
  np.testing.assert_allclose(float(got["worker_test_accuracy"]), np.mean(per_worker), rtol=1e-6)


# Golden values (nanodo-style canary): one Static GG round of the default algorithm from seed 0.
# Update them ONLY when a change of numerics is intended, and say so in the commit message.
CANARY_LOSS = 1.7944014072418213
CANARY_PARAM_RMS = 0.23883309960365295


def test_canary_one_static_gg_round(setup):
  model, data, batches = setup
  mesh = C.make_worker_mesh(N)
  opt = optax.sgd(0.1, momentum=0.9)
  state = engine.init_state(model, opt, jax.random.key(0), data["x_train"][:1], N, mesh)
  round_fn = engine.make_round_fn(model, opt, mesh, static_gg_layouts(N, 4), "auto")
  x, y = batches[0]
  state, loss_W = round_fn(state, jnp.asarray(x), jnp.asarray(y), jnp.ones(N, bool), 0)
  loss = float(np.mean(loss_W))
  rms = float(
    np.sqrt(np.mean(np.concatenate([np.asarray(a).ravel() ** 2 for a in jax.tree.leaves(state["params"])])))
  )
  message = "numerics changed: update the canary only when a change of numerics is intended"
  np.testing.assert_allclose(loss, CANARY_LOSS, rtol=1e-5, err_msg=message)
  np.testing.assert_allclose(rms, CANARY_PARAM_RMS, rtol=1e-5, err_msg=message)
