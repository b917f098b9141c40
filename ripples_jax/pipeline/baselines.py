"""The methods DSP is compared with, as whole-model steps, and the table of every method's steps.

  bp     plain backprop of the composed stages, every stage's update after it
  gpipe  micro-batches, rematerialised stage boundaries, one update per stage after the flush
  dni    decoupled neural interfaces: a locked forward, updates from synthetic gradients
  make_eval  the composed stages' test accuracy and loss

`METHODS[name] = (init_fn, step_fn)` with one signature for all of them: `STEPS[record.step]` of each
record in pipeline/methods.py, the tick's for a method on DSP's tick (bp too could run as a tick with
zero delays, but its whole-model step is the reference):

  state = init_fn(stages, optimizer, config, rng, sample_x, num_classes)
  step = step_fn(stages, optimizer, config, num_batches)
  state, (loss, acc) = step(state, x_t, y_t, t)

x_t is batch t (zeros once every batch is in, during a tick's drain), y_t the labels of batch
t - offset, where `schedule_of(config)` gives offset = F_{K-1} and the drain (None for a whole-model
step: one batch a step, offset and drain 0).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ripples_jax import losses
from ripples_jax.models import apply_model
from ripples_jax.pipeline import methods
from ripples_jax.pipeline.tick import Schedule, init_pipeline, make_tick, method_schedule

# ----------------------------------------------------------------------------------------------------
# Whole-model steps: BP on the composed stages, and GPipe.


def compose(stages, params_K, model_state_K, x, train: bool):
  """The K stages applied in order: the unsplit network."""
  new_states = []
  for stage, p, ms in zip(stages, params_K, model_state_K):
    x, ms = apply_model(stage, p, ms, x, train=train)
    new_states.append(ms)
  return x, new_states


def update_stages(optimizer, state, grads_K, model_state_K):
  """Every stage applies its own gradient (whole-model steps: one update per stage per batch)."""
  new = []
  for st, g, ms in zip(state, grads_K, model_state_K):
    updates, opt_state = optimizer.update(g, st["opt_state"], st["params"])
    new.append(
      dict(st, params=optax.apply_updates(st["params"], updates), opt_state=opt_state, model_state=ms)
    )
  return new


def make_bp_step(stages, optimizer):
  """Plain backprop of the composed stages (one model), then every stage's update."""

  def loss_fn(params_K, model_state_K, x, y):
    logits, new_ms = compose(stages, params_K, model_state_K, x, train=True)
    return losses.cross_entropy(logits, y), (new_ms, losses.accuracy(logits, y))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y):
    (loss, (ms_K, acc)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      [st["params"] for st in state], [st["model_state"] for st in state], x, y
    )
    return update_stages(optimizer, state, grads, ms_K), (loss, acc)

  return step


def make_gpipe_step(stages, optimizer, microbatches: int, remat: bool = True):
  """GPipe: M micro-batches through the K stages, stage outputs rematerialised in the backward,
  gradients accumulated, one update per stage after the flush. Numerically BP on the full batch.
  remat=False: the activations kept (1F1B, ZB-H1 in one process: their numerics, flush.py)."""

  def loss_fn(params_K, model_state_K, x, y):
    h = x
    new_ms = []
    for stage, p, ms in zip(stages, params_K, model_state_K):
      # Rematerialisation: keep only stage boundaries; recompute the inside in the backward.
      fwd = lambda p, ms, h, stage=stage: apply_model(stage, p, ms, h, train=True)
      h, ms = (jax.checkpoint(fwd) if remat else fwd)(p, ms, h)
      new_ms.append(ms)
    return losses.cross_entropy(h, y), (new_ms, losses.accuracy(h, y))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y):
    params_K = [st["params"] for st in state]
    ms_K = [st["model_state"] for st in state]
    xm = x.reshape((microbatches, -1) + x.shape[1:])
    ym = y.reshape((microbatches, -1))

    def micro(carry, xy):
      g_acc, ms, loss_acc, acc_acc = carry
      (loss, (ms, acc)), g = jax.value_and_grad(loss_fn, has_aux=True)(params_K, ms, *xy)
      g_acc = jax.tree.map(lambda a, b: a + b / microbatches, g_acc, g)
      return (g_acc, ms, loss_acc + loss / microbatches, acc_acc + acc / microbatches), None

    zeros = jax.tree.map(jnp.zeros_like, params_K)
    (grads, ms_K, loss, acc), _ = jax.lax.scan(micro, (zeros, ms_K, 0.0, 0.0), (xm, ym))
    return update_stages(optimizer, state, grads, ms_K), (loss, acc)

  return step


