"""The DSP tick against references: SGD, BP, the schedule of docs/design.md 4.1, placement, stash,
convergence."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ripples_jax.data import load_dataset
from ripples_jax.models import apply_model, build_model, init_model
from ripples_jax.pipeline import baselines
from ripples_jax.pipeline import tick as tick_lib

B = 16


class Dense(nn.Module):
  """A stage for tests: one dense layer (tanh except on the logits): smooth, and cheap."""

  features: int
  last: bool = False

  @nn.compact
  def __call__(self, x, train=False):
    x = nn.Dense(self.features)(x.reshape(x.shape[0], -1))
    return x if self.last else jnp.tanh(x)


def mlp_stages(k, width=16, classes=4):
  return [Dense(width) for _ in range(k - 1)] + [Dense(classes, last=True)]


@pytest.fixture(scope="module")
def data():
  return load_dataset("synthetic", seed=0, num_train=256, num_test=64)


def batches(data, n, size=B):
  rng = np.random.default_rng(0)
  idx = [rng.choice(len(data["y_train"]), size, replace=False) for _ in range(n)]
  return [(data["x_train"][i], data["y_train"][i]) for i in idx]


def drive(tick, state, schedule, bs):
  """`state` after every batch of `bs` and the drain, through `tick` (any placement's)."""
  off = schedule.offsets[-1]
  for t in range(len(bs) + schedule.drain_ticks()):
    x = bs[t][0] if t < len(bs) else np.zeros_like(bs[0][0])
    y = bs[min(max(t - off, 0), len(bs) - 1)][1]
    state, _ = tick(state, x, y, t)
  return state


def tick_case(data, method, mode, delay, K, n=10):
  """A tick method's test case on MLP stages: (stages, optimizer, schedule, batches, a fresh init)."""
  stages, opt = mlp_stages(K), optax.sgd(0.1, momentum=0.9)
  schedule = tick_lib.method_schedule(method, K, delay, mode, lr_anneal=5)
  bs = batches(data, n)
  init = lambda: tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), bs[0][0])
  return stages, opt, schedule, bs, init


def run_ticks(stages, opt, schedule, bs):
  state = tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), bs[0][0])
  return drive(tick_lib.make_tick(stages, opt, schedule, len(bs)), state, schedule, bs)


def params_of(state):
  return [jax.tree.map(np.asarray, st["params"]) for st in state]


