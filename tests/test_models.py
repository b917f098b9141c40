"""Model zoo: output shapes, param counts, vmap over workers, BatchNorm state, learning."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ripples_jax.models import (
    MODEL_NAMES, CifarResNet, apply_model, build_model, init_model, num_params)

# Natural input per model (batch 2) and expected param-count range for 10 classes.
CASES = {
    "mlp": ((2, 40, 1), 70_000, 90_000),          # MNIST-1D input: 40*256+256*256+...
    "cnn1d": ((2, 40, 1), 5_000, 50_000),
    "cnn2d": ((2, 8, 8, 1), 20_000, 100_000),     # digits
    "resnet20": ((2, 32, 32, 3), 260_000, 280_000),  # He et al.: 0.27M
    "resnet56": ((2, 32, 32, 3), 840_000, 870_000),  # He et al.: 0.85M
}


def _init_shapes(name, shape, num_classes=10):
  model = build_model(name, num_classes)
  # eval_shape: no compile, no compute; enough for counts and structure.
  return model, jax.eval_shape(lambda: init_model(model, jax.random.key(0), jnp.zeros(shape)))


def test_model_names_cover_cases():
  assert set(MODEL_NAMES) == set(CASES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_param_counts(name):
  shape, lo, hi = CASES[name]
  _, (params, state) = _init_shapes(name, shape)
  assert lo <= num_params(params) <= hi
  assert set(state) == ({"batch_stats"} if name.startswith("resnet") else set())


def test_resnet20_exact_param_count():
  # Option-A shortcuts add no params: 269,722 for 10 classes.
  _, (params, _) = _init_shapes("resnet20", (2, 32, 32, 3))
  assert num_params(params) == 269_722


@pytest.mark.parametrize("name,shape", [
    ("mlp", (4, 40, 1)), ("cnn1d", (4, 40, 1)), ("cnn2d", (4, 8, 8, 1)),
    ("cnn2d", (4, 32, 32, 3))])
def test_small_model_logits_shape(name, shape):
  model = build_model(name, 7)
  x = jnp.ones(shape)
  params, state = init_model(model, jax.random.key(0), x)
  for train in (False, True):
    logits, new_state = apply_model(model, params, state, x, train=train)
    assert logits.shape == (shape[0], 7)
    assert new_state == {}


def test_resnet20_forward_backward_and_batchnorm_state():
  model = build_model("resnet20", 10)
  x = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  y = jnp.array([3, 5])
  params, state = init_model(model, jax.random.key(0), x)

  def loss_fn(p):
    logits, new_state = apply_model(model, p, state, x, train=True)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean(), (logits, new_state)

  (loss, (logits, new_state)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  assert logits.shape == (2, 10)
  assert np.isfinite(loss)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert num_params(grads) == num_params(params)
  # Train mode moves the running stats away from their init (mean 0, var 1).
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), state, new_state)
  assert all(jax.tree.leaves(changed))


def test_resnet_bad_depth_raises():
  for depth in (19, 21, 2, 0):
    with pytest.raises(ValueError):
      CifarResNet(num_classes=10, depth=depth)
  CifarResNet(num_classes=10, depth=56)  # 6*9+2: fine.


def test_unknown_model_raises():
  with pytest.raises(ValueError, match="resnet20"):
    build_model("vgg16", 10)


def _tiny_resnet():
  # depth 8 (one block per stage) on 8x8 input: same code paths as ResNet-20, cheap.
  return CifarResNet(num_classes=10, depth=8)


def test_batchnorm_eval_returns_state_unchanged_and_uses_running_stats():
  model = _tiny_resnet()
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
  params, state = init_model(model, jax.random.key(0), x)
  _, new_state = apply_model(model, params, state, x, train=True)
  logits_eval, same = apply_model(model, params, new_state, x, train=False)
  assert same is new_state
  # Eval output depends on the running stats, not on the batch.
  logits_eval_old, _ = apply_model(model, params, state, x, train=False)
  assert not np.allclose(logits_eval, logits_eval_old)
  # Eval is per-example: a sub-batch gives the same logits.
  sub, _ = apply_model(model, params, new_state, x[:1], train=False)
  np.testing.assert_allclose(sub, logits_eval[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,shape", [
    ("mlp", (4, 40, 1)), ("cnn1d", (4, 40, 1)), ("cnn2d", (4, 8, 8, 1)), ("tiny_resnet", (4, 8, 8, 3))])
def test_vmap_over_stacked_workers_matches_per_worker(name, shape):
  model = _tiny_resnet() if name == "tiny_resnet" else build_model(name, 10)
  k = 3
  # Distinct params per worker, so a mixed-up worker axis would show.
  inits = [init_model(model, jax.random.key(i), jnp.zeros(shape)) for i in range(k)]
  params = jax.tree.map(lambda *a: jnp.stack(a), *[p for p, _ in inits])
  state = jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in inits])
  xs = jax.random.normal(jax.random.key(9), (k,) + shape)
  for train in (False, True):
    f = jax.jit(jax.vmap(lambda p, s, x: apply_model(model, p, s, x, train=train)))
    logits, new_state = f(params, state, xs)
    assert logits.shape == (k, shape[0], 10)
    for i in range(k):
      p_i, s_i = jax.tree.map(lambda a: a[i], (params, state))
      l_i, ns_i = apply_model(model, p_i, s_i, xs[i], train=train)
      np.testing.assert_allclose(logits[i], l_i, rtol=1e-4, atol=1e-5)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-4, atol=1e-6),
                   new_state, ns_i)


def test_vmap_identical_copies():
  # The brief's form: 3 stacked copies of the same params give 3 equal outputs.
  model = build_model("cnn1d", 10)
  x = jax.random.normal(jax.random.key(2), (4, 40, 1))
  params, state = init_model(model, jax.random.key(0), x)
  stacked = jax.tree.map(lambda a: jnp.stack([a] * 3), params)
  logits, _ = jax.vmap(lambda p: apply_model(model, p, state, x, train=True))(stacked)
  ref, _ = apply_model(model, params, state, x, train=True)
  for i in range(3):
    np.testing.assert_allclose(logits[i], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "cnn1d"])
def test_sgd_overfits_tiny_batch(name):
  model = build_model(name, 10)
  x = jax.random.normal(jax.random.key(0), (16, 40, 1))
  y = jnp.arange(16) % 10
  params, state = init_model(model, jax.random.key(1), x)

  def loss_fn(p):
    logits, _ = apply_model(model, p, state, x, train=True)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()

  @jax.jit
  def step(p):
    loss, g = jax.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

  losses = []
  for _ in range(30):
    params, loss = step(params)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
