"""Model-parallel pipelines with layer-wise staleness: DSP and the methods it is compared with.

A network is split depth-wise into K stages (pipeline/split.py). Link k -> k+1 carries activations up
with a delay of f_k ticks and error gradients down with a delay of b_k ticks (fixed-length FIFOs). With
F_k = sum_{j<k} f_j and S_k = sum_{j>=k} (f_j + b_j), at tick t stage k runs the forward of batch
t - F_k and the backward of batch t - F_k - S_k (DESIGN 4.1; DSP has f = b = d, so S_k = 2 sum d_j and
K=3 gives {4, 2, 0}). The last stage computes the loss and its backward at once. Each stage applies its
own optax update as soon as its backward is done.

Every stage keeps a staleness ring buffer of its last S_k + 1 inputs (and, in `stash` mode, parameter
versions). `recompute` (DSP, Features Replay): the backward re-runs the stage's forward on the stored
input with the *current* parameters. `stash` (PipeDream-style, DDG's stored graph): the backward uses the
parameter version the forward used.

The same tick describes every method:
  bp   f = b = 0                  plain backprop of the composed model
  dsp  f = b = d (default 1)      forward, backward and update locks all broken
  ddg  f = 0, b = 1, stash        locked forward, delayed error gradients, the stored graph
  fr   f = 0, b = 1, recompute    locked forward, delayed error gradients, inputs only
GPipe (micro-batches, flush, rematerialisation) is `gpipe_step`.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ripples_jax.models import apply_model, init_model

MODES = ("recompute", "stash")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Delays of the K-1 links (forward f, backward b) and what they imply."""
  fwd_delays: tuple   # f_k for k < K-1
  bwd_delays: tuple   # b_k for k < K-1
  mode: str = "recompute"

  @property
  def num_stages(self) -> int:
    return len(self.fwd_delays) + 1

  @property
  def offsets(self) -> tuple:
    """F_k: how many ticks after stage 0 stage k sees a batch."""
    return tuple(int(sum(self.fwd_delays[:k])) for k in range(self.num_stages))

  @property
  def staleness(self) -> tuple:
    """S_k = sum_{j>=k} (f_j + b_j): ticks between stage k's forward and backward of a batch."""
    f, b = self.fwd_delays, self.bwd_delays
    return tuple(int(sum(f[k:]) + sum(b[k:])) for k in range(self.num_stages))

  def batches(self, t: int) -> list[tuple[int, int]]:
    """(forward batch, backward batch) of every stage at tick t (negative: warm-up, nothing to do)."""
    return [(t - o, t - o - s) for o, s in zip(self.offsets, self.staleness)]

  def drain_ticks(self) -> int:
    """Ticks after the last batch enters until every stage has applied its update."""
    return max(o + s for o, s in zip(self.offsets, self.staleness))


def method_schedule(method: str, num_stages: int, delay: int = 1, mode: str | None = None) -> Schedule:
  """The link delays of bp, dsp, ddg and fr (gpipe and dni have their own steps)."""
  k = num_stages - 1
  if method == "bp":
    return Schedule((0,) * k, (0,) * k, mode or "recompute")
  if method == "dsp":
    return Schedule((delay,) * k, (delay,) * k, mode or "recompute")
  if method == "ddg":
    return Schedule((0,) * k, (1,) * k, mode or "stash")
  if method == "fr":
    return Schedule((0,) * k, (1,) * k, mode or "recompute")
  raise ValueError(f"method: {method!r} has no link schedule")


def init_pipeline(stages, optimizer, schedule: Schedule, rng, sample_x) -> list[dict]:
  """Per-stage state: params, model_state, opt_state, the ring buffers and the incoming FIFOs."""
  state = []
  x = jnp.asarray(sample_x)
  for k, stage in enumerate(stages):
    params, model_state = init_model(stage, jax.random.fold_in(rng, k), x[:1])
    s = schedule.staleness[k]
    st = {"params": params, "model_state": model_state, "opt_state": optimizer.init(params),
          "in_ring": jnp.zeros((s + 1,) + x.shape, x.dtype)}
    if schedule.mode == "stash":
      st["param_ring"] = jax.tree.map(lambda a: jnp.broadcast_to(a, (s + 1,) + a.shape), params)
    if k > 0 and schedule.fwd_delays[k - 1]:
      st["fwd_fifo"] = jnp.zeros((schedule.fwd_delays[k - 1],) + x.shape, x.dtype)
    y = jax.eval_shape(lambda p, m, x: apply_model(stage, p, m, x, train=False)[0], params, model_state, x)
    if k < len(stages) - 1 and schedule.bwd_delays[k]:
      st["bwd_fifo"] = jnp.zeros((schedule.bwd_delays[k],) + y.shape, y.dtype)
    state.append(st)
    x = jnp.zeros(y.shape, y.dtype)
  return state