def bp_reference(stages, opt, bs, x0):
  bp = tick_lib.method_schedule("bp", len(stages))
  state = tick_lib.init_pipeline(stages, opt, bp, jax.random.key(0), x0)
  params = [st["params"] for st in state]
  ms = [st["model_state"] for st in state]
  opt_states = [opt.init(p) for p in params]
  for x, y in bs:

    def loss(ps):
      logits, _ = baselines.compose(stages, ps, ms, x, train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    g = jax.grad(loss)(params)
    for k in range(len(stages)):
      u, opt_states[k] = opt.update(g[k], opt_states[k], params[k])
      params[k] = optax.apply_updates(params[k], u)
  return [jax.tree.map(np.asarray, p) for p in params]


def test_schedule_matches_design():
  s = tick_lib.method_schedule("dsp", 3)
  assert s.staleness == (4, 2, 0) and s.offsets == (0, 1, 2)
  assert s.batches(10) == [(10, 6), (9, 7), (8, 8)]
  d = tick_lib.method_schedule("dsp", 4, delay=2)
  assert d.staleness == (12, 8, 4, 0)
  assert tick_lib.method_schedule("ddg", 4).staleness == (3, 2, 1, 0)
  assert tick_lib.method_schedule("bp", 4).staleness == (0, 0, 0, 0)
  # 1F1B: stage k runs K-1-k forwards before its first backward, then one of each every tick.
  for method in ("pipedream", "pipemare"):
    p = tick_lib.method_schedule(method, 4)
    warm = [sum(1 for t in range(10) if p.batches(t)[k][0] >= 0 > p.batches(t)[k][1]) for k in range(4)]
    assert warm == [3, 2, 1, 0] and p.offsets == (0, 0, 0, 0)
    assert all(p.batches(t)[k][1] == t - (3 - k) for t in range(10) for k in range(4))


def test_tick_processes_the_scheduled_batches(data):
  """Identity stages carry the batch index as the value: the ring buffers must hold t - F_k (forward)
  and t - F_k - S_k (backward slot) at every tick."""
  K, stages = 3, [IdentityStage() for _ in range(3)]
  sched = tick_lib.method_schedule("dsp", K)
  opt = optax.sgd(0.0)
  x0 = np.zeros((2, 3), np.float32)
  state = tick_lib.init_pipeline(stages, opt, sched, jax.random.key(0), x0)
  tick = tick_lib.make_tick(stages, opt, sched, 100)
  for t in range(12):
    state, _ = tick(state, np.full((2, 3), float(t), np.float32), np.zeros(2, np.int32), t)
    for k, (fwd_b, bwd_b) in enumerate(sched.batches(t)):
      s = sched.staleness[k]
      ring = np.asarray(state[k]["in_ring"])[:, 0, 0]
      if fwd_b >= 0:
        assert ring[t % (s + 1)] == fwd_b
      if bwd_b >= 0:
        assert ring[(t - s) % (s + 1)] == bwd_b


class IdentityStage(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    scale = self.param("scale", nn.initializers.ones, ())
    return x * scale if x.shape[-1] != 1 else x


def test_one_stage_equals_plain_sgd(data):
  bs = batches(data, 6)
  model = build_model("mlp", data["num_classes"], hidden=(16,))
  opt = optax.sgd(0.1)
  state = run_ticks([model], opt, tick_lib.method_schedule("dsp", 1), bs)
  params, ms = init_model(model, jax.random.fold_in(jax.random.key(0), 0), bs[0][0][:1])
  for x, y in bs:

    def loss(p):
      return optax.softmax_cross_entropy_with_integer_labels(apply_model(model, p, ms, x, True)[0], y).mean()

    params = optax.apply_updates(params, opt.update(jax.grad(loss)(params), opt.init(params))[0])
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params_of(state)[0], params
  )


@pytest.mark.parametrize("mode", ["recompute", "stash"])
def test_all_delays_zero_equals_bp(data, mode):
  bs = batches(data, 8)
  stages = mlp_stages(3)
  opt = optax.sgd(0.1, momentum=0.9)
  state = run_ticks(stages, opt, tick_lib.method_schedule("dsp", 3, delay=0, mode=mode), bs)
  ref = bp_reference(stages, opt, bs, bs[0][0])
  for got, want in zip(params_of(state), ref):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_bp_step_equals_the_reference(data):
  bs = batches(data, 4)
  stages = mlp_stages(3)
  opt = optax.sgd(0.1, momentum=0.9)
  state = tick_lib.init_pipeline(stages, opt, tick_lib.method_schedule("bp", 3), jax.random.key(0), bs[0][0])
  step = baselines.make_bp_step(stages, opt)
  for x, y in bs:
    state, _ = step(state, x, y)
  for got, want in zip(params_of(state), bp_reference(stages, opt, bs, bs[0][0])):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_gpipe_equals_bp(data):
  bs = batches(data, 4)
  stages = mlp_stages(3)
  opt = optax.sgd(0.1)
  state = tick_lib.init_pipeline(stages, opt, tick_lib.method_schedule("bp", 3), jax.random.key(0), bs[0][0])
  step = baselines.make_gpipe_step(stages, opt, microbatches=4)
  for x, y in bs:
    state, _ = step(state, x, y)
  for got, want in zip(params_of(state), bp_reference(stages, opt, bs, bs[0][0])):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_stash_uses_the_stored_version(data):
  """Stage 0 of K=2 (S_0 = 2): with plain SGD its update at tick t is -lr * grad at the params stored
  when batch t-2 went forward. Recompute mode would use the current params instead; they differ."""
  bs = batches(data, 8)
  stages = mlp_stages(2)
  lr = 0.5
  opt = optax.sgd(lr)
  sched = tick_lib.method_schedule("dsp", 2, mode="stash")
  state = tick_lib.init_pipeline(stages, opt, sched, jax.random.key(0), bs[0][0])
  tick = tick_lib.make_tick(stages, opt, sched, len(bs))
  for t in range(5):
    state, _ = tick(state, bs[t][0], bs[max(t - 1, 0)][1], t)
  before = jax.tree.map(np.array, state[0])
  bwd = state[0]["bwd_fifo"][0]  # the error gradient stage 0 consumes at tick 5 (batch 3)
  state, _ = tick(state, bs[5][0], bs[4][1], 5)
  slot = (5 - 2) % 3
  x_old = before["in_ring"][slot]

  def step_with(p):
    _, pullback = jax.vjp(lambda p: apply_model(stages[0], p, {}, x_old, True)[0], p)
    return jax.tree.map(lambda w, g: w - lr * g, before["params"], pullback(bwd)[0])

  stored = jax.tree.map(lambda r: r[slot], before["param_ring"])
  assert not np.allclose(stored["Dense_0"]["kernel"], before["params"]["Dense_0"]["kernel"])
  got = params_of(state)[0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, step_with(stored))
  with pytest.raises(AssertionError):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, step_with(before["params"])
    )