def make_eval(stages):
  @jax.jit
  def evaluate(state, x, y):
    logits, _ = compose(
      stages, [st["params"] for st in state], [st["model_state"] for st in state], x, train=False
    )
    return losses.accuracy(logits, y), losses.cross_entropy(logits, y)

  return evaluate


# ----------------------------------------------------------------------------------------------------
# DNI: decoupled neural interfaces (synthetic gradients).


def init_dni(stages, optimizer, predictor_opt, rng, sample_x, num_classes: int) -> list[dict]:
  """Stage state plus, below the last stage, a synthetic-gradient predictor of dL/d(output) that is
  linear in the output and the one-hot label (cDNI: without the label a predictor cannot know which
  way the loss pulls), zero-initialised so the first updates are no-ops rather than noise, and the last
  (output, label, true gradient) triple waiting to train it."""
  state = init_pipeline(stages, optimizer, method_schedule("bp", len(stages)), rng, sample_x)
  x = jnp.asarray(sample_x)
  for k, (stage, st) in enumerate(zip(stages, state)):
    y = jax.eval_shape(
      lambda p, m, x: apply_model(stage, p, m, x, train=False)[0], st["params"], st["model_state"], x
    )
    if k < len(stages) - 1:
      d = int(np.prod(y.shape[1:]))
      sg = {
        "kernel": jnp.zeros((d, d), y.dtype),
        "label_kernel": jnp.zeros((num_classes, d), y.dtype),
        "bias": jnp.zeros((d,), y.dtype),
      }
      st.update(
        sg=sg,
        sg_opt_state=predictor_opt.init(sg),
        last_out=jnp.zeros(y.shape, y.dtype),
        last_true=jnp.zeros(y.shape, y.dtype),
        last_y=jnp.zeros(y.shape[0], jnp.int32),
        has_last=jnp.array(False),
      )
    x = jnp.zeros(y.shape, y.dtype)
  return state


def _predict(sg, h, labels):
  flat = h.reshape(h.shape[0], -1)
  return (flat @ sg["kernel"] + sg["label_kernel"][labels] + sg["bias"]).reshape(h.shape)


def make_dni_step(stages, optimizer, predictor_opt):
  """One DNI iteration: a locked forward; every stage below the top updates at once from its
  predictor's synthetic gradient; the gradient each stage sends down (from the top's true loss, or from
  back-propagating a synthetic gradient) is the target its lower neighbour's predictor trains on one
  iteration later, when it has arrived."""
  K = len(stages)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y):
    state = [dict(st) for st in state]
    ins, h = [], x
    for k in range(K - 1):
      ins.append(h)
      h, _ = apply_model(stages[k], state[k]["params"], state[k]["model_state"], h, train=True)
    ins.append(h)
    # Top stage: the true loss.
    top = state[K - 1]

    def loss_fn(p, x_in):
      logits, ms = apply_model(stages[K - 1], p, top["model_state"], x_in, train=True)
      return losses.cross_entropy(logits, y), (ms, losses.accuracy(logits, y))

    (loss, (ms, acc)), (g_p, down) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      top["params"], ins[K - 1]
    )
    updates, opt_state = optimizer.update(g_p, top["opt_state"], top["params"])
    state[K - 1] = dict(
      top, params=optax.apply_updates(top["params"], updates), opt_state=opt_state, model_state=ms
    )
    for k in reversed(range(K - 1)):
      st = state[k]
      # Train the predictor on the pair that arrived: last iteration's output and its true gradient.
      # The predictor learns the per-example gradient (batch x dL/dh of the mean loss): O(1) targets
      # whatever the batch size, so one predictor step size fits every stage.
      n = st["last_out"].shape[0]

      def sg_loss(sg):
        err = _predict(sg, st["last_out"], st["last_y"]) - n * st["last_true"]
        return 0.5 * jnp.mean(jnp.sum(jnp.square(err).reshape(n, -1), axis=1))

      sg_grads = jax.grad(sg_loss)(st["sg"])
      sg_updates, sg_opt_state = predictor_opt.update(sg_grads, st["sg_opt_state"], st["sg"])
      sg = jax.tree.map(
        lambda new, old: jnp.where(st["has_last"], new, old),
        optax.apply_updates(st["sg"], sg_updates),
        st["sg"],
      )
      # Update the stage at once from the synthetic gradient of its output.
      out, pullback = jax.vjp(
        lambda p, xi: apply_model(stages[k], p, st["model_state"], xi, train=True), st["params"], ins[k]
      )
      synthetic = _predict(sg, out[0], y) / out[0].shape[0]
      g_p, g_in = pullback((synthetic, jax.tree.map(jnp.zeros_like, out[1])))
      updates, opt_state = optimizer.update(g_p, st["opt_state"], st["params"])
      state[k] = dict(
        st,
        params=optax.apply_updates(st["params"], updates),
        opt_state=opt_state,
        model_state=out[1],
        sg=sg,
        sg_opt_state=sg_opt_state,
        last_out=out[0],
        last_true=down,
        last_y=y,
        has_last=jnp.array(True),
      )
      down = g_in
    return state, (loss, acc)

  return step


