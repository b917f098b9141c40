"""The pipeline tick: DSP's link delays and staleness ring buffers, and the methods that are one tick.

A network is split depth-wise into K stages (models/split.py). Link k -> k+1 carries activations up
with a delay of f_k ticks and error gradients down with a delay of b_k ticks (fixed-length FIFOs). With
F_k = sum_{j<k} f_j and S_k = sum_{j>=k} (f_j + b_j), at tick t stage k runs the forward of batch
t - F_k and the backward of batch t - F_k - S_k (docs/design.md 4.1; DSP has f = b = d, so S_k = 2 sum d_j and
K=3 gives {4, 2, 0}). The last stage computes the loss and its backward at once. Each stage applies its
own optax update as soon as its backward is done.

Every stage keeps a staleness ring buffer of its last S_k + 1 inputs (and, in `stash` mode, parameter
versions). `recompute` (DSP, Features Replay): the backward re-runs the stage's forward on the stored
input with the *current* parameters. `stash` (PipeDream's weight stashing, DDG's stored graph): the
backward uses the parameter version the forward used. `corrected` (PipeMare as published, Yang et al.,
MLSys 2021): no versions kept; a stage below the last keeps its forward's activations (not its input)
for S_k ticks, and its backward takes the gradient at those activations with every weight operand of
the backward pass at w_bkwd = w - S_k delta, the current parameters moved back by S_k steps of delta, an
exponential moving average of the stage's own updates with decay gamma_k = D^(1/S_k) (its discrepancy
correction; D is `ema_decay`), so nothing is recomputed (pipeline/pipemare.py). The stage's step size
is divided by its delay S_k at first, the division annealed away over `lr_anneal` updates (its
rescheduling). The last stage (S = 0) runs its forward and backward at once at w.

`chunks` > 1 (every mode): a stage's backward runs over that many equal chunks of the batch in turn
(recompute and stash: each chunk's recompute and vjp; corrected: each chunk's forward keeps its own
activations, each chunk's backward reads them), the parameter gradients summed, the input gradients
concatenated: the unchunked numerics up to float order. Models with a model state are refused (the
BatchNorm statistics would be per chunk).

The same tick describes every method:
  bp         f = b = 0                  plain backprop of the composed model
  dsp        f = b = d (default 1)      forward, backward and update locks all broken
  ddg        f = 0, b = 1, stash        locked forward, delayed error gradients, the stored graph
  pipedream  f = 0, b = 1, stash        1F1B: stage k runs K-1-k warm-up forwards, then one forward
                                        and one backward a tick, no flush, weight stashing
  pipemare   f = 0, b = 1, corrected    PipeDream's schedule without stashing, the forward's
                                        activations kept, the backward at w - S_k delta (`corrected`)
  fr         f = 0, b = 1, recompute    locked forward, delayed error gradients, inputs only
PipeDream-1F1B and DDG are one schedule here: a locked forward and a backward link of one tick make
stage k's backward of batch i follow its forward by K-1-k of its own updates, which is 1F1B's order, and
both take the gradient at the version the forward used; their updates are equal
(tests/test_pipeline_dsp.py checks both against a 1F1B reference).
GPipe (micro-batches, flush, rematerialisation), BP as one model and DNI are whole-model steps
(baselines.py); every method's record is in methods.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ripples_jax import losses
from ripples_jax.errors import ConfigError
from ripples_jax.models import apply_model, init_model
from ripples_jax.pipeline import methods, pipemare

# recompute / stash: the ring buffers above. fused: recompute, with the new batch's forward and the
# replayed input's recompute as one forward call over both (per_process only). residuals: the forward's
# vjp residuals kept in the ring, so the backward recomputes nothing (per_process only); its gradients
# are stash mode's (the version the forward used, on the input it saw).
MODES = ("recompute", "stash", "fused", "residuals")
PROCESS_MODES = ("fused", "residuals")
# Not a config value: the mode pipemare's schedule carries (method_schedule).
CORRECTED = "corrected"
PLACEMENTS = methods.PLACEMENTS  # (where they are described)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Delays of the K-1 links (forward f, backward b) and what they imply."""

  fwd_delays: tuple  # f_k for k < K-1
  bwd_delays: tuple  # b_k for k < K-1
  mode: str = "recompute"
  lr_anneal: int = 0  # corrected: updates over which the step size's division by S_k anneals away
  ema_decay: float = 0.9  # corrected: D, the decay of the updates' moving average over a stage's delay
  chunks: int = 1  # each backward over this many equal chunks of the batch (module docstring)

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

  def gamma(self, k: int) -> float:
    """corrected: stage k's moving-average decay gamma_k = D^(1/S_k), so that the average forgets a
    factor D over the stage's delay: PipeMare's discrepancy correction ties each stage's decay to its
    delay (Yang et al., MLSys 2021, section 3, technique 2). D itself for S_k = 0 (delta unused)."""
    s = self.staleness[k]
    return float(self.ema_decay) ** (1.0 / s) if s > 0 else float(self.ema_decay)

  def keeps_activations(self, k: int) -> bool:
    """Stage k keeps its forward's activations for its backward (corrected, below the last stage)."""
    return self.mode == CORRECTED and k < self.num_stages - 1

  def drain_ticks(self) -> int:
    """Ticks after the last batch enters until every stage has applied its update."""
    return max(o + s for o, s in zip(self.offsets, self.staleness))