@pytest.mark.slow  # in process, too long for the fast tier
def test_dsp_k4_drives_the_full_gradient_to_zero(data):
  """The paper's convergence claim, numerically: full-batch DSP (K=4, S = {6,4,2,0}) with a decaying
  step size on a smooth problem (tanh network, weight decay) reaches a small full-gradient norm."""
  x, y = data["x_train"][:128], data["y_train"][:128]
  stages = mlp_stages(4, width=8)
  wd = 1e-2
  sched_fn = lambda t: 0.3 / (1 + t / 300)
  opt = optax.chain(optax.add_decayed_weights(wd), optax.sgd(sched_fn))
  n = 3000
  state = run_ticks(stages, opt, tick_lib.method_schedule("dsp", 4), [(x, y)] * n)
  params = [st["params"] for st in state]

  def objective(ps):
    logits, _ = baselines.compose(stages, ps, [{}] * 4, x, train=False)
    l2 = sum(jnp.sum(a * a) for a in jax.tree.leaves(ps))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + 0.5 * wd * l2

  init = tick_lib.init_pipeline(stages, opt, tick_lib.method_schedule("dsp", 4), jax.random.key(0), x)
  g0 = jax.grad(objective)([st["params"] for st in init])
  g = jax.grad(objective)(params)
  norm = lambda g: float(jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree.leaves(g))))
  assert norm(g) < 1e-2 and norm(g) < 0.05 * norm(g0), (norm(g), norm(g0))


def test_dsp_ring_buffer_bytes(data):
  """recompute mode stores S_k + 1 inputs and one parameter copy per stage (read from the live state)."""
  bs = batches(data, 2)
  stages = mlp_stages(4)
  for mode in ("recompute", "stash"):
    sched = tick_lib.method_schedule("dsp", 4, mode=mode)
    state = tick_lib.init_pipeline(stages, optax.sgd(0.1), sched, jax.random.key(0), bs[0][0])
    for k, (st, b) in enumerate(zip(state, tick_lib.stored_bytes(state))):
      s = sched.staleness[k]
      in_bytes = bs[0][0].nbytes if k == 0 else B * 16 * 4
      assert b["inputs"] == (s + 1) * in_bytes
      p_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(st["params"]))
      assert b["params"] == p_bytes
      assert b["param_versions"] == ((s + 1) * p_bytes if mode == "stash" else 0)
      assert b["correction"] == 0
  # PipeMare keeps no versions and one weight-sized moving average per stage.
  sched = tick_lib.method_schedule("pipemare", 4)
  state = tick_lib.init_pipeline(stages, optax.sgd(0.1), sched, jax.random.key(0), bs[0][0])
  for st, b in zip(state, tick_lib.stored_bytes(state)):
    p_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(st["params"]))
    assert b["param_versions"] == 0 and b["correction"] == p_bytes