# ----------------------------------------------------------------------------------------------------
# The table of every method: one signature over the config (see the module docstring).


def schedule_of(config) -> Schedule | None:
  """The link schedule a config's method runs with in its placement; None for a whole-model step
  (gpipe, dni, and bp in one process). Its ring is methods.ring's: per_process runs bp too (model
  parallel, zero delays), and there bp, ddg and pipedream keep the forward's vjp residuals (the stored
  graph: no recompute) where the one-process placements recompute the stage at the stashed weights
  (the same gradients)."""
  mode = methods.ring(config.method, config.placement, config.mode)
  if mode is None:
    return None
  pm = config.pipemare
  return method_schedule(
    config.method, config.num_stages, config.delay, mode, pm.lr_anneal, pm.ema_decay, config.chunks
  )


def _per_batch(step):
  """A whole-model step called like a tick: (state, x_t, y_t, t), t unused."""
  return lambda state, x_t, y_t, t: step(state, x_t, y_t)


def _init_whole(stages, optimizer, config, rng, sample_x, num_classes):
  """bp and gpipe: every stage's params and optimizer state (a one-slot ring, unused)."""
  return init_pipeline(stages, optimizer, method_schedule("bp", len(stages)), rng, sample_x)


def _bp_step(stages, optimizer, config, num_batches):
  return _per_batch(make_bp_step(stages, optimizer))


def _gpipe_step(stages, optimizer, config, num_batches):
  return _per_batch(make_gpipe_step(stages, optimizer, config.microbatches))


def _flush_step(stages, optimizer, config, num_batches):
  return _per_batch(make_gpipe_step(stages, optimizer, config.microbatches, remat=False))


def _init_dni(stages, optimizer, config, rng, sample_x, num_classes):
  return init_dni(stages, optimizer, optax.sgd(config.dni_lr), rng, sample_x, num_classes)


def _dni_step(stages, optimizer, config, num_batches):
  return _per_batch(make_dni_step(stages, optimizer, optax.sgd(config.dni_lr)))


def _init_tick(stages, optimizer, config, rng, sample_x, num_classes):
  return init_pipeline(stages, optimizer, schedule_of(config), rng, sample_x)


def _tick_step(stages, optimizer, config, num_batches):
  return make_tick(stages, optimizer, schedule_of(config), num_batches)


# A record's step: (init_fn, step_fn).
STEPS = {
  methods.TICK: (_init_tick, _tick_step),
  "bp": (_init_whole, _bp_step),
  "gpipe": (_init_whole, _gpipe_step),
  "flush": (_init_whole, _flush_step),
  "dni": (_init_dni, _dni_step),
}
# name: (init_fn, step_fn) in one process, in the registry's order.
METHODS = {m.name: STEPS[m.step] for m in methods.REGISTRY}