def method_schedule(
  method: str,
  num_stages: int,
  delay: int = 1,
  mode: str | None = None,
  lr_anneal: int = 0,
  ema_decay=0.9,
  chunks: int = 1,
) -> Schedule:
  """The schedule of a method with link delays (its record in pipeline/methods.py; gpipe and dni have
  their own steps): `mode` where given, else the record's ring. A corrected ring is the method itself
  (its backward has no other form): no mode replaces it, and only it reads lr_anneal and ema_decay."""
  m = methods.BY_NAME.get(method)
  if m is None or m.delays is None:
    raise ValueError(f"method: {method!r} has no link schedule")
  k, c = num_stages - 1, int(chunks)
  f, b = (delay if d == methods.DELAY else d for d in m.delays)
  if m.ring == CORRECTED:
    return Schedule((f,) * k, (b,) * k, CORRECTED, int(lr_anneal), float(ema_decay), c)
  return Schedule((f,) * k, (b,) * k, mode or m.ring, chunks=c)


def init_pipeline(stages, optimizer, schedule: Schedule, rng, sample_x) -> list[dict]:
  """Per-stage state: params, model_state, opt_state, the ring buffers and the incoming FIFOs.

  A stage that keeps its forward's activations (corrected, below the last) holds them in `act_ring`
  and an empty `in_ring` (its input's shape, no slot). chunks > 1 with a model state: ConfigError."""
  state = []
  x = jnp.asarray(sample_x)
  for k, stage in enumerate(stages):
    params, model_state = init_model(stage, jax.random.fold_in(rng, k), x[:1])
    if schedule.chunks > 1 and model_state:
      raise ConfigError(
        f"chunks: {schedule.chunks} is not allowed with stage {k}'s model state (BatchNorm): its batch "
        "statistics would be per chunk"
      )
    s = schedule.staleness[k]
    keeps = schedule.keeps_activations(k)
    st = {
      "params": params,
      "model_state": model_state,
      "opt_state": optimizer.init(params),
      "in_ring": jnp.zeros((0 if keeps else s + 1,) + x.shape, x.dtype),
    }
    if keeps:
      kept = jax.eval_shape(
        functools.partial(_forward_keeping, stage, schedule.chunks), params, model_state, x
      )[1]
      st["act_ring"] = jax.tree.map(lambda a: jnp.zeros((s + 1,) + a.shape, a.dtype), kept)
    if schedule.mode == "stash":
      st["param_ring"] = jax.tree.map(lambda a: jnp.broadcast_to(a, (s + 1,) + a.shape), params)
    if schedule.mode == CORRECTED:
      st["delta"] = jax.tree.map(jnp.zeros_like, params)
    if k > 0 and schedule.fwd_delays[k - 1]:
      st["fwd_fifo"] = jnp.zeros((schedule.fwd_delays[k - 1],) + x.shape, x.dtype)
    y = jax.eval_shape(lambda p, m, x: apply_model(stage, p, m, x, train=False)[0], params, model_state, x)
    if k < len(stages) - 1 and schedule.bwd_delays[k]:
      st["bwd_fifo"] = jnp.zeros((schedule.bwd_delays[k],) + y.shape, y.dtype)
    state.append(st)
    x = jnp.zeros(y.shape, y.dtype)
  return state