def test_dni_predictor_trains_on_the_delayed_true_gradient(data):
  """Step 1 leaves the zero predictors untouched (no true gradient has arrived) and stores the pair;
  step 2 makes one SGD step on it: from a zero prediction the bias moves by lr x mean(n x dL/dh)."""
  bs = batches(data, 2)
  stages = mlp_stages(3)
  opt, lr = optax.sgd(0.1), 0.05
  state = baselines.init_dni(stages, opt, optax.sgd(lr), jax.random.key(0), bs[0][0], data["num_classes"])
  step = baselines.make_dni_step(stages, opt, optax.sgd(lr))
  state, _ = step(state, *bs[0])
  for st in state[:-1]:
    assert not np.any(np.asarray(st["sg"]["bias"])) and bool(st["has_last"])
  # the stage below the top stored the top's true input gradient for batch 0
  true_1 = np.asarray(state[1]["last_true"])
  assert np.abs(true_1).max() > 0
  state, _ = step(state, *bs[1])
  n = true_1.shape[0]
  np.testing.assert_allclose(
    np.asarray(state[1]["sg"]["bias"]), lr * (n * true_1).mean(0), rtol=1e-4, atol=1e-7
  )
  # Stage 0's target at step 1 came through stage 1's synthetic gradient, still zero then (DNI
  # bootstraps from the top): its predictor starts moving one step later.
  assert not np.any(np.asarray(state[0]["sg"]["kernel"]))
  state, _ = step(state, *bs[0])
  assert np.any(np.asarray(state[0]["sg"]["kernel"]))


# Recorded once from the tick of DSP K=2 (mlp_stages(2), SGD lr 0.1 momentum 0.9, batches(data, 4)).
GOLDEN_LOSSES = [1.7302465438842773, 1.7520551681518555, 1.3649051189422607, 1.2455646991729736]
GOLDEN_PARAM_RMS = [0.2531256079673767, 0.2603178322315216]


def test_golden_dsp_tick_canary(data):
  """A canary of the tick's numerics: 4 batches through DSP K=2 (warm-up and drain included), the
  losses of the 4 scheduled batches and each stage's parameter RMS against recorded values."""
  bs = batches(data, 4)
  stages = mlp_stages(2)
  opt = optax.sgd(0.1, momentum=0.9)
  sched = tick_lib.method_schedule("dsp", 2)
  state = tick_lib.init_pipeline(stages, opt, sched, jax.random.key(0), bs[0][0])
  tick = tick_lib.make_tick(stages, opt, sched, len(bs))
  losses = []
  for t in range(len(bs) + sched.drain_ticks()):
    x = bs[t][0] if t < len(bs) else np.zeros_like(bs[0][0])
    state, (loss, _) = tick(state, x, bs[min(max(t - 1, 0), len(bs) - 1)][1], t)
    if 0 <= t - 1 < len(bs):
      losses.append(float(loss))
  rms = [
    float(np.sqrt(np.mean(np.concatenate([np.ravel(a) ** 2 for a in jax.tree.leaves(p)]))))
    for p in params_of(state)
  ]
  msg = (
    "the DSP tick's numerics changed; update GOLDEN_LOSSES / GOLDEN_PARAM_RMS only when a change "
    "of numerics is intended"
  )
  np.testing.assert_allclose(losses, GOLDEN_LOSSES, rtol=1e-5, err_msg=msg)
  np.testing.assert_allclose(rms, GOLDEN_PARAM_RMS, rtol=1e-5, err_msg=msg)


def test_links_with_delay_two_deliver_the_oldest_entry():
  """Links of delay 2 (K=3, S = {8, 4, 0}, F = {0, 2, 4}): each FIFO must hand over what entered it 2
  ticks ago (fifo[0]), not 1 tick ago. Identity stages carry batch t's index in its input, so stage k's
  stored input is batch t - F_k; the error gradient that reaches stage 0 is the loss gradient of batch
  t - F_1 - S_1, which depends on the batch."""
  K, stages = 3, [IdentityStage() for _ in range(3)]
  sched = tick_lib.method_schedule("dsp", K, delay=2)
  assert sched.offsets == (0, 2, 4) and sched.staleness == (8, 4, 0)
  opt = optax.sgd(0.0)
  y = np.zeros(2, np.int32)
  x_of = lambda b: np.array([[b, 0, 0], [0, 0.5 * b, 0]], np.float32)
  loss_grad = jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())
  state = tick_lib.init_pipeline(stages, opt, sched, jax.random.key(0), x_of(0))
  tick = tick_lib.make_tick(stages, opt, sched, 100)
  checked = 0
  for t in range(16):
    state, _ = tick(state, x_of(t), y, t)
    for k, (fwd_b, _) in enumerate(sched.batches(t)):
      if fwd_b >= 0:
        ring = np.asarray(state[k]["in_ring"])[t % (sched.staleness[k] + 1)]
        np.testing.assert_array_equal(ring, x_of(fwd_b), err_msg=f"stage {k} tick {t}")
    b = t - sched.offsets[1] - sched.staleness[1]  # the batch stage 1 sent down at tick t
    if b >= 0:
      np.testing.assert_allclose(
        np.asarray(state[0]["bwd_fifo"][-1]), loss_grad(x_of(b)), rtol=1e-6, err_msg=f"tick {t}"
      )
      checked += 1
  assert checked == 10