def _push(fifo, item):
  """FIFO of fixed length: drop the oldest (index 0), append the newest."""
  return jnp.concatenate([fifo[1:], item[None]], axis=0)


def stage_forward(stage, schedule: Schedule, k: int, st: dict, x_in, t):
  """Stage k's forward at tick t: store the input (and params in stash mode), return the output.

  The running statistics of BatchNorm are updated only in the backward's recompute pass (our choice),
  so this forward's model_state update is discarded. The last stage only stores: its backward (S=0)
  runs the forward of the same batch in the same tick.
  """
  s = schedule.staleness[k]
  slot = t % (s + 1)
  st = dict(st, in_ring=st["in_ring"].at[slot].set(x_in))
  if schedule.mode == "stash":
    st["param_ring"] = jax.tree.map(lambda r, p: r.at[slot].set(p), st["param_ring"], st["params"])
  if k == schedule.num_stages - 1:
    return st, None
  y, _ = apply_model(stage, st["params"], st["model_state"], x_in, train=True)
  return st, y


def stage_backward(stage, optimizer, schedule: Schedule, k: int, st: dict, cotangent, labels, t,
                   num_batches):
  """Stage k's backward at tick t on the batch stored S_k ticks ago, then its update at once.

  `cotangent` is dL/d(output) from stage k+1 (None for the last stage, which uses `labels`). Returns
  (state, dL/d(input), loss). Nothing is applied during warm-up or drain (batch index out of range).
  """
  s = schedule.staleness[k]
  old = (t - s) % (s + 1)
  x_old = st["in_ring"][old]
  params = (jax.tree.map(lambda r: r[old], st["param_ring"]) if schedule.mode == "stash"
            else st["params"])

  def fwd(p, x):
    return apply_model(stage, p, st["model_state"], x, train=True)

  if cotangent is None:  # last stage: loss and backward at once
    def loss_fn(p, x):
      logits, ms = fwd(p, x)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, (ms, jnp.mean(jnp.argmax(logits, -1) == labels))
    (loss, (new_ms, acc)), (g_p, g_x) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, x_old)
  else:
    (_, new_ms), pullback = jax.vjp(fwd, params, x_old)
    g_p, g_x = pullback((cotangent, jax.tree.map(jnp.zeros_like, new_ms)))
    loss = acc = jnp.nan
  batch = t - schedule.offsets[k] - s
  valid = (batch >= 0) & (batch < num_batches)
  updates, opt_state = optimizer.update(g_p, st["opt_state"], st["params"])
  keep = lambda new, cur: jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, cur)
  st = dict(st, params=keep(optax.apply_updates(st["params"], updates), st["params"]),
            opt_state=keep(opt_state, st["opt_state"]), model_state=keep(new_ms, st["model_state"]))
  return st, g_x, (loss, acc)


def make_tick(stages, optimizer, schedule: Schedule, num_batches: int, devices=None):
  """Returns tick(state, x_t, y_t, t) -> (state, (loss, acc)) advancing every stage by one tick.

  x_t is batch t (enters stage 0); y_t the labels of batch t - F_{K-1} (the last stage's). With
  `devices=None` the whole tick is one jitted function on one device. With a device per stage, each
  stage's forward and backward are their own jitted programs on its device, dispatched asynchronously so
  that stages run concurrently (links with delay >= 1 make a tick's stages independent).
  """
  K = len(stages)
  f, b = schedule.fwd_delays, schedule.bwd_delays
  fwd_fns = [functools.partial(stage_forward, stages[k], schedule, k) for k in range(K)]
  bwd_fns = [functools.partial(stage_backward, stages[k], optimizer, schedule, k) for k in range(K)]

  def tick_with(fwd, bwd, put):
    def tick(state, x_t, y_t, t):
      state = list(state)
      outs = [None] * K
      for k in range(K):  # forward wave
        if k == 0:
          x_in = x_t
        elif f[k - 1] == 0:
          x_in = put(outs[k - 1], k)  # locked forward: this tick's output of the stage below
        else:
          x_in = state[k]["fwd_fifo"][0]
        state[k], outs[k] = fwd[k](state[k], x_in, t)
      grads_in = [None] * K
      metrics = None
      for k in reversed(range(K)):  # backward wave
        if k == K - 1:
          cot = None
        elif b[k] == 0:
          cot = put(grads_in[k + 1], k)
        else:
          cot = state[k]["bwd_fifo"][0]
        state[k], grads_in[k], m = bwd[k](state[k], cot, y_t if k == K - 1 else None, t, num_batches)
        if k == K - 1:
          metrics = m
      for k in range(K - 1):  # the links advance
        if f[k]:
          state[k + 1]["fwd_fifo"] = _push(state[k + 1]["fwd_fifo"], put(outs[k], k + 1))
        if b[k]:
          state[k]["bwd_fifo"] = _push(state[k]["bwd_fifo"], put(grads_in[k + 1], k))
      return state, metrics
    return tick

  if devices is None:
    return jax.jit(tick_with(fwd_fns, bwd_fns, lambda a, k: a), donate_argnums=0)
  assert len(devices) >= K
  fwd = [jax.jit(fn) for fn in fwd_fns]
  bwd = [jax.jit(fn, static_argnums=4) for fn in bwd_fns]
  put = lambda a, k: jax.device_put(a, devices[k])
  return tick_with(fwd, bwd, put)


