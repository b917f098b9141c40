r"""The pipeline runtime: stage k of a K-stage pipeline runs in process k (placement=per_process).

  python -m experiments.launch --num_processes=2 --module=experiments.train_dsp -- \
      --config=configs/dsp.py:method=dsp,num_stages=2 --config.placement=per_process --workdir=runs/dsp_mp

Every method runs here on equal terms: dsp (any mode), fr, ddg and pipedream (one schedule: its stored
graph, the forward's vjp residuals, which hold the weights the forward used: weight stashing), pipemare
(PipeDream's schedule, the forward's activations kept, the backward's weight operands at the corrected
weights: tick.py's corrected mode), model-parallel bp (zero
link delays and residuals: one forward and one backward per stage, no pipelining) and gpipe (M
micro-batches, rematerialised, one update after the flush). DNI is not here: its synthetic-gradient
step is a whole-model step (config.validate_dsp_config says so).

Invariants:
- A process holds its own stage only: parameters, optimizer state, the staleness ring buffer and the
  FIFOs of the links that deliver to it. Activations go up and error gradients down as point-to-point
  transfers (pipeline/link.py); both ends of a link issue the same sequence of transfers, each link on a
  thread of its own (link.LinkThread), so no cycle of waits can form.
- Slack: a FIFO slot holds the transfer that fills it (a future) until a tick reads it, so with link
  delay d a stage runs up to d - 1 ticks ahead of its neighbour and its transfers overlap its compute;
  a locked link (delay 0) waits for its transfer at once. Checkpoints and evaluations wait for the
  transfers in flight first (the same ones on both ends), so their cut is the lockstep one.
- Stragglers: a slow stage's compute calls take `slowdown` times as long (the padding sleeps inside the
  call's time, before anything is sent), on straggler_stage or on each stage with probability
  straggler_p per tick.
- A tick does what `tick.make_tick` does for this stage, in the same order, so the parameters after any
  tick equal the single-process tick's (tests/test_pipeline_runtime.py); fused and residuals are
  numerically recompute and stash.
- A stage whose links all have delay >= 1 (DSP) depends on its neighbours' previous tick only: stages
  run in parallel, and a slow stage holds its neighbours back through the links, not by a flush.
- Checkpoints: after tick t every stage saves its own state (RunLog per_process, no barrier); whatever
  was in flight on a link at the end of tick t is in the receiver's FIFO, so the saved states are a
  consistent cut. A resumed run restarts every stage from the newest tick all stages saved.
- The last stage holds the loss: it is the run's lead (metrics.jsonl, config.json, summary.json).
  Evaluation passes the test set up the stages after the same tick everywhere; its seconds are kept out
  of the training clock.
"""

import collections
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, SingleDeviceSharding

from ripples_jax import setup as setup_lib
from ripples_jax.distributed import coord
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.distributed.arrays import LOCAL, WORKER, to_global, to_local
from ripples_jax.distributed.host import pin_threads
from ripples_jax.distributed.markers import fail_now
from ripples_jax.errors import ConfigError
from ripples_jax.models import apply_model
from ripples_jax.pipeline import tick as tick_lib
from ripples_jax.pipeline import timing
from ripples_jax.pipeline.baselines import schedule_of
from ripples_jax.pipeline.link import Link, LinkThread, stage_device
from ripples_jax.runlog import RunLog, make_workdir


@dataclasses.dataclass
class Loop:
  """Where this stage stands; (tick, time) is the checkpoint's cursor."""

  tick: int = 0  # the next tick (gpipe: the next batch)
  time: float = 0.0  # training seconds before it, evaluation excluded (carried over a resume)
  eval_s: float = 0.0  # seconds spent evaluating (not training time)