def test_method_table_covers_every_method():
  from ripples_jax.pipeline import methods, timing

  assert tuple(baselines.METHODS) == methods.names() == timing.METHODS


# ---------------------------------------------------------------------------------------------------
# PipeDream-1F1B and PipeMare against a reference written from their papers: every stage runs its own
# list of operations (K-1-k warm-up forwards, then one forward and one backward, no flush), each as
# soon as its input has arrived; nothing in it is the tick.


def dense_forward(p, x, last: bool):
  """A Dense stage by hand: (output, the activations its backward reads: the flat input and the
  nonlinearity's output)."""
  x2 = x.reshape(x.shape[0], -1)
  z = x2 @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
  h = z if last else jnp.tanh(z)
  return h, (x2, h)


def dense_backward(p_bwd, acts, cot, x_shape, last: bool):
  """PipeMare's backward of a Dense stage by hand: the forward's activations, the weights p_bwd."""
  x2, h = acts
  g_z = cot if last else cot * (1 - h * h)
  g_p = {"Dense_0": {"kernel": x2.T @ g_z, "bias": g_z.sum(0)}}
  return g_p, (g_z @ p_bwd["Dense_0"]["kernel"].T).reshape(x_shape)


def one_f_one_b_reference(stages, opt, bs, x0, stash: bool, lr_anneal=0, ema_decay=0.0):
  """Every stage's params after 1F1B over the batches bs. stash: PipeDream's weight stashing (the
  backward at the version the forward used); else PipeMare as published (Dense stages: the forward's
  activations kept, the backward's weight operands w - tau delta, delta the moving average of the
  stage's updates with decay ema_decay^(1/tau), tau = K-1-k its delay; step size times
  tau^-(1 - min(u / lr_anneal, 1)) at its u-th update)."""
  K, n = len(stages), len(bs)
  init = tick_lib.init_pipeline(stages, opt, tick_lib.method_schedule("bp", K), jax.random.key(0), x0)
  w = [st["params"] for st in init]
  ms = [st["model_state"] for st in init]
  opt_state = [opt.init(p) for p in w]
  delta = [jax.tree.map(jnp.zeros_like, p) for p in w]
  ops = []
  for k in range(K):
    lag = K - 1 - k
    seq = [("F", i) for i in range(min(lag, n))]
    for i in range(n):
      seq += ([("F", i + lag)] if i + lag < n else []) + [("B", i)]
    ops.append(seq)
  inputs = [dict() for _ in range(K)]  # stage k's input of batch i
  cots = [dict() for _ in range(K)]  # dL/d(stage k's output) of batch i
  stashed = [dict() for _ in range(K)]
  kept = [dict() for _ in range(K)]  # PipeMare: stage k's activations of batch i, from its forward
  outs = [dict() for _ in range(K)]
  updates_done = [0] * K
  for i, (x, _) in enumerate(bs):
    inputs[0][i] = x
  pos = [0] * K
  while any(pos[k] < len(ops[k]) for k in range(K)):
    moved = False
    for k in range(K):
      while pos[k] < len(ops[k]):
        kind, i = ops[k][pos[k]]
        if kind == "F" and i in inputs[k]:
          stashed[k][i] = w[k]
          if stash:
            out = apply_model(stages[k], w[k], ms[k], inputs[k][i], True)[0]
          else:
            out, kept[k][i] = dense_forward(w[k], inputs[k][i], k == K - 1)
          outs[k][i] = out
          if k < K - 1:
            inputs[k + 1][i] = out
        elif kind == "B" and (k == K - 1 or i in cots[k]):
          tau = K - 1 - k
          if k == K - 1:
            y = bs[i][1]
            cot = jax.grad(lambda o: optax.softmax_cross_entropy_with_integer_labels(o, y).mean())(outs[k][i])
          else:
            cot = cots[k][i]
          if stash:
            _, pullback = jax.vjp(
              lambda p, x: apply_model(stages[k], p, ms[k], x, True)[0], stashed[k][i], inputs[k][i]
            )
            g_p, g_x = pullback(cot)
          else:
            p_b = jax.tree.map(lambda a, d: a - tau * d, w[k], delta[k])
            g_p, g_x = dense_backward(p_b, kept[k][i], cot, inputs[k][i].shape, k == K - 1)
          if k > 0:
            cots[k - 1][i] = g_x
          u, opt_state[k] = opt.update(g_p, opt_state[k], w[k])
          scale = 1.0
          if not stash and lr_anneal and tau > 1:
            scale = float(tau) ** -(1.0 - min(updates_done[k] / lr_anneal, 1.0))
          u = jax.tree.map(lambda a: scale * a, u)
          w[k] = optax.apply_updates(w[k], u)
          gamma = ema_decay ** (1 / tau) if tau else ema_decay
          delta[k] = jax.tree.map(lambda d, a: gamma * d + (1 - gamma) * a, delta[k], u)
          updates_done[k] += 1
        else:
          break
        pos[k] += 1
        moved = True
    assert moved, "the 1F1B order deadlocked"
  return [jax.tree.map(np.asarray, p) for p in w]