def place(state: list[dict], devices) -> list[dict]:
  """Puts stage k's state on devices[k] (one stage per device)."""
  return [jax.device_put(st, d) for st, d in zip(state, devices)]


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
    new.append(dict(st, params=optax.apply_updates(st["params"], updates), opt_state=opt_state,
                    model_state=ms))
  return new


def make_bp_step(stages, optimizer):
  """Plain backprop of the composed stages (one model), then every stage's update."""

  def loss_fn(params_K, model_state_K, x, y):
    logits, new_ms = compose(stages, params_K, model_state_K, x, train=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (new_ms, jnp.mean(jnp.argmax(logits, -1) == y))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y):
    (loss, (ms_K, acc)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        [st["params"] for st in state], [st["model_state"] for st in state], x, y)
    return update_stages(optimizer, state, grads, ms_K), (loss, acc)

  return step


def make_gpipe_step(stages, optimizer, microbatches: int):
  """GPipe: M micro-batches through the K stages, stage outputs rematerialised in the backward,
  gradients accumulated, one update per stage after the flush. Numerically BP on the full batch."""

  def loss_fn(params_K, model_state_K, x, y):
    h = x
    new_ms = []
    for stage, p, ms in zip(stages, params_K, model_state_K):
      # Rematerialisation: keep only stage boundaries; recompute the inside in the backward.
      h, ms = jax.checkpoint(lambda p, ms, h, stage=stage: apply_model(stage, p, ms, h, train=True))(p, ms, h)
      new_ms.append(ms)
    loss = optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
    return loss, (new_ms, jnp.mean(jnp.argmax(h, -1) == y))

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
    logits, _ = compose(stages, [st["params"] for st in state], [st["model_state"] for st in state], x,
                        train=False)
    return (jnp.mean(jnp.argmax(logits, -1) == y),
            optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
  return evaluate


def stored_bytes(state: list[dict]) -> list[dict]:
  """Bytes each stage holds, by kind, read from the live state (not a formula)."""
  size = lambda t: int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(t)))
  out = []
  for st in state:
    out.append({"params": size(st["params"]), "inputs": size(st["in_ring"]),
                "param_versions": size(st.get("param_ring", {})),
                "fifos": size(st.get("fwd_fifo", [])) + size(st.get("bwd_fifo", [])),
                "optimizer": size(st["opt_state"])})
  return out


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
    y = jax.eval_shape(lambda p, m, x: apply_model(stage, p, m, x, train=False)[0],
                       st["params"], st["model_state"], x)
    if k < len(stages) - 1:
      d = int(np.prod(y.shape[1:]))
      sg = {"kernel": jnp.zeros((d, d), y.dtype), "label_kernel": jnp.zeros((num_classes, d), y.dtype),
            "bias": jnp.zeros((d,), y.dtype)}
      st.update(sg=sg, sg_opt_state=predictor_opt.init(sg), last_out=jnp.zeros(y.shape, y.dtype),
                last_true=jnp.zeros(y.shape, y.dtype), last_y=jnp.zeros(y.shape[0], jnp.int32),
                has_last=jnp.array(False))
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
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, (ms, jnp.mean(jnp.argmax(logits, -1) == y))
    (loss, (ms, acc)), (g_p, down) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        top["params"], ins[K - 1])
    updates, opt_state = optimizer.update(g_p, top["opt_state"], top["params"])
    state[K - 1] = dict(top, params=optax.apply_updates(top["params"], updates), opt_state=opt_state,
                        model_state=ms)
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
      sg = jax.tree.map(lambda new, old: jnp.where(st["has_last"], new, old),
                        optax.apply_updates(st["sg"], sg_updates), st["sg"])
      # Update the stage at once from the synthetic gradient of its output.
      out, pullback = jax.vjp(lambda p, xi: apply_model(stages[k], p, st["model_state"], xi, train=True),
                              st["params"], ins[k])
      synthetic = _predict(sg, out[0], y) / out[0].shape[0]
      g_p, g_in = pullback((synthetic, jax.tree.map(jnp.zeros_like, out[1])))
      updates, opt_state = optimizer.update(g_p, st["opt_state"], st["params"])
      state[k] = dict(st, params=optax.apply_updates(st["params"], updates), opt_state=opt_state,
                      model_state=out[1], sg=sg, sg_opt_state=sg_opt_state, last_out=out[0],
                      last_true=down, last_y=y, has_last=jnp.array(True))
      down = g_in
    return state, (loss, acc)

  return step
