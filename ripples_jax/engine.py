"""Executes a schedule's rounds on stacked per-worker state with one jitted round function.

State is a plain dict whose leaves carry a leading worker axis W, sharded over the mesh axis 'worker':
  params       worker replicas of the model parameters  (averaged by P-Reduce)
  model_state  other model collections, e.g. batch_stats (averaged with the params: the authors'
               P-Reduce averages every variable)
  opt_state    optax state, local to each worker (never averaged, as in the Ripples worker loop)
A round (docs/design.md 3.3): every worker in `step_mask` computes a gradient on its batch and applies its
local
optimizer update; then the round's layout averages parameters within groups. The mask and the layout
index are inputs (data), so the schedule can change every round without recompiling.
"""

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ripples_jax import collectives, losses, optim
from ripples_jax.collectives import WORKER_AXIS, Layout
from ripples_jax.models import apply_model, init_model

PREDUCE_IMPLS = ("auto", "collective", "segment")
CHEAP_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def worker_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(WORKER_AXIS))


def init_state(
  model, optimizer: optax.GradientTransformation, rng, sample_x, num_workers: int, mesh: Mesh
) -> dict:
  """Same initial parameters x_0 on every worker, stacked on the worker axis and sharded."""

  def init(rng):
    params, model_state = init_model(model, rng, sample_x)
    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (num_workers,) + jnp.shape(a)), t)
    return {
      "params": stack(params),
      "model_state": stack(model_state),
      "opt_state": stack(optimizer.init(params)),
    }

  # Runs once, so compile it cheaply: the random-number code of a ResNet init otherwise takes ~10 s to
  # optimise on CPU for no gain.
  init = jax.jit(init, out_shardings=worker_sharding(mesh), compiler_options=CHEAP_COMPILE)
  return init(rng)


def resolve_preduce_impl(impl: str, num_workers: int, mesh: Mesh) -> str:
  """`collective` needs one worker per device; `auto` picks it whenever that holds."""
  if impl == "auto":
    return "collective" if mesh.size == num_workers else "segment"
  if impl == "collective" and mesh.size != num_workers:
    raise ValueError(
      f"config.preduce_impl: 'collective' is not allowed with {num_workers} workers on "
      f"{mesh.size} devices: it needs one device per worker (use 'segment' or 'auto')"
    )
  return impl


def cross_entropy_loss(model, params, model_state, x_BxI, y_B, train: bool = True):
  logits_BxC, new_model_state = apply_model(model, params, model_state, x_BxI, train=train)
  return losses.cross_entropy(logits_BxC, y_B), new_model_state