@pytest.mark.parametrize(
  "method",
  [
    "pipedream",
    pytest.param("ddg", marks=pytest.mark.slow),
    pytest.param("pipemare", marks=pytest.mark.slow),
  ],
)
def test_1f1b_methods_equal_the_reference(data, method):
  bs = batches(data, 10)
  stages = mlp_stages(4)
  opt = optax.sgd(0.05, momentum=0.9)
  kw = dict(lr_anneal=6, ema_decay=0.5) if method == "pipemare" else {}
  sched = tick_lib.method_schedule(method, 4, **kw)
  got = params_of(run_ticks(stages, opt, sched, bs))
  want = one_f_one_b_reference(stages, opt, bs, bs[0][0], stash=method != "pipemare", **kw)
  for a, b in zip(got, want):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-6), a, b)


def test_pipemare_backward_keeps_the_forward_activations(data):
  """PipeMare as published, K=2 (gamma = D at S_0 = 1): stage 0's backward reads the activations its
  forward computed at the then-current weights and only its weight operands at w - S_0 delta; a
  backward that recomputes the forward at w - S_0 delta (the activations at the corrected weights)
  drifts off this reference."""
  bs = batches(data, 8)
  stages, opt = mlp_stages(2), optax.sgd(0.1, momentum=0.9)
  sched = tick_lib.method_schedule("pipemare", 2, ema_decay=0.5)
  got = params_of(run_ticks(stages, opt, sched, bs))
  want = one_f_one_b_reference(stages, opt, bs, bs[0][0], stash=False, ema_decay=0.5)
  for a, b in zip(got, want):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-6), a, b)


def test_pipemare_decay_is_tied_to_the_delay():
  sch = tick_lib.method_schedule("pipemare", 4, ema_decay=0.125)
  assert sch.staleness == (3, 2, 1, 0)
  np.testing.assert_allclose([sch.gamma(k) for k in range(3)], [0.5, 0.125**0.5, 0.125], rtol=1e-12)


@pytest.mark.slow  # in process, too long for the fast tier
def test_pipemare_is_not_pipedream(data):
  """Without stashing the backward's weights differ from the forward's: the runs part (the reference
  test above would pass for both if the correction were exact or the mode ignored)."""
  bs = batches(data, 10)
  stages, opt = mlp_stages(3), optax.sgd(0.05, momentum=0.9)
  pd = params_of(run_ticks(stages, opt, tick_lib.method_schedule("pipedream", 3), bs))
  pm = params_of(run_ticks(stages, opt, tick_lib.method_schedule("pipemare", 3, ema_decay=0.5), bs))
  assert np.abs(pd[0]["Dense_0"]["kernel"] - pm[0]["Dense_0"]["kernel"]).max() > 1e-6