class Clock:
  """Seconds of this stage's calls by kind (each call blocked on, so compute and link waits separate;
  "link": the compute thread waiting for a transfer's result), and the training clock at the end of
  every tick: the measured iteration. `slow`: this tick's straggler factor, which each compute call's
  time is padded to (a sleep inside the call's time)."""

  def __init__(self):
    self.calls = collections.defaultdict(list)
    self.tick_ends = []
    self.memory = {}  # kind -> XLA's compiled memory analysis of the program (where the backend has one)
    self.slow = 1.0

  def run(self, kind: str, fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    if kind != "link":
      if self.slow > 1:
        time.sleep((self.slow - 1) * (time.perf_counter() - t0))
      if kind not in self.memory:
        self.memory[kind] = compiled_memory(fn, args)
    self.calls[kind].append(time.perf_counter() - t0)
    return out

  def medians(self, skip: int = 2) -> dict:
    """Median seconds per call of each kind (the first `skip` calls, compiles, left out)."""
    return {k: float(np.median(v[skip:] if len(v) > skip else v)) for k, v in self.calls.items()}

  def totals(self) -> dict:
    return {k: float(np.sum(v)) for k, v in self.calls.items()}


def compiled_memory(fn, args) -> dict | None:
  """XLA's memory analysis of the jitted fn on args (an ahead-of-time compile of the same program,
  during the warm-up), or None where the backend reports none."""
  try:
    stats = fn.lower(*args).compile().memory_analysis()
  except Exception:  # noqa: BLE001  not every backend or function has one
    return None
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
  return None if stats is None else {k: int(getattr(stats, k, 0)) for k in keys}


def _drop(fn, index: int):
  """fn with output `index` replaced by None: stage 0's dL/d(input) is not needed, and XLA then never
  computes it (single-process BP does not either)."""

  def wrapped(*args):
    out = list(fn(*args))
    out[index] = None
    return tuple(out)

  return wrapped


class Stage:
  """This process's stage: its state, its jitted programs, its links, its clock."""

  def __init__(self, config, stages, optimizer, num_batches: int, sample_x, test_x):
    self.k, self.K = jax.process_index(), config.num_stages
    self.config, self.n, self.last = config, num_batches, jax.process_index() == config.num_stages - 1
    self.schedule = schedule_of(config)  # None: gpipe, its own loop
    self.device = stage_device(self.k)
    self.clock = Clock()
    self.boundary_bytes = 0  # gpipe: the micro-batch boundary inputs it keeps during an iteration
    k, stage, sch = self.k, stages[self.k], self.schedule
    full = tick_lib.init_pipeline(
      stages, optimizer, sch or tick_lib.method_schedule("bp", self.K), jax.random.key(config.seed), sample_x
    )
    st = full[k]
    if sch is None or (sch.mode == "residuals" and not self.last):
      # gpipe keeps its micro-batch inputs during an iteration only; residuals hold their input
      st = {key: v for key, v in st.items() if key != "in_ring"}
    if st["model_state"] and sch is not None and sch.mode == "fused":
      raise ConfigError(
        f"mode: fused is not allowed with {config.model}: it has a model state "
        "(BatchNorm), whose batch statistics would mix the two batches of the fused call"
      )
    self.state = jax.device_put(st, self.device)
    # The shape of every boundary: stage j's input, for the training batch and for the test set.
    ins = [np.zeros(s["in_ring"].shape[1:], s["in_ring"].dtype) for s in full]
    test_in = [jax.ShapeDtypeStruct(test_x.shape, test_x.dtype)]
    for j in range(self.K - 1):
      test_in.append(
        jax.eval_shape(
          lambda p, m, x, j=j: apply_model(stages[j], p, m, x, train=False)[0],
          full[j]["params"],
          full[j]["model_state"],
          test_in[-1],
        )
      )
    # Link j carries stage j + 1's input: the whole batch, GPipe's micro-batch, the test set.
    M = config.microbatches
    micro = lambda a: np.zeros((a.shape[0] // M,) + a.shape[1:], a.dtype)
    link = lambda j, like: Link(j, k, like[j + 1].shape, like[j + 1].dtype) if 0 <= j < self.K - 1 else None
    self.lower, self.upper = link(k - 1, ins), link(k, ins)
    self.lower_mb, self.upper_mb = link(k - 1, [micro(a) for a in ins]), link(k, [micro(a) for a in ins])
    self.eval_lower, self.eval_upper = link(k - 1, test_in), link(k, test_in)
    # The training links' transfers run on threads of their own (slack); the others only once drained.
    self.lower_t, self.upper_t = (LinkThread(x) if x is not None else None for x in (self.lower, self.upper))
    self.fwd_slots = self.bwd_slots = None  # the FIFOs as slots: arrays, or futures of transfers
    self._compile_programs(stage, optimizer)
    self.ring = collections.deque()
    if sch is not None and sch.mode == "residuals" and not self.last:
      # S_k placeholders (the warm-up's backwards are masked); the forward's vjp fixes the ring's shape.
      _, pb, ms = self.res_fwd(
        self.state["params"], self.state["model_state"], jax.device_put(jnp.asarray(ins[k]), self.device)
      )
      self.ring.extend([(pb, ms)] * sch.staleness[k])

  def _compile_programs(self, stage, optimizer):
    """The jitted programs this stage calls (jit is lazy: each compiles on its first call)."""
    k, sch, n = self.k, self.schedule, self.n
    first = k == 0
    if sch is not None:
      chunks = sch.chunks  # config: 1 with fused
      bwd = lambda st, cot, labels, t: tick_lib.stage_backward(
        stage, optimizer, sch, k, st, cot, labels, t, n, chunks
      )
      fused = lambda st, x, cot, t: tick_lib.stage_fused(stage, optimizer, sch, k, st, x, cot, t, n)
      res_bwd = lambda st, pb, ms, cot, t: tick_lib.stage_backward_residuals(
        optimizer, sch, k, st, pb, ms, cot, t, n
      )
      self.fwd = jax.jit(functools.partial(tick_lib.stage_forward, stage, sch, k))
      self.bwd = jax.jit(_drop(bwd, 1) if first else bwd)
      self.fused = jax.jit(_drop(fused, 2) if first else fused)
      self.res_fwd = jax.jit(lambda p, ms, x: tick_lib.stage_forward_residuals(stage, p, ms, x, chunks))
      self.res_bwd = jax.jit(_drop(res_bwd, 1) if first else res_bwd)
    M = self.config.microbatches

    def gp_bwd(p, ms, x, cot):  # rematerialised: the forward again, then its vjp
      return jax.vjp(lambda p, x: apply_model(stage, p, ms, x, train=True)[0], p, x)[1](cot)

    def gp_last(p, ms, x, y):
      def loss_fn(p, x):
        logits, new_ms = apply_model(stage, p, ms, x, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (jnp.mean(jnp.argmax(logits, -1) == y), new_ms)

      (loss, (acc, new_ms)), (g_p, g_x) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(p, x)
      return (loss, acc, new_ms), g_p, g_x

    def gp_update(st, grads_sum, ms):
      grads = jax.tree.map(lambda g: g / M, grads_sum)
      updates, opt_state = optimizer.update(grads, st["opt_state"], st["params"])
      return dict(st, params=optax.apply_updates(st["params"], updates), opt_state=opt_state, model_state=ms)

    self.gp_fwd = jax.jit(lambda p, ms, x: apply_model(stage, p, ms, x, train=True))
    self.gp_bwd = jax.jit(_drop(gp_bwd, 1) if first else gp_bwd)
    self.gp_last = jax.jit(_drop(gp_last, 2) if first else gp_last)
    self.gp_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
    self.gp_update = jax.jit(gp_update)
    self.ev_fwd = jax.jit(lambda p, ms, x: apply_model(stage, p, ms, x, train=False)[0])

  # -- one tick (dsp, fr, ddg, bp) --------------------------------------------------------------------

  def link(self, fn, *args):
    return self.clock.run("link", fn, *args)

  def post(self, lt: LinkThread, kind: str, x=None):
    """A transfer on link thread `lt`; without slack (runtime.slack=False) waited for at once."""
    future = lt.post(kind, x)
    if not self.config.runtime.slack:
      self.wait(future)
    return future

  def wait(self, future):
    """The result of a posted transfer; the compute thread's wait for it is the tick's link time."""
    return self.clock.run("link", future.result)

  def slot(self, slots):
    """The oldest FIFO entry (the input this tick reads), waited for if its transfer is in flight."""
    if not isinstance(slots[0], jax.Array):
      slots[0] = self.wait(slots[0])
    return slots[0]

  def load_slots(self, st) -> None:
    """The FIFOs of `st` (a fresh or resumed state) as slots."""
    self.fwd_slots = collections.deque(list(st["fwd_fifo"])) if "fwd_fifo" in st else None
    self.bwd_slots = collections.deque(list(st["bwd_fifo"])) if "bwd_fifo" in st else None

  def settle(self, st) -> dict:
    """Waits for every transfer in flight (both ends wait for the same ones) and writes the FIFO slots
    back into the state: what a checkpoint saves and what an evaluation's transfers may follow."""
    for lt in (self.lower_t, self.upper_t):
      if lt is not None:
        lt.drain()
    for key, slots in (("fwd_fifo", self.fwd_slots), ("bwd_fifo", self.bwd_slots)):
      if slots is not None:
        for i, x in enumerate(slots):
          slots[i] = x if isinstance(x, jax.Array) else x.result()
        st = dict(st, **{key: jnp.stack(list(slots))})
    return st

  def close(self) -> None:
    for lt in (self.lower_t, self.upper_t):
      if lt is not None:
        lt.drain()
        lt.close()

  def tick(self, st, x_t, y_t, t):
    """This stage's part of tick t (tick.make_tick's order); returns (state, (loss, acc) or None).

    Transfers are posted to the link threads in the lockstep order; only their results are waited for.
    The state's FIFOs are stale during the run: the slots hold them (settle writes them back)."""
    sch, k, c, last = self.schedule, self.k, self.clock, self.last
    src = tick_lib.input_source(sch, k)
    if src == tick_lib.BATCH:
      x_in = x_t
    elif src == tick_lib.NOW:
      x_in = self.wait(self.post(self.lower_t, "up"))  # locked forward: this tick's output of the stage below
    else:
      x_in = self.slot(self.fwd_slots)
    metrics = y = g_x = None
    if sch.mode == "fused" and not last:  # DSP: the error gradient is already in the FIFO
      st, y, g_x = c.run("fused", self.fused, st, x_in, self.slot(self.bwd_slots), t)
    else:
      residuals = sch.mode == "residuals" and not last
      if residuals:
        y, pb, ms = c.run("forward", self.res_fwd, st["params"], st["model_state"], x_in)
        self.ring.append((pb, ms))
      else:
        st, y = c.run("forward", self.fwd, st, x_in, t)
      if not last and tick_lib.input_source(sch, k + 1) == tick_lib.NOW:  # the stage above waits for it
        self.post(self.upper_t, "up", y)
      src = tick_lib.cotangent_source(sch, k)
      if src == tick_lib.LABELS:
        cot = None
      elif src == tick_lib.NOW:
        cot = self.wait(self.post(self.upper_t, "down"))  # locked backward: this tick's from above
      else:
        cot = self.slot(self.bwd_slots)
      if residuals:
        pb, ms = self.ring.popleft()  # the forward of tick t - S_k
        st, g_x = c.run("backward", self.res_bwd, st, pb, ms, cot, t)
      else:
        st, g_x, metrics = c.run("backward", self.bwd, st, cot, y_t, t)
      if k > 0 and tick_lib.cotangent_source(sch, k - 1) == tick_lib.NOW:  # the stage below waits for it
        self.post(self.lower_t, "down", g_x)
    self._advance_links(y, g_x)
    return st, metrics

  def _advance_links(self, y, g_x) -> None:
    """The delayed links move one tick: each FIFO drops the entry this tick read and takes the
    transfer of this tick's output (a future), the lower link's transfer posted first, as lockstep
    ran them."""
    sch, k = self.schedule, self.k
    f, b = sch.fwd_delays, sch.bwd_delays
    if k > 0 and f[k - 1] > 0:
      got = self.post(self.lower_t, "swap", g_x) if b[k - 1] > 0 else self.post(self.lower_t, "up")
      self.fwd_slots.popleft()
      self.fwd_slots.append(got)
    elif k > 0 and b[k - 1] > 0:
      self.post(self.lower_t, "down", g_x)
    if not self.last and (f[k] > 0 or b[k] > 0):
      if f[k] > 0 and b[k] > 0:
        got = self.post(self.upper_t, "swap", y)
      elif f[k] > 0:
        got = self.post(self.upper_t, "up", y)
      else:
        got = self.post(self.upper_t, "down")
      if b[k] > 0:
        self.bwd_slots.popleft()
        self.bwd_slots.append(got)

  # -- one gpipe batch ----------------------------------------------------------------------------------

  def gpipe(self, st, x_t, y_t):
    """M micro-batches up (only the stage inputs are kept), then down in reverse order with the
    forward rematerialised, the gradients summed, one update after the flush."""
    k, c, last, M = self.k, self.clock, self.last, self.config.microbatches
    p, ms = st["params"], st["model_state"]
    split = lambda a: np.split(np.asarray(a), M) if a is not None else [None] * M
    xs, ys = split(x_t), split(y_t)
    ins, new_ms = [], ms  # the micro-batch boundary inputs: all GPipe keeps for its remat backward
    for m in range(M):
      x = xs[m] if k == 0 else self.link(self.lower_mb.up)
      ins.append(x)
      if not last:
        y, new_ms = c.run("forward", self.gp_fwd, p, ms, x)
        self.link(self.upper_mb.up, y)
    grads, losses = None, []
    for m in reversed(range(M)):
      if last:
        (loss, acc, new_ms), g_p, g_x = c.run("backward", self.gp_last, p, ms, ins[m], ys[m])
        losses.append((loss, acc))
      else:
        g_p, g_x = c.run("backward", self.gp_bwd, p, ms, ins[m], self.link(self.upper_mb.down))
      grads = g_p if grads is None else self.gp_add(grads, g_p)
      if k > 0:
        self.link(self.lower_mb.down, g_x)
    self.boundary_bytes = int(sum(np.asarray(x).nbytes for x in ins))
    st = c.run("update", self.gp_update, st, grads, new_ms)
    metrics = tuple(jnp.mean(jnp.stack(v)) for v in zip(*losses)) if last else None
    return st, metrics

  # -- what a transfer costs --------------------------------------------------------------------------

  def calibrate_links(self, reps: int = 7) -> dict:
    """Median seconds of one transfer of the training boundary on each of this stage's links, with
    both ends ready (the run's link waits also hold the time spent waiting for the neighbour). Every
    stage runs this at the same point, lower link first, so the pairs meet."""
    out = {}
    for name, link in (("lower", self.lower), ("upper", self.upper)):
      if link is None:
        continue
      x = link.zeros
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(link.swap(x))
        times.append(time.perf_counter() - t0)
      out[name] = float(np.median(times[2:]))
    return out

  # -- evaluation ------------------------------------------------------------------------------------

  def evaluate(self, st, x_test, y_test):
    """The test set up the stages; the last stage returns (accuracy, loss), the others None."""
    h = jax.device_put(x_test, self.device) if self.k == 0 else self.eval_lower.up()
    h = self.ev_fwd(st["params"], st["model_state"], h)
    if not self.last:
      self.eval_upper.up(h)
      return None
    y = jax.device_put(y_test, self.device)
    return (
      float(jnp.mean(jnp.argmax(h, -1) == y)),
      float(optax.softmax_cross_entropy_with_integer_labels(h, y).mean()),
    )

  # -- what a checkpoint holds ----------------------------------------------------------------------------

  def pack(self, st) -> dict:
    """The stage's state and the residual ring (as leaves: the vjp's structure is rebuilt, not saved)."""
    return {"stage": st, "ring": jax.tree.leaves(list(self.ring))}

  def unpack(self, packed) -> dict:
    treedef = jax.tree.structure(list(self.ring))
    self.ring = collections.deque(jax.tree.unflatten(treedef, packed["ring"]))
    return packed["stage"]

  def stored_bytes(self, st) -> dict:
    """Bytes this stage keeps, read from its live state: tick.stored_bytes' kinds plus the residuals."""
    out = tick_lib.stored_bytes([{"in_ring": [], **st}])[0]
    out["residuals"] = int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(list(self.ring))))
    out["micro_boundaries"] = self.boundary_bytes
    return out


# ---------------------------------------------------------------------------------------------------
# The run: every stage process runs this.


def _pin(config, k: int) -> None:
  """One core per stage process (runtime.pin_cores): XLA's intra-op threads gain little here and two
  processes sharing both cores contend (docs/design.md 4.5). sched_setaffinity(0) sets the calling thread's
  mask only, and XLA's thread pool exists by now: every thread of the process is pinned."""
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  if not (config.runtime.pin_cores and cores):
    return
  pin_threads({cores[k % len(cores)]})


def _per_process(K: int, device):
  """RunLog's per_process triple: this stage's state as its row of (stages, ...) arrays and back."""
  mesh = Mesh(np.array([[stage_device(j)] for j in range(K)]), (WORKER, LOCAL))
  local = SingleDeviceSharding(device)
  # The saver thread hands host copies: back on the stage's device first.
  return (
    jax.process_index(),
    lambda tree: jax.tree.map(lambda a: to_global(jax.device_put(a, local), mesh), tree),
    lambda tree: jax.tree.map(lambda a: to_local(a, local), tree),
  )


def _resume(sp: Stage, log: RunLog, kv) -> Loop:
  """The newest tick every stage can restore (a consistent cut; distributed.resume), or a fresh start."""
  got = resume_lib.restore_common(
    log, kv, sp.k, sp.K, sp.pack(sp.state), sp.config.runtime.stall_timeout, what="stage"
  )
  if got is None:
    return Loop()
  sp.state = sp.unpack(got[1])
  loop = Loop(**got[2])
  logging.info("stage %d: resuming at tick %d", sp.k, loop.tick)
  return loop


def _record(sp: Stage, log: RunLog, p: setup_lib.PipelineSetup, clock, loop: Loop, done: int, losses: list):
  """At a logged batch: the evaluation (every stage, at eval points), the lead's record."""
  config, n = sp.config, p.num_batches
  scalars = {"epoch": done / p.batches_per_epoch}
  if done % config.eval_every == 0 or done == n:
    t0 = time.perf_counter()
    got = sp.evaluate(sp.state, p.data["x_test"], p.data["y_test"])
    loop.eval_s += time.perf_counter() - t0
    if got is not None:
      scalars.update(test_accuracy=got[0], test_loss=got[1])
  if sp.last:
    scalars["train_loss"] = float(np.mean([float(l) for l in losses])) if losses else float("nan")
  log.record(done, clock(), **scalars)


def _loop(sp: Stage, log: RunLog, p: setup_lib.PipelineSetup, loop: Loop, progress: dict) -> None:
  """Ticks (gpipe: batches) from loop.tick to the end of the drain."""
  config, n, feed = sp.config, p.num_batches, p.feed
  sch = sp.schedule
  drain = sch.drain_ticks() if sch else 0
  offset = sch.offsets[-1] if sch else 0  # the last stage works on batch t - offset
  rt, losses = config.runtime, []
  t_start, eval_before = time.perf_counter() - loop.time, loop.eval_s  # loop.time is net of evaluation
  clock = lambda: time.perf_counter() - t_start - (loop.eval_s - eval_before)
  saved = None
  if sch is not None:
    sp.load_slots(sp.state)
  for t in range(loop.tick, n + drain):
    if sp.k == rt.fail_stage and t == rt.fail_tick:
      fail_now(log, saved, t)
    x_t = feed.x(t) if sp.k == 0 else None
    y_t = feed.labels(t - offset) if sp.last else None
    sp.clock.slow = slow_factor(config, sp.k, t)
    if sch is None:
      sp.state, metrics = sp.gpipe(sp.state, x_t, y_t)
    else:
      sp.state, metrics = sp.tick(sp.state, x_t, y_t, t)
    sp.clock.tick_ends.append(clock())
    progress["ticks"] = t + 1
    if metrics is not None and 0 <= t - offset < n:
      losses.append(metrics[0])
    done = t + 1 - drain  # batches whose updates every stage has applied
    if done > 0 and (done % config.log_every == 0 or done % config.eval_every == 0 or done == n):
      saving = done == n or bool(config.checkpoint_every and done % config.checkpoint_every == 0)
      if sch is not None and (saving or done % config.eval_every == 0):  # the lockstep cut, on every stage
        sp.state = sp.settle(sp.state)
      _record(sp, log, p, clock, loop, done, losses)
      losses = []
      loop.tick, loop.time = t + 1, clock()
      if saving:
        log.checkpoint(done, sp.pack(sp.state), dataclasses.asdict(loop), force=done == n)
      saved = done if config.checkpoint_every and done % config.checkpoint_every == 0 else saved
    elif done > 0:
      log.progress(done)
  if sch is not None:
    sp.state = sp.settle(sp.state)
  loop.tick, loop.time = n + drain, clock()


def slow_factor(c, k: int, t: int) -> float:
  """Stage k's straggler factor at tick t: `slowdown` on straggler_stage (or, with straggler_p > 0, on
  each stage with that probability per tick, the same draw for every method), else 1."""
  return timing.straggler_factor(c.seed, k, t, c.slowdown, c.straggler_stage, c.straggler_p)


def _timing(sp: Stage, warm: int) -> dict:
  """This stage's measured costs: median call times, totals, the steady tick spacing."""
  ends = np.asarray(sp.clock.tick_ends)
  start = min(max(warm, len(ends) // 4), len(ends) - 2) if len(ends) > 2 else 0
  spacing = float((ends[-1] - ends[start]) / (len(ends) - 1 - start)) if len(ends) > 1 else float("nan")
  return {
    "stage": sp.k,
    "median_s": sp.clock.medians(),
    "total_s": sp.clock.totals(),
    "calls": {k: len(v) for k, v in sp.clock.calls.items()},
    "xla_memory": sp.clock.memory,
    "ticks": len(ends),
    "iteration_s": spacing,
    "stored_bytes": sp.stored_bytes(sp.state),
  }


def _complete(sp: Stage, workdir: str, loop: Loop) -> dict:
  """A rerun of a finished run: every stage resumed from its final tick; nothing is run or rewritten
  (its summary.json holds the run's measurements; a rerun has none)."""
  logging.info(
    "stage %d: the run in %s is complete (tick %d): nothing to do; its summary.json is kept",
    sp.k,
    workdir,
    loop.tick,
  )
  path = os.path.join(workdir, "summary.json")
  if sp.last and os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {"method": sp.config.method, "stage": sp.k, "workdir": workdir, "time": loop.time}


def run(config, workdir: str) -> dict:
  """This process's stage of the pipeline (placement=per_process, run.EXECUTORS)."""
  k, K = jax.process_index(), config.num_stages
  sigterm = coord.SigtermStop().install()  # SIGTERM ends this stage: one line, coord.EXIT_TERM
  _pin(config, k)  # first: a stage measuring the split's unit times does so on its own core
  workdir = make_workdir(workdir, config)
  p = setup_lib.build_pipeline(config, workdir)  # every stage reads the one split.json
  kv = coord.client()
  sp = Stage(config, p.stages, p.optimizer, p.num_batches, p.feed.sample, p.data["x_test"])
  rt = config.runtime
  drain = sp.schedule.drain_ticks() if sp.schedule else 0
  with RunLog(
    workdir,
    config,
    p.num_batches,
    is_lead=sp.last,
    checkpoint_every=config.checkpoint_every,
    checkpoint_keep=config.checkpoint_keep,
    per_process=_per_process(K, sp.device),
  ) as log:
    loop = _resume(sp, log, kv)
    if loop.tick >= p.num_batches + drain:
      return _complete(sp, workdir, loop)
    progress = {"ticks": loop.tick, "done": False}
    watchdog = coord.Watchdog(
      kv,
      k,
      K,
      lambda: (progress["ticks"], progress["ticks"], progress["done"]),
      rt.heartbeat_s,
      rt.heartbeat_timeout,
      rt.stall_timeout,
      role="stage",
    )
    sigterm.watchdog = watchdog
    kv.wait_at_barrier(f"{coord.PREFIX}/pipe/start/{loop.tick}", int(rt.stall_timeout * 1000))
    transfer_s = sp.calibrate_links()  # before the clock starts: not training time
    watchdog.start()
    try:
      _loop(sp, log, p, loop, progress)
      sp.close()
    except Exception:
      # A transfer may fail (rather than hang) when the neighbour died: let the watchdog name it first.
      watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
      raise
    log.wait()
    timings = _exchange_timings(
      sp, kv, dict(_timing(sp, warm=drain + 3), transfer_s=transfer_s), workdir, progress
    )
    watchdog.stop()
    return _summary(sp, log, p, loop, timings, workdir)


def _exchange_timings(sp: Stage, kv, mine: dict, workdir: str, progress: dict) -> list:
  """After the last tick: this stage's final parameters and measured costs out, every stage's costs
  back (the lead's summary holds them all), then the end barrier."""
  rt, k = sp.config.runtime, sp.k
  kv.key_value_set(f"{coord.PREFIX}/pipe/timing/{k}", json.dumps(mine), allow_overwrite=True)
  flat, _ = ravel_pytree(sp.state["params"])
  os.makedirs(os.path.join(workdir, "snapshots"), exist_ok=True)
  np.save(os.path.join(workdir, "snapshots", f"final-{k}.npy"), np.asarray(flat))
  progress["done"] = True
  timings = [
    json.loads(kv.blocking_key_value_get(f"{coord.PREFIX}/pipe/timing/{j}", int(rt.stall_timeout * 1000)))
    for j in range(sp.K)
  ]
  kv.wait_at_barrier(f"{coord.PREFIX}/pipe/end", int(10 * rt.stall_timeout * 1000))
  return timings


def _summary(sp: Stage, log: RunLog, p: setup_lib.PipelineSetup, loop: Loop, timings: list, workdir: str):
  config = sp.config
  if not sp.last:
    return {"method": config.method, "stage": sp.k, "workdir": workdir, "time": loop.time}
  return log.finish(
    time=loop.time,
    worker_steps=[p.num_batches],
    method=config.method,
    num_stages=sp.K,
    mode=sp.schedule.mode if sp.schedule else "remat",
    placement="per_process",
    delay=config.delay,
    epochs=config.num_epochs,
    num_batches=p.num_batches,
    eval_s=loop.eval_s,
    iteration_s=max(s["iteration_s"] for s in timings),
    stages=timings,
    staleness=list(sp.schedule.staleness) if sp.schedule else None,
  )