def push(fifo, item):
  """FIFO of fixed length: drop the oldest (index 0), append the newest."""
  return jnp.concatenate([fifo[1:], item[None]], axis=0)


def _spec(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _forward_keeping(stage, chunks: int, params, model_state, x):
  """corrected: the stage's forward over `chunks` equal chunks of x, each keeping its activations
  (pipemare.forward). Returns (y, {"acts": a tuple of each chunk's, "model_state": the new one})."""
  xs = jnp.split(x, chunks) if chunks > 1 else [x]
  plan = pipemare.make_plan(stage, *_spec((params, model_state, xs[0])))
  parts = [pipemare.forward(plan, params, model_state, xc) for xc in xs]
  y = jnp.concatenate([y for (y, _), _ in parts]) if chunks > 1 else parts[0][0][0]
  return y, {"acts": tuple(kept for _, kept in parts), "model_state": parts[-1][0][1]}


def stage_forward(stage, schedule: Schedule, k: int, st: dict, x_in, t):
  """Stage k's forward at tick t: store the input (and params in stash mode; the activations instead
  of the input where the stage keeps them), return the output.

  The running statistics of BatchNorm are updated only in the backward's recompute pass (our choice),
  so this forward's model_state update is discarded; a stage that keeps its activations keeps its
  forward's update with them, applied with its backward's. The last stage only stores: its backward
  (S=0) runs the forward of the same batch in the same tick.
  """
  s = schedule.staleness[k]
  slot = t % (s + 1)
  if schedule.keeps_activations(k):
    y, kept = _forward_keeping(stage, schedule.chunks, st["params"], st["model_state"], x_in)
    ring = jax.tree.map(lambda r, a: r.at[slot].set(a), st["act_ring"], kept)
    return dict(st, act_ring=ring), y
  st = dict(st, in_ring=st["in_ring"].at[slot].set(x_in))
  if schedule.mode == "stash":
    st["param_ring"] = jax.tree.map(lambda r, p: r.at[slot].set(p), st["param_ring"], st["params"])
  if k == schedule.num_stages - 1:
    return st, None
  y, _ = apply_model(stage, st["params"], st["model_state"], x_in, train=True)
  return st, y


def stage_backward(
  stage, optimizer, schedule: Schedule, k: int, st: dict, cotangent, labels, t, num_batches, chunks=None
):
  """Stage k's backward at tick t on the batch stored S_k ticks ago, then its update at once.

  `cotangent` is dL/d(output) from stage k+1 (None for the last stage, which uses `labels`). Returns
  (state, dL/d(input), loss). Nothing is applied during warm-up or drain (batch index out of range).
  `chunks` (default: the schedule's): the backward over that many equal chunks of the batch; a stage
  that keeps its activations follows the chunks its forward kept.
  """
  chunks = schedule.chunks if chunks is None else chunks
  s = schedule.staleness[k]
  old = (t - s) % (s + 1)
  params = backward_params(schedule, k, st, old)
  metrics = (jnp.nan, jnp.nan)
  if schedule.keeps_activations(k):
    kept = jax.tree.map(lambda r: r[old], st["act_ring"])
    g_p, g_x, new_ms = _kept_grads(stage, st, kept, params, cotangent)
  else:
    x_old = st["in_ring"][old]
    fwd = lambda p, x: apply_model(stage, p, st["model_state"], x, train=True)
    if cotangent is None:  # last stage: loss and backward at once
      g_p, g_x, (metrics, new_ms) = _loss_grads(fwd, params, x_old, labels, chunks)
    else:
      g_p, g_x, mss = _over_chunks(functools.partial(_recompute_grads, fwd, params), chunks, x_old, cotangent)
      new_ms = mss[-1]
  st = apply_update(optimizer, schedule, k, st, g_p, new_ms, t, num_batches)
  return st, g_x, metrics


def _over_chunks(fn, chunks: int, *arrays):
  """fn(*chunk) -> (g_p, g_x, aux) over `chunks` equal chunks of the arrays' leading axis in turn.
  Returns (g_p, g_x, [aux of each chunk]); chunks == 1: fn's one call."""
  if chunks == 1:
    g_p, g_x, aux = fn(*arrays)
    return g_p, g_x, [aux]
  return _joined([fn(*c) for c in zip(*(jnp.split(a, chunks) for a in arrays))])


def _joined(parts):
  """Chunks' (g_p, g_x, aux): the parameter gradients summed in chunk order, the input gradients
  concatenated, the auxes listed."""
  g_p = jax.tree.map(lambda *g: sum(g), *[g for g, _, _ in parts])
  return g_p, jnp.concatenate([gx for _, gx, _ in parts]), [aux for _, _, aux in parts]


def _recompute_grads(fwd, params, x, cotangent):
  """The vjp of the stage's forward recomputed at `params` on x: (g_p, g_x, its new model state)."""
  (_, new_ms), pullback = jax.vjp(fwd, params, x)
  g_p, g_x = pullback((cotangent, jax.tree.map(jnp.zeros_like, new_ms)))
  return g_p, g_x, new_ms


def _loss_grads(fwd, params, x, labels, chunks: int):
  """The last stage: the batch's mean loss (with chunks, the mean of equal chunks' means) and its
  gradients. Returns (g_p, g_x, ((loss, acc), new model state))."""

  def grads(x, y):
    def loss_fn(p, x):
      logits, ms = fwd(p, x)
      return losses.cross_entropy(logits, y) / chunks, (ms, losses.accuracy(logits, y) / chunks)

    (loss, (ms, acc)), (g_p, g_x) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, x)
    return g_p, g_x, ((loss, acc), ms)

  g_p, g_x, aux = _over_chunks(grads, chunks, x, labels)
  if chunks == 1:
    return g_p, g_x, aux[0]
  metrics = tuple(sum(m[i] for m, _ in aux) for i in range(2))
  return g_p, g_x, (metrics, aux[-1][1])