def test_pipemare_step_size_rescheduling():
  sch = tick_lib.method_schedule("pipemare", 4, lr_anneal=10)
  assert sch.staleness == (3, 2, 1, 0)
  np.testing.assert_allclose(float(tick_lib.lr_scale(sch, 0, 0)), 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(tick_lib.lr_scale(sch, 0, 5)), 3**-0.5, rtol=1e-6)
  np.testing.assert_allclose(float(tick_lib.lr_scale(sch, 1, 0)), 1 / 2, rtol=1e-6)
  assert float(tick_lib.lr_scale(sch, 0, 10)) == float(tick_lib.lr_scale(sch, 0, 99)) == 1.0
  assert tick_lib.lr_scale(sch, 2, 0) == tick_lib.lr_scale(sch, 3, 0) == 1.0  # delay <= 1
  assert tick_lib.lr_scale(tick_lib.method_schedule("pipemare", 4), 0, 0) == 1.0  # no annealing
  assert tick_lib.lr_scale(tick_lib.method_schedule("pipedream", 4, lr_anneal=10), 0, 0) == 1.0


# ---------------------------------------------------------------------------------------------------
# chunks: every tick method's backward over equal chunks of the batch, the numerics of one call.


@pytest.mark.parametrize(
  "method",
  ["dsp", pytest.param("fr", marks=pytest.mark.slow), pytest.param("pipemare", marks=pytest.mark.slow)],
)
def test_chunked_backward_equals_the_unchunked_one(data, method):
  """K=2, 4 chunks of 4 examples: each chunk's recompute and vjp (pipemare: each chunk's kept
  activations and backward) in turn, the gradients summed, give the unchunked parameters to float
  order (rtol 1e-5, atol 1e-6 over 8 batches of momentum SGD; the differences seen are ~1e-7), and
  every matrix product of stage 0's backward (pipemare: and forward) reads one chunk."""
  bs = batches(data, 8)
  stages, opt = mlp_stages(2), optax.sgd(0.1, momentum=0.9)
  one = tick_lib.method_schedule(method, 2, lr_anneal=5, ema_decay=0.5)
  four = dataclasses.replace(one, chunks=4)
  want, got = params_of(run_ticks(stages, opt, one, bs)), params_of(run_ticks(stages, opt, four, bs))
  for a, b in zip(got, want):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)
  st = tick_lib.init_pipeline(stages, opt, four, jax.random.key(0), bs[0][0])[0]
  cot = np.zeros((B, 16), np.float32)
  bwd = jax.make_jaxpr(lambda st: tick_lib.stage_backward(stages[0], opt, four, 0, st, cot, None, 5, 8))(st)
  assert dot_rows(bwd.jaxpr) == {B // 4}
  if method == "pipemare":
    fwd = jax.make_jaxpr(lambda st: tick_lib.stage_forward(stages[0], four, 0, st, bs[0][0], 5))(st)
    assert dot_rows(fwd.jaxpr) == {B // 4}


def dot_rows(jaxpr) -> set:
  """The leading dimension of every dot_general's first operand in a jaxpr (and the calls in it)."""
  rows = set()
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      rows.add(e.invars[0].aval.shape[0])
    for p in e.params.values():
      rows |= dot_rows(p.jaxpr) if hasattr(p, "jaxpr") else set()
  return rows


def test_chunks_are_refused_with_a_model_state_in_one_line():
  """BatchNorm's statistics would be per chunk: the config says so before anything is built, for every
  placement; the tick refuses too. A model without a model state chunks in every placement."""
  from configs import dsp as dsp_config
  from ripples_jax.config import ConfigError, validate_dsp_config

  for placement, procs in (("one_device", 1), ("devices", 1), ("per_process", 2)):
    c = dsp_config.get_config("method=pipemare,num_stages=2,model=resnet20")
    c.placement, c.chunks = placement, 2
    with pytest.raises(ConfigError) as e:
      validate_dsp_config(c, num_processes=procs)
    assert str(e.value) == (
      "config.chunks: 2 is not allowed: 1 with model=resnet20: it has a model state (BatchNorm), "
      "whose batch statistics would be per chunk"
    )
    for method in ("dsp", "fr", "pipemare"):
      c.model, c.method = "rescnn", method
      validate_dsp_config(c, num_processes=procs)
  with pytest.raises(ConfigError, match="chunks: 2 is not allowed with stage 0's model state"):
    sched = tick_lib.method_schedule("dsp", 2, chunks=2)
    tick_lib.init_pipeline(
      [BatchNormStage(), Dense(4, last=True)],
      optax.sgd(0.1),
      sched,
      jax.random.key(0),
      np.zeros((B, 8), np.float32),
    )


class BatchNormStage(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    return nn.BatchNorm(use_running_average=not train)(x)
