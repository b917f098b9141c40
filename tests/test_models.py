"""Model zoo: output shapes, param counts, vmap over workers, BatchNorm state, learning."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ripples_jax.models import MODEL_NAMES, CifarResNet, apply_model, build_model, init_model, num_params
from ripples_jax.models.simple import conv1d_patches

# Natural input per model (batch 2) and expected param-count range for 10 classes.
CASES = {
  "mlp": ((2, 40, 1), 70_000, 90_000),  # MNIST-1D input, 256-256 hidden.
  "mlp_gelu": ((2, 40, 1), 70_000, 90_000),
  "cnn1d": ((2, 40, 1), 5_000, 50_000),
  "cnn2d": ((2, 8, 8, 1), 20_000, 100_000),  # 8x8 digits.
  "resnet20": ((2, 32, 32, 3), 260_000, 280_000),  # He et al. 2016: 0.27M.
  "resnet56": ((2, 32, 32, 3), 840_000, 870_000),  # He et al. 2016: 0.85M.
  "rescnn": ((2, 32, 32, 3), 88_714, 88_714),  # 8 blocks (16, 32 wide) with biases, no BatchNorm.
}

# Tests check values, not speed: skip XLA's costly CPU optimizations. Compiling
# RNG-heavy inits (e.g. ResNet-20) drops from ~12 s to ~2 s this way.
_jit = functools.partial(
  jax.jit, compiler_options={"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
)


def _init(model, seed, x):
  return _jit(lambda k: init_model(model, k, x))(jax.random.key(seed))


def _apply_fn(model, train):
  """Jitted (params, state, x) -> (logits, state); reuse it to avoid recompiles."""
  return _jit(functools.partial(apply_model, model, train=train))


def _tiny_resnet():
  # Depth 8 (one block per stage) on 8x8 inputs: ResNet-20's code paths, cheap.
  return CifarResNet(num_classes=10, depth=8)


def _xent(logits, y):
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


def test_model_names_cover_cases():
  assert set(MODEL_NAMES) == set(CASES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_param_counts(name):
  shape, lo, hi = CASES[name]
  model = build_model(name, 10)
  # eval_shape: no compile, no compute; enough for counts and structure.
  params, state = jax.eval_shape(lambda: init_model(model, jax.random.key(0), jnp.zeros(shape)))
  assert lo <= num_params(params) <= hi
  assert set(state) == ({"batch_stats"} if name.startswith("resnet") else set())


@pytest.mark.slow  # in process, too long for the fast tier
def test_mlp_gelu_is_the_mlp_with_gelu():
  x = jax.random.normal(jax.random.key(1), (3, 40, 1))
  params, _ = init_model(build_model("mlp", 10), jax.random.key(0), x)
  got = build_model("mlp_gelu", 10).apply({"params": params}, x)
  h = x.reshape(3, -1)
  for layer in ("Dense_0", "Dense_1"):
    h = jax.nn.gelu(h @ params[layer]["kernel"] + params[layer]["bias"])
  want = h @ params["Dense_2"]["kernel"] + params["Dense_2"]["bias"]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_resnet20_exact_param_count():
  # Option-A shortcuts add no params: 269,722 for 10 classes.
  model = build_model("resnet20", 10)
  params, _ = jax.eval_shape(lambda: init_model(model, jax.random.key(0), jnp.zeros((2, 32, 32, 3))))
  assert num_params(params) == 269_722


@pytest.mark.parametrize(
  "name,shape",
  [("mlp", (4, 40, 1)), ("cnn1d", (4, 40, 1)), ("cnn2d", (4, 8, 8, 1)), ("cnn2d", (4, 32, 32, 3))],
)
def test_small_model_logits_shape(name, shape):
  model = build_model(name, 7)
  x = jnp.ones(shape)
  params, state = _init(model, 0, x)
  assert state == {}
  # Both modes in one compile; `train` is accepted and ignored.
  both = _jit(lambda p, s, x: [apply_model(model, p, s, x, train=t) for t in (False, True)])
  (l_eval, s_eval), (l_train, s_train) = both(params, state, x)
  assert l_eval.shape == l_train.shape == (shape[0], 7)
  np.testing.assert_allclose(l_eval, l_train, rtol=1e-6)
  assert s_eval == s_train == {}


@pytest.mark.parametrize("length,k,stride,c", [(40, 5, 2, 1), (20, 5, 2, 3), (5, 5, 2, 2), (9, 4, 3, 2)])
def test_conv1d_patches_is_same_conv(length, k, stride, c):
  # CNN1D's patches @ kernel must equal a SAME-padded strided conv.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, length, c)).astype(np.float32)
  kernel = rng.normal(size=(k, c, 6)).astype(np.float32)
  ref = jax.lax.conv_general_dilated(x, kernel, (stride,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
  out = conv1d_patches(jnp.asarray(x), k, stride) @ kernel.reshape(k * c, 6)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # in process, too long for the fast tier
def test_resnet20_forward_backward_and_batchnorm_state():
  model = build_model("resnet20", 10)
  x = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  y = jnp.array([3, 5])
  params, state = _init(model, 0, x)

  def loss_fn(p):
    logits, new_state = apply_model(model, p, state, x, train=True)
    return _xent(logits, y), (logits, new_state)

  (loss, (logits, new_state)), grads = _jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  assert logits.shape == (2, 10)
  assert np.isfinite(loss)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  # Train mode moves every running stat away from its init (mean 0, var 1).
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), state, new_state)
  assert all(jax.tree.leaves(changed))


def test_resnet_bad_depth_raises():
  for depth in (19, 21, 2, 0):
    with pytest.raises(ValueError, match="6n"):
      CifarResNet(num_classes=10, depth=depth)
  CifarResNet(num_classes=10, depth=56)  # 6*9+2: fine.


def test_unknown_model_raises():
  with pytest.raises(ValueError, match="resnet20"):
    build_model("vgg16", 10)


@pytest.mark.slow  # in process, too long for the fast tier
def test_batchnorm_eval_returns_state_unchanged_and_uses_running_stats():
  model = _tiny_resnet()
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
  params, state = _init(model, 0, x)

  @_jit  # One compile for all four calls.
  def run(params, state, x):
    _, new_state = apply_model(model, params, state, x, train=True)
    logits_new, same = apply_model(model, params, new_state, x, train=False)
    logits_old, _ = apply_model(model, params, state, x, train=False)
    sub, _ = apply_model(model, params, new_state, x[:1], train=False)
    return new_state, same, logits_new, logits_old, sub

  new_state, same, logits_new, logits_old, sub = run(params, state, x)
  jax.tree.map(np.testing.assert_array_equal, same, new_state)
  # Eval output follows the running stats...
  assert not np.allclose(logits_new, logits_old)
  # ...not the batch: a sub-batch gives the same logits.
  np.testing.assert_allclose(sub, logits_new[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "name,shape",
  [
    ("mlp", (4, 40, 1)),
    ("cnn1d", (4, 40, 1)),
    pytest.param("cnn2d", (4, 8, 8, 1), marks=pytest.mark.slow),
    pytest.param("tiny_resnet", (4, 8, 8, 3), marks=pytest.mark.slow),
  ],
)
def test_vmap_over_stacked_workers_matches_per_worker(name, shape):
  model = _tiny_resnet() if name == "tiny_resnet" else build_model(name, 10)
  k = 3
  # Distinct params per worker (vmapped init), so a mixed-up worker axis would show.
  keys = jax.random.split(jax.random.key(0), k)
  params, state = _jit(jax.vmap(lambda key: init_model(model, key, jnp.zeros(shape))))(keys)
  assert all(a.shape[0] == k for a in jax.tree.leaves((params, state)))
  xs = jax.random.normal(jax.random.key(9), (k,) + shape)
  # `train` only matters with BatchNorm; other models ignore it.
  modes = (False, True) if state else (True,)

  @_jit  # One compile: vmapped and per-worker applies side by side.
  def run(params, state, xs):
    out = {}
    for train in modes:
      fn = functools.partial(apply_model, model, train=train)
      out[train] = (
        jax.vmap(fn)(params, state, xs),
        [fn(*jax.tree.map(lambda a: a[i], (params, state, xs))) for i in range(k)],
      )
    return out

  for (logits, new_state), per_worker in run(params, state, xs).values():
    assert logits.shape == (k, shape[0], 10)
    for i, (l_i, ns_i) in enumerate(per_worker):
      np.testing.assert_allclose(logits[i], l_i, rtol=1e-4, atol=1e-5)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-4, atol=1e-6), new_state, ns_i)


def test_vmap_identical_copies():
  # Three stacked copies of the same params give three equal outputs.
  model = build_model("cnn1d", 10)
  x = jax.random.normal(jax.random.key(2), (4, 40, 1))
  params, state = _init(model, 0, x)
  stacked = jax.tree.map(lambda a: jnp.stack([a] * 3), params)
  logits, _ = _jit(jax.vmap(lambda p: apply_model(model, p, state, x, train=True)))(stacked)
  ref, _ = _apply_fn(model, True)(params, state, x)
  for i in range(3):
    np.testing.assert_allclose(logits[i], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "cnn1d"])
def test_sgd_overfits_tiny_batch(name):
  model = build_model(name, 10)
  x = jax.random.normal(jax.random.key(0), (16, 40, 1))
  y = jnp.arange(16) % 10
  params, state = _init(model, 1, x)

  def loss_fn(p):
    return _xent(apply_model(model, p, state, x, train=True)[0], y)

  @_jit
  def step(p):
    loss, g = jax.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

  losses = []
  for _ in range(30):
    params, loss = step(params)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