def _kept_grads(stage, st, kept, params_bwd, cotangent):
  """A stage that keeps its activations: each chunk's backward from its forward's activations with
  every weight operand at params_bwd (pipemare.backward). Returns (g_p, g_x, the forward's new model
  state)."""
  acts = kept["acts"]
  x_shape = st["in_ring"].shape[1:]
  x_chunk = jax.ShapeDtypeStruct((x_shape[0] // len(acts),) + x_shape[1:], st["in_ring"].dtype)
  plan = pipemare.make_plan(stage, *_spec((st["params"], st["model_state"])), x_chunk)
  cots = jnp.split(cotangent, len(acts)) if len(acts) > 1 else [cotangent]
  parts = [(*pipemare.backward(plan, params_bwd, a, c), None) for a, c in zip(acts, cots)]
  g_p, g_x, _ = _joined(parts) if len(parts) > 1 else parts[0]
  return g_p, g_x, kept["model_state"]


def backward_params(schedule: Schedule, k: int, st: dict, old):
  """The parameters stage k's backward differentiates at: the stashed version (stash), PipeMare's
  estimate of the version the forward used, w - S_k delta (corrected: the backward's weight operands
  only, see stage_backward), or the current ones."""
  if schedule.mode == "stash":
    return jax.tree.map(lambda r: r[old], st["param_ring"])
  if schedule.mode == CORRECTED:
    s = schedule.staleness[k]
    return jax.tree.map(lambda w, d: w - s * d, st["params"], st["delta"])
  return st["params"]


def lr_scale(schedule: Schedule, k: int, update):
  """PipeMare's step-size rescheduling: stage k's step size times S_k^-(1 - min(u / lr_anneal, 1)) at
  its update u (1 for S_k <= 1, without annealing, and outside corrected mode)."""
  s = schedule.staleness[k]
  if schedule.mode != CORRECTED or s <= 1 or schedule.lr_anneal <= 0:
    return 1.0
  p = 1.0 - jnp.minimum(jnp.asarray(update, jnp.float32) / schedule.lr_anneal, 1.0)
  return jnp.asarray(float(s), jnp.float32) ** -p


def apply_update(optimizer, schedule: Schedule, k: int, st: dict, g_p, new_ms, t, num_batches):
  """Stage k's optax update from the gradient of its backward at tick t; a no-op during warm-up and
  drain (the backward's batch index is out of range). Scaling optax's update scales its step size at
  this step for every optimizer of optim.py (each ends in a multiplication by the learning rate)."""
  batch = t - schedule.offsets[k] - schedule.staleness[k]
  valid = (batch >= 0) & (batch < num_batches)
  updates, opt_state = optimizer.update(g_p, st["opt_state"], st["params"])
  extra = {}
  if schedule.mode == CORRECTED:
    scale = lr_scale(schedule, k, batch)
    updates = jax.tree.map(lambda u: scale * u, updates)
    gamma = schedule.gamma(k)  # delta follows w_new - w_old, which is the (scaled) update
    extra["delta"] = jax.tree.map(lambda d, u: gamma * d + (1 - gamma) * u, st["delta"], updates)
  keep = lambda new, cur: jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, cur)
  return dict(
    st,
    params=keep(optax.apply_updates(st["params"], updates), st["params"]),
    opt_state=keep(opt_state, st["opt_state"]),
    model_state=keep(new_ms, st["model_state"]),
    **{key: keep(v, st[key]) for key, v in extra.items()},
  )


def stage_fused(stage, optimizer, schedule: Schedule, k: int, st: dict, x_in, cotangent, t, num_batches):
  """A middle stage's whole tick in recompute mode with ONE forward call: the new batch and the input
  stored S_k ticks ago go through the stage together (both with the current parameters, which is what
  lets them share the call), the backward takes the stored half's error gradient (zeros for the new
  half). Returns (state, output of the new batch, dL/d(stored input)). Numerically recompute mode's
  forward + backward; on BatchNorm the batch statistics would mix the two batches, so models with a
  model state are refused (config). Needs S_k >= 1: the new input goes to another slot than the old."""
  s = schedule.staleness[k]
  x_old = st["in_ring"][(t - s) % (s + 1)]
  n = x_in.shape[0]

  def both(p, xo):
    y, _ = apply_model(stage, p, st["model_state"], jnp.concatenate([x_in, xo]), train=True)
    return y

  y_2b, pullback = jax.vjp(both, st["params"], x_old)
  g_p, g_x = pullback(jnp.concatenate([jnp.zeros_like(y_2b[:n]), cotangent]))
  st = dict(st, in_ring=st["in_ring"].at[t % (s + 1)].set(x_in))
  st = apply_update(optimizer, schedule, k, st, g_p, st["model_state"], t, num_batches)
  return st, y_2b[:n], g_x


def stage_forward_residuals(stage, params, model_state, x_in, chunks: int = 1):
  """residuals mode: the forward of a middle stage, and its vjp (a pytree of the residuals the
  backward needs: the parameters and activations it used) to keep in the ring buffer.

  chunks > 1: the batch as that many equal chunks, one vjp each (a tuple of them): the numerics of one
  call up to float order (no model state: BatchNorm statistics would be per chunk), and smaller calls
  run faster per example on a CPU whose caches a whole batch's activations overflow."""
  fwd = lambda p, x: apply_model(stage, p, model_state, x, train=True)
  if chunks == 1:
    return jax.vjp(fwd, params, x_in, has_aux=True)
  parts = [jax.vjp(fwd, params, xc, has_aux=True) for xc in jnp.split(x_in, chunks)]
  return jnp.concatenate([y for y, _, _ in parts]), tuple(pb for _, pb, _ in parts), parts[-1][2]


def stage_backward_residuals(
  optimizer, schedule: Schedule, k: int, st: dict, pullback, new_ms, cotangent, t, num_batches
):
  """residuals mode: the backward of the batch whose forward left `pullback` S_k ticks ago (no
  recompute), then the update of the current parameters. Returns (state, dL/d(input))."""
  if isinstance(pullback, tuple):  # chunks: each chunk's share of the batch's error gradient
    parts = [pb(c) for pb, c in zip(pullback, jnp.split(cotangent, len(pullback)))]
    g_p = jax.tree.map(lambda *g: sum(g), *[g for g, _ in parts])
    g_x = jnp.concatenate([gx for _, gx in parts])
  else:
    g_p, g_x = pullback(cotangent)
  return apply_update(optimizer, schedule, k, st, g_p, new_ms, t, num_batches), g_x


# Where a stage's forward input and backward cotangent come from at tick t: the one rule of the tick's
# order, read by every placement (make_tick, devices.make_device_tick, per_process.Stage.tick).
BATCH, LABELS, NOW, FIFO = "batch", "labels", "now", "fifo"


def input_source(schedule: Schedule, k: int) -> str:
  """BATCH (stage 0: batch t), NOW (a locked link: this tick's output of stage k-1, so the forward
  waits for it) or FIFO (a link of delay f: the head of its FIFO, the output of tick t - f)."""
  if k == 0:
    return BATCH
  return NOW if schedule.fwd_delays[k - 1] == 0 else FIFO


def cotangent_source(schedule: Schedule, k: int) -> str:
  """LABELS (the last stage: its loss), NOW (a locked link: this tick's input gradient of stage k+1,
  so the backward waits for it) or FIFO (a link of delay b: the head of its FIFO)."""
  if k == schedule.num_stages - 1:
    return LABELS
  return NOW if schedule.bwd_delays[k] == 0 else FIFO


def make_tick(stages, optimizer, schedule: Schedule, num_batches: int):
  """Returns tick(state, x_t, y_t, t) -> (state, (loss, acc)) advancing every stage by one tick, as
  one jitted function (stages in their own processes: pipeline/per_process.py).

  x_t is batch t (enters stage 0); y_t the labels of batch t - F_{K-1} (the last stage's).
  """
  K = len(stages)
  f, b = schedule.fwd_delays, schedule.bwd_delays
  fwd = [functools.partial(stage_forward, stages[k], schedule, k) for k in range(K)]
  bwd = [functools.partial(stage_backward, stages[k], optimizer, schedule, k) for k in range(K)]

  def tick(state, x_t, y_t, t):
    state = list(state)
    outs = [None] * K
    for k in range(K):  # forward wave
      src = input_source(schedule, k)
      x_in = x_t if src == BATCH else outs[k - 1] if src == NOW else state[k]["fwd_fifo"][0]
      state[k], outs[k] = fwd[k](state[k], x_in, t)
    grads_in = [None] * K
    metrics = None
    for k in reversed(range(K)):  # backward wave
      src = cotangent_source(schedule, k)
      cot = None if src == LABELS else grads_in[k + 1] if src == NOW else state[k]["bwd_fifo"][0]
      state[k], grads_in[k], m = bwd[k](state[k], cot, y_t if src == LABELS else None, t, num_batches)
      if k == K - 1:
        metrics = m
    for k in range(K - 1):  # the links advance
      if f[k]:
        state[k + 1]["fwd_fifo"] = push(state[k + 1]["fwd_fifo"], outs[k])
      if b[k]:
        state[k]["bwd_fifo"] = push(state[k]["bwd_fifo"], grads_in[k + 1])
    return state, metrics

  return jax.jit(tick, donate_argnums=0)


def stored_bytes(state: list[dict]) -> list[dict]:
  """Bytes each stage holds, by kind, read from the live state (not a formula)."""
  size = lambda t: int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(t)))
  out = []
  for st in state:
    out.append(
      {
        "params": size(st["params"]),
        "inputs": size(st["in_ring"]),
        "activations": size(st.get("act_ring", {})),  # corrected: the forward's, kept S_k + 1 ticks
        "param_versions": size(st.get("param_ring", {})),
        "correction": size(st.get("delta", {})),  # PipeMare's moving average of updates: one weight copy
        # one_device's FIFOs, or placement=spmd's link rings that replace them (pipeline/program.py)
        "fifos": sum(size(st.get(key, [])) for key in ("fwd_fifo", "bwd_fifo", "up_ring", "down_ring")),
        "optimizer": size(st["opt_state"]),
      }
    )
  return out