def make_round_fn(
  model,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  layouts: Sequence[Layout],
  preduce_impl: str = "auto",
) -> Callable:
  """Returns jitted round(state, x_WxB.., y_WxB, step_mask_W, layout_idx) -> (state, loss_W).

  With the `collective` P-Reduce the layout index selects one of `layouts` (lax.switch over grouped
  psums, compiled once for the whole tuple). With `segment` the per-worker group ids of every layout
  are stacked into a table and the index picks a row, so any number of layouts costs one compile.
  """
  layouts = tuple(layouts)
  n = sum(len(g) for g in layouts[0])
  impl = resolve_preduce_impl(preduce_impl, n, mesh)
  gid_table_LxN = np.stack([collectives.group_ids(l, n) for l in layouts])

  def local_step(params, model_state, opt_state, x_BxI, y_B):
    grad_fn = jax.value_and_grad(functools.partial(cross_entropy_loss, model), has_aux=True)
    (loss, new_model_state), grads = grad_fn(params, model_state, x_BxI, y_B)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_model_state, new_opt_state, loss

  def shard_round(state, x_KxB, y_KxB, step_mask_K, layout_idx, gid_table):
    # K = workers on this device. The local step runs for every worker and is masked afterwards:
    # a masked worker keeps its params and optimizer state exactly.
    params, model_state, opt_state, loss_K = jax.vmap(local_step)(
      state["params"], state["model_state"], state["opt_state"], x_KxB, y_KxB
    )
    keep = lambda new, old: jax.tree.map(
      lambda a, b: jnp.where(step_mask_K.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old
    )
    params = keep(params, state["params"])
    model_state = keep(model_state, state["model_state"])
    opt_state = keep(opt_state, state["opt_state"])

    # P-Reduce on parameters and model state, flattened into one buffer (one collective per round).
    buf_KxD, unravel = collectives.ravel_workers({"params": params, "model_state": model_state})
    if impl == "collective":
      buf_KxD = collectives.switched_grouped_mean_in_shard(buf_KxD, layouts, layout_idx)
    else:
      buf_KxD = collectives.segment_mean_in_shard(buf_KxD, gid_table[layout_idx])
    averaged = unravel(buf_KxD)
    new_state = {"params": averaged["params"], "model_state": averaged["model_state"], "opt_state": opt_state}
    return new_state, jnp.where(step_mask_K, loss_K, jnp.nan)

  w = P(WORKER_AXIS)
  # check_vma=False: shard_map rejects psum's axis_index_groups otherwise (docs/design.md 5).
  sharded = jax.shard_map(
    shard_round, mesh=mesh, in_specs=(w, w, w, w, P(), P()), out_specs=(w, w), check_vma=False
  )

  @functools.partial(jax.jit, donate_argnums=0)
  def round_fn(state, x_WxB, y_WxB, step_mask_W, layout_idx):
    return sharded(
      state, x_WxB, y_WxB, step_mask_W, jnp.asarray(layout_idx, jnp.int32), jnp.asarray(gid_table_LxN)
    )

  return round_fn


def mean_params(tree):
  """The average model x_bar over the worker axis."""
  return jax.tree.map(lambda a: jnp.mean(a, axis=0), tree)


def consensus_distance(params) -> jax.Array:
  """Mean over workers of ||x_i - x_bar||_2 (all parameters flattened)."""
  sq_W = sum(
    jnp.sum(jnp.square(a - a.mean(0, keepdims=True)).reshape(a.shape[0], -1), axis=1)
    for a in jax.tree.leaves(params)
  )
  return jnp.mean(jnp.sqrt(sq_W))


# Evaluation at scale: the averaged model over the test set in chunks of this many examples; each
# worker's own accuracy on at most the first WORKER_EVAL_EXAMPLES test examples (the whole standard
# MNIST-1D test set), WORKER_CHUNK workers per vmapped call, so memory stays flat in workers and test size.
EVAL_CHUNK = 8192
WORKER_EVAL_EXAMPLES = 1000
WORKER_CHUNK = 256


def make_eval_fn(model) -> Callable:
  """Returns eval(state, x_NxI, y_N, workers=True) -> dict of the averaged model's accuracy and loss,
  the consensus distance and (workers=True) the workers' own models' accuracies (mean, median worker,
  worst worker), the costly part: one forward pass per worker."""

  def scores(params, model_state, x, y):
    logits, _ = apply_model(model, params, model_state, x, train=False)
    return losses.accuracy(logits, y), losses.cross_entropy(logits, y)

  averaged = jax.jit(scores)

  @jax.jit
  def own(params, model_state, x, y):
    per = lambda pm: scores(pm[0], pm[1], x, y)[0]
    acc_W = jax.lax.map(per, (params, model_state), batch_size=WORKER_CHUNK)
    return jnp.mean(acc_W), jnp.median(acc_W), jnp.min(acc_W)

  @jax.jit
  def summary(state):
    return (
      mean_params(state["params"]),
      mean_params(state["model_state"]),
      consensus_distance(state["params"]),
    )

  def eval_fn(state, x, y, workers: bool = True):
    p, ms, distance = summary(state)
    n = len(y)
    parts = [(i, min(i + EVAL_CHUNK, n)) for i in range(0, n, EVAL_CHUNK)]
    got = [averaged(p, ms, x[a:b], y[a:b]) for a, b in parts]  # chunk means, weighted by size
    acc = sum(g[0] * (b - a) for g, (a, b) in zip(got, parts)) / n if len(parts) > 1 else got[0][0]
    loss = sum(g[1] * (b - a) for g, (a, b) in zip(got, parts)) / n if len(parts) > 1 else got[0][1]
    out = {"test_accuracy": acc, "test_loss": loss, "consensus_distance": distance}
    if workers:
      k = min(n, WORKER_EVAL_EXAMPLES)
      # The workers' own models (what a worker holds and could deploy): their mean, the median worker
      # and the worst, on the first k test examples.
      mean, median, worst = own(state["params"], state["model_state"], x[:k], y[:k])
      out.update(
        worker_test_accuracy=mean, worker_median_test_accuracy=median, worker_min_test_accuracy=worst
      )
    return out

  return eval_fn


def make_grad_allreduce_fn(model, optimizer: optax.GradientTransformation, mesh: Mesh) -> Callable:
  """Conventional synchronous data parallel (Horovod style): all-reduce the *gradients*, then update.

  Same stacked state and signature as the round function (minus the schedule inputs), so the two can be
  timed side by side. Every worker applies the same averaged gradient, so replicas stay identical.
  """

  def local_grad(params, model_state, x_BxI, y_B):
    grad_fn = jax.value_and_grad(functools.partial(cross_entropy_loss, model), has_aux=True)
    (loss, new_model_state), grads = grad_fn(params, model_state, x_BxI, y_B)
    return grads, new_model_state, loss

  def shard_step(state, x_KxB, y_KxB):
    grads, model_state, loss_K = jax.vmap(local_grad)(state["params"], state["model_state"], x_KxB, y_KxB)
    # One buffer, one collective, as the round function does for parameters.
    buf_KxD, unravel = collectives.ravel_workers({"grads": grads, "model_state": model_state})
    n = buf_KxD.shape[0] * mesh.size
    buf_KxD = jnp.broadcast_to(jax.lax.psum(buf_KxD.sum(0), WORKER_AXIS) / n, buf_KxD.shape)
    avg = unravel(buf_KxD)
    updates, opt_state = jax.vmap(optimizer.update)(avg["grads"], state["opt_state"], state["params"])
    params = jax.vmap(optax.apply_updates)(state["params"], updates)
    return {"params": params, "model_state": avg["model_state"], "opt_state": opt_state}, loss_K

  w = P(WORKER_AXIS)
  sharded = jax.shard_map(shard_step, mesh=mesh, in_specs=(w, w, w), out_specs=(w, w))
  return jax.jit(sharded, donate_argnums=0)


def init_sim_state(model, optimizer, rng, sample_x, num_slots: int, mesh: Mesh) -> dict:
  """Round state for the event-driven simulator: init_state plus each slot's pending gradient."""
  state = init_state(model, optimizer, rng, sample_x, num_slots, mesh)
  state["grads"] = jax.tree.map(jnp.zeros_like, state["params"])
  return state


def _masked(mask, new, old):
  """new where mask (one entry per slot), else old, leaf by leaf."""
  return jax.tree.map(lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


def _scaled(grads, scale):
  """Each slot's gradient times its scale (ps.staleness=divide: 1 / the gradient's staleness, so an SGD
  optimizer applies it at lr / staleness). None traces nothing: the rounds of every other run are the
  programs they always were."""
  if scale is None:
    return grads
  return jax.tree.map(lambda a: a * scale.reshape((-1,) + (1,) * (a.ndim - 1)).astype(a.dtype), grads)


def _reset(optimizer, reset, params, opt_state):
  """Fresh optimizer state (optimizer.init: zero momentum) where `reset`: a rejoined worker (docs/design.md
  3.10), its learning-rate schedule kept at its own step count (optim.at_schedule_step). None traces
  nothing, so the rounds of a run without leave/join are the programs they always were."""
  if reset is None:
    return opt_state
  fresh = optim.at_schedule_step(jax.vmap(optimizer.init)(params), opt_state)
  return _masked(reset, fresh, opt_state)


def _grad_step(model, params, model_state, x_BxI, y_B):
  """One slot's gradient, new model state and loss on its batch."""
  grad_fn = jax.value_and_grad(functools.partial(cross_entropy_loss, model), has_aux=True)
  (loss, new_model_state), grads = grad_fn(params, model_state, x_BxI, y_B)
  return grads, new_model_state, loss


def make_sim_round_fn(
  model,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  num_workers: int,
  num_slots: int,
  cross_apply: bool = False,
  ring: bool = False,
  pull: bool = False,
  outer: tuple[float, float] | None = None,
) -> Callable:
  """Returns jitted round(state, x_SxB, y_SxB, apply_src_S, gid_S, ring_now, pull_src_S, start_S,
  reset_S=None, outer_now=False, scale_S=None).

  One round executes a packed batch of clock events in four phases, each at most once per slot:
    A apply:   slot s applies the pending gradient of slot apply_src[s] (-1: none) with its own optimizer,
               the gradient times scale_S[s] first (ps.staleness=divide: 1 / its staleness; None: as is)
    B average: segment mean of params and model state over group ids gid (own id: untouched), or the
               D-PSGD ring average of the first num_workers slots when ring_now, or, with `outer` =
               (lr, momentum) and outer_now, DiLoCo's outer step (diloco_outer_step; the state then
               holds "outer", init_outer_state)
    C pull:    slot s copies the params of slot pull_src[s] (a worker pulling the server's model); slots
               in reset_S (a rejoined worker's first group, docs/design.md 3.10) then take fresh
               optimizer state, optimizer.init of their new params (None: no slot ever resets)
    D start:   slots in start compute a gradient on their current params and keep it pending
  The packing guarantees each slot's events keep their clock order (timeline.pack_rounds). Slots past
  num_workers are the parameter server and padding. The static flags compile only what an algorithm
  uses (cross-slot applies, the ring, pulls). Rounds that touch few slots take
  `make_compact_round_fn` instead (the executor picks per round; both compute the same bits).
  """
  ar = np.arange(num_slots)
  ring_prev = np.where(ar < num_workers, (ar - 1) % num_workers, ar)
  ring_next = np.where(ar < num_workers, (ar + 1) % num_workers, ar)
  grad_step = functools.partial(_grad_step, model)
  masked = _masked

  def round_fn(
    state,
    x_SxB,
    y_SxB,
    apply_src_S,
    gid_S,
    ring_now,
    pull_src_S,
    start_S,
    reset_S=None,
    outer_now=False,
    scale_S=None,
  ):
    params, model_state, opt_state, grads = (
      state[k] for k in ("params", "model_state", "opt_state", "grads")
    )
    # A: apply finished gradients (computed on the params held when they started: stale by design).
    has = apply_src_S >= 0
    g = grads
    if cross_apply:
      g = jax.tree.map(lambda a: jnp.take(a, jnp.where(has, apply_src_S, ar), axis=0), grads)
    g = _scaled(g, scale_S)
    updates, new_opt = jax.vmap(optimizer.update)(g, opt_state, params)
    params = masked(has, jax.vmap(optax.apply_updates)(params, updates), params)
    opt_state = masked(has, new_opt, opt_state)

    # B: P-Reduce within groups (or the ring), leaf by leaf: the same sums as over one flattened
    # buffer, without its two copies of the whole state (the simulator's rounds are memory-bound).
    def mix(a):
      flat = collectives.segment_mean(a.reshape(a.shape[0], -1), gid_S)
      if ring:
        flat = jnp.where(ring_now, (flat[ring_prev] + flat + flat[ring_next]) / 3, flat)
      # C: pulls copy another slot's parameters.
      return (flat[pull_src_S] if pull else flat).reshape(a.shape)

    params, model_state = jax.tree.map(mix, (params, model_state))
    extra = {}
    if outer is not None:  # cond: the outer step's work only in the rounds that have one
      step = functools.partial(diloco_outer_step, *outer)
      params, model_state, extra["outer"] = jax.lax.cond(
        outer_now, step, lambda *a: a, params, model_state, state["outer"]
      )
    opt_state = _reset(optimizer, reset_S, params, opt_state)
    # D: start new gradients on the current params; the loss reported is the one at the start.
    new_grads, new_model_state, loss_S = jax.vmap(grad_step)(params, model_state, x_SxB, y_SxB)
    grads = masked(start_S, new_grads, grads)
    model_state = masked(start_S, new_model_state, model_state)
    new_state = dict(params=params, model_state=model_state, opt_state=opt_state, grads=grads, **extra)
    return new_state, jnp.where(start_S, loss_S, jnp.nan)

  s = worker_sharding(mesh)
  return jax.jit(round_fn, donate_argnums=0, out_shardings=(s, s))


def make_compact_round_fn(
  model, optimizer: optax.GradientTransformation, mesh: Mesh, num_slots: int
) -> Callable:
  """Returns jitted round(state, idx_C, x_CxB, y_CxB, apply_src_C, gid_C, pull_src_C, start_C,
  reset_C=None, scale_C=None).

  The phases of `make_sim_round_fn` (apply < average < pull < start) on the C slots a round touches
  only, gathered from the stacked state by idx_C and scattered back, so a round costs what its events
  do, not what all the slots would. idx_C lists the touched slots in increasing order, padded with
  num_slots (its gathers clip, its scatters are dropped); apply_src_C holds global slot ids (-1: none;
  a source's pending gradient is read from the full state), gid_C and pull_src_C positions in idx_C (a
  group's id is its first member's position; padding has its own), scale_C per position (the full
  round's scale_S). Every touched slot sees what the full round computes for it, in the same order of
  its members' sums; untouched slots are not read or written. One program per C: callers round C up
  to a power of two (sim.compact_round), so a run compiles at most log2(num_slots) + 1 of them. The
  D-PSGD ring touches every worker: it stays on the full round.
  """
  grad_step = functools.partial(_grad_step, model)
  masked = _masked

  def round_fn(
    state, idx_C, x_CxB, y_CxB, apply_src_C, gid_C, pull_src_C, start_C, reset_C=None, scale_C=None
  ):
    take = lambda t, i: jax.tree.map(lambda a: jnp.take(a, i, axis=0, mode="clip"), t)
    params, model_state, opt_state, grads = (
      take(state[k], idx_C) for k in ("params", "model_state", "opt_state", "grads")
    )
    # A: apply finished gradients, each read from its source slot (a worker's own, or a pusher's).
    has = apply_src_C >= 0
    g = _scaled(take(state["grads"], jnp.where(has, apply_src_C, idx_C)), scale_C)
    updates, new_opt = jax.vmap(optimizer.update)(g, opt_state, params)
    params = masked(has, jax.vmap(optax.apply_updates)(params, updates), params)
    opt_state = masked(has, new_opt, opt_state)
    # B: P-Reduce within the round's groups, leaf by leaf (as the full round); C: pulls.
    mix = lambda a: collectives.segment_mean(a.reshape(a.shape[0], -1), gid_C)[pull_src_C].reshape(a.shape)
    params, model_state = jax.tree.map(mix, (params, model_state))
    opt_state = _reset(optimizer, reset_C, params, opt_state)
    # D: start new gradients on the current params.
    new_grads, new_model_state, loss_C = jax.vmap(grad_step)(params, model_state, x_CxB, y_CxB)
    grads = masked(start_C, new_grads, grads)
    model_state = masked(start_C, new_model_state, model_state)
    put = lambda t, new: jax.tree.map(lambda a, b: a.at[idx_C].set(b, mode="drop"), t, new)
    new_state = {
      **state,  # what no compact round touches (DiLoCo's outer state) passes through
      "params": put(state["params"], params),
      "model_state": put(state["model_state"], model_state),
      "opt_state": put(state["opt_state"], opt_state),
      "grads": put(state["grads"], grads),
    }
    loss_S = (
      jnp.full((num_slots,), jnp.nan, loss_C.dtype)
      .at[idx_C]
      .set(jnp.where(start_C, loss_C, jnp.nan), mode="drop")
    )
    return new_state, loss_S

  s = worker_sharding(mesh)
  return jax.jit(round_fn, donate_argnums=0, out_shardings=(s, s))


def init_outer_state(params_SxP) -> dict:
  """DiLoCo's outer state for stacked params whose slots all hold the initial model: the global model
  and the outer momentum (zero), each with a leading axis of 1 (the simulator's sharding splits axis 0)."""
  return {
    "params": jax.tree.map(lambda a: a[:1], params_SxP),
    "momentum": jax.tree.map(lambda a: jnp.zeros_like(a[:1]), params_SxP),
  }


def diloco_outer_step(lr: float, momentum: float, params_SxP, model_state_SxM, outer: dict):
  """DiLoCo's outer step (Douillard et al., 2023) with Nesterov momentum, as torch's SGD(nesterov):
    g = mean over slots s of (global - params_s)     the pseudo-gradient
    m = momentum * m + g;  global = global - lr * (g + momentum * m)
  Every slot restarts from the new global model; model state (BatchNorm statistics) is averaged over
  the slots. Returns (params, model_state, outer) of the same shapes. With lr 1 and momentum 0 the new
  global model is the slots' mean (All-Reduce's average, to float rounding)."""
  g = jax.tree.map(lambda G, p: jnp.mean(G - p, axis=0, keepdims=True), outer["params"], params_SxP)
  m = jax.tree.map(lambda m, g: momentum * m + g, outer["momentum"], g)
  G = jax.tree.map(lambda G, g, m: G - lr * (g + momentum * m), outer["params"], g, m)
  every = lambda a_1, like: jnp.broadcast_to(a_1, like.shape)
  params = jax.tree.map(every, G, params_SxP)
  model_state = jax.tree.map(lambda a: every(a.mean(0, keepdims=True).astype(a.dtype), a), model_state_SxM)
  return params, model_state, {"params": G, "momentum": m}
