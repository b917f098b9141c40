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
from absl import logging
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, SingleDeviceSharding

from ripples_jax import losses as losses_lib  # 'losses' names the stage's loss lists here
from ripples_jax.distributed import coord
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.distributed.arrays import LOCAL, WORKER, to_global, to_local
from ripples_jax.distributed.host import pin_threads
from ripples_jax.distributed.markers import fail_now
from ripples_jax.errors import ConfigError
from ripples_jax.models import apply_model
from ripples_jax.pipeline import gpipe, timing
from ripples_jax.pipeline import inputs as pipeline_inputs
from ripples_jax.pipeline import tick as tick_lib
from ripples_jax.pipeline.baselines import schedule_of
from ripples_jax.pipeline.link import Link, LinkThread, stage_device
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.runlog.storage import save_array


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


def tick_programs(stage, optimizer, sch, k: int, num_batches: int) -> dict:
  """The jitted programs of stage k's part of a tick under schedule `sch` (jit is lazy: each compiles
  on its first call): forward, backward, fused (DSP's whole tick), and the residual mode's forward
  (with its vjp) and backward. Stage 0's dL/d(input) is dropped (gpipe.drop)."""
  first, chunks = k == 0, sch.chunks  # config: 1 with fused
  bwd = lambda st, cot, labels, t: tick_lib.stage_backward(
    stage, optimizer, sch, k, st, cot, labels, t, num_batches, chunks
  )
  fused = lambda st, x, cot, t: tick_lib.stage_fused(stage, optimizer, sch, k, st, x, cot, t, num_batches)
  res_bwd = lambda st, pb, ms, cot, t: tick_lib.stage_backward_residuals(
    optimizer, sch, k, st, pb, ms, cot, t, num_batches
  )
  return {
    "forward": jax.jit(functools.partial(tick_lib.stage_forward, stage, sch, k)),
    "backward": jax.jit(gpipe.drop(bwd, 1) if first else bwd),
    "fused": jax.jit(gpipe.drop(fused, 2) if first else fused),
    "res_forward": jax.jit(lambda p, ms, x: tick_lib.stage_forward_residuals(stage, p, ms, x, chunks)),
    "res_backward": jax.jit(gpipe.drop(res_bwd, 1) if first else res_bwd),
  }


def boundary_shapes(config, stages, full, test_x) -> tuple[list, list, list]:
  """Every stage's input (boundary j: stage j's input) for the training batch, GPipe's micro-batch and
  the test set, as zero arrays (the first two) and shape structs."""
  K, M = config.num_stages, config.microbatches
  ins = [np.zeros(s["in_ring"].shape[1:], s["in_ring"].dtype) for s in full]
  test_in = [jax.ShapeDtypeStruct(test_x.shape, test_x.dtype)]
  for j in range(K - 1):
    test_in.append(
      jax.eval_shape(
        lambda p, m, x, j=j: apply_model(stages[j], p, m, x, train=False)[0],
        full[j]["params"],
        full[j]["model_state"],
        test_in[-1],
      )
    )
  micro = [np.zeros((a.shape[0] // M,) + a.shape[1:], a.dtype) for a in ins]
  return ins, micro, test_in


class Links:
  """Stage k's links to its neighbours: link j carries stage j + 1's input up and its error gradient
  down, one per boundary shape (the training batch, GPipe's micro-batch, the test set). The training
  links' transfers run on threads of their own (slack: a FIFO slot holds the transfer that fills it, a
  future, until a tick reads it); the others are called directly. `clock` times every wait ("link")."""

  def __init__(self, k: int, schedule, slack: bool, clock: Clock, shapes: tuple[list, list, list], base=0):
    self.k, self.schedule, self.slack, self.clock = k, schedule, slack, clock
    K = len(shapes[0])
    self.last = k == K - 1
    link = lambda j, like: Link(j, k, like[j + 1].shape, like[j + 1].dtype, base) if 0 <= j < K - 1 else None
    ins, micro, test_in = shapes
    self.lower, self.upper = link(k - 1, ins), link(k, ins)
    self.lower_mb, self.upper_mb = link(k - 1, micro), link(k, micro)
    self.eval_lower, self.eval_upper = link(k - 1, test_in), link(k, test_in)
    self.lower_t, self.upper_t = (LinkThread(x) if x is not None else None for x in (self.lower, self.upper))
    self.fwd_slots = self.bwd_slots = None  # the FIFOs as slots: arrays, or futures of transfers

  def call(self, fn, *args):
    """A direct transfer (GPipe's micro-batch links, evaluation), waited for."""
    return self.clock.run("link", fn, *args)

  def post(self, lt: LinkThread, kind: str, x=None):
    """A transfer on link thread `lt`; without slack (runtime.slack=False) waited for at once."""
    future = lt.post(kind, x)
    if not self.slack:
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

  def advance(self, y, g_x) -> None:
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

  def calibrate(self, reps: int = 7) -> dict:
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


class Stage:
  """This process's stage: its state and residual ring, its programs (a tick's, GPipe's, evaluation's),
  its links, its clock."""

  def __init__(self, config, stages, optimizer, num_batches: int, sample_x, test_x, base: int = 0):
    """base: the process of stage 0; this process is stage process_index - base (the hybrid's replica
    r holds processes 1 + r * K .. r * K + K: hybrid/processes.py)."""
    self.k, self.K = jax.process_index() - base, config.num_stages
    self.config, self.n, self.last = config, num_batches, self.k == config.num_stages - 1
    self.schedule = schedule_of(config)  # None: gpipe, its own loop
    self.device = stage_device(base + self.k)
    self.pad = None  # the hybrid's padded ticks: called at a tick's end, before its transfers leave
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
    shapes = boundary_shapes(config, stages, full, test_x)
    self.links = Links(k, sch, config.runtime.slack, self.clock, shapes, base)
    self.progs = tick_programs(stage, optimizer, sch, k, num_batches) if sch is not None else {}
    self.gp = gpipe.stage_programs(stage, optimizer, k == 0, self.last, config.microbatches)
    self.ev_fwd = jax.jit(lambda p, ms, x: apply_model(stage, p, ms, x, train=False)[0])
    self.ring = collections.deque()
    if sch is not None and sch.mode == "residuals" and not self.last:
      # S_k placeholders (the warm-up's backwards are masked); the forward's vjp fixes the ring's shape.
      x0 = jax.device_put(jnp.asarray(shapes[0][k]), self.device)
      _, pb, ms = self.progs["res_forward"](self.state["params"], self.state["model_state"], x0)
      self.ring.extend([(pb, ms)] * sch.staleness[k])

  # -- one tick (dsp, fr, ddg, pipedream, pipemare, bp) -----------------------------------------------

  def tick(self, st, x_t, y_t, t):
    """This stage's part of tick t (tick.make_tick's order); returns (state, (loss, acc) or None).

    Transfers are posted to the link threads in the lockstep order; only their results are waited for.
    The state's FIFOs are stale during the run: the slots hold them (Links.settle writes them back)."""
    sch, k, c, last, L, P = self.schedule, self.k, self.clock, self.last, self.links, self.progs
    src = tick_lib.input_source(sch, k)
    if src == tick_lib.BATCH:
      x_in = x_t
    elif src == tick_lib.NOW:
      x_in = L.wait(L.post(L.lower_t, "up"))  # locked forward: this tick's output of the stage below
    else:
      x_in = L.slot(L.fwd_slots)
    metrics = y = g_x = None
    if sch.mode == "fused" and not last:  # DSP: the error gradient is already in the FIFO
      st, y, g_x = c.run("fused", P["fused"], st, x_in, L.slot(L.bwd_slots), t)
    else:
      residuals = sch.mode == "residuals" and not last
      if residuals:
        y, pb, ms = c.run("forward", P["res_forward"], st["params"], st["model_state"], x_in)
        self.ring.append((pb, ms))
      else:
        st, y = c.run("forward", P["forward"], st, x_in, t)
      if not last and tick_lib.input_source(sch, k + 1) == tick_lib.NOW:  # the stage above waits for it
        L.post(L.upper_t, "up", y)
      src = tick_lib.cotangent_source(sch, k)
      if src == tick_lib.LABELS:
        cot = None
      elif src == tick_lib.NOW:
        cot = L.wait(L.post(L.upper_t, "down"))  # locked backward: this tick's from above
      else:
        cot = L.slot(L.bwd_slots)
      if residuals:
        pb, ms = self.ring.popleft()  # the forward of tick t - S_k
        st, g_x = c.run("backward", P["res_backward"], st, pb, ms, cot, t)
      else:
        st, g_x, metrics = c.run("backward", P["backward"], st, cot, y_t, t)
      if k > 0 and tick_lib.cotangent_source(sch, k - 1) == tick_lib.NOW:  # the stage below waits for it
        L.post(L.lower_t, "down", g_x)
    if self.pad is not None:
      self.pad()
    L.advance(y, g_x)
    return st, metrics

  # -- one gpipe batch ----------------------------------------------------------------------------------

  def gpipe(self, st, x_t, y_t):
    """One GPipe batch in pipeline/gpipe.py's order: the M micro-batches up (each stage keeping its
    inputs and the model state its forward saw), then their gradients down in the same order
    (rematerialised backwards; the last stage takes each one's loss and backward there, its model
    state chained in micro-batch order), the gradients summed in that order, one update after the
    flush. Both ends of a link issue its transfers in this order: every up, then every down (the
    transfers are collectives, so neither end may reorder them). The last stage computes in the down
    phase, not as each micro-batch arrives: its cotangents then leave one by one and stage k-1's
    backward of micro-batch m runs beside the last stage's work on m+1 (measured, CNN2D K=2, runs
    alternated: 67.8 and 67.9 ms an iteration, against 84.1 and 100.1 ms when the last stage computed
    in the up phase and sent every cotangent at the end). Each stage runs the same programs in the
    same order either way, so the numbers are the device placement's."""
    k, c, last, M, L, G = self.k, self.clock, self.last, self.config.microbatches, self.links, self.gp
    p, ms = st["params"], st["model_state"]
    split = lambda a: np.split(np.asarray(a), M) if a is not None else [None] * M
    xs, ys = split(x_t), split(y_t)
    ins, used, grads, losses = [], [], None, []
    accumulate = lambda grads, g_p: c.run(
      "accumulate", G["accumulate"], gpipe.zeros_like(g_p) if grads is None else grads, g_p
    )
    for m in range(M):
      x = xs[m] if k == 0 else L.call(L.lower_mb.up)
      ins.append(x)
      if not last:
        used.append(ms)
        y, ms = c.run("forward", G["forward"], p, ms, x)
        L.call(L.upper_mb.up, y)
    for m in range(M):
      if last:
        g_p, g_x, ms, loss, acc = c.run("backward", G["backward"], p, ms, ins[m], ys[m])
        losses.append((loss, acc))
      else:
        g_p, g_x = c.run("backward", G["backward"], p, used[m], ins[m], L.call(L.upper_mb.down))
      grads = accumulate(grads, g_p)
      if k > 0:
        L.call(L.lower_mb.down, g_x)
    self.boundary_bytes = int(sum(np.asarray(x).nbytes for x in ins))
    st = c.run("update", G["update"], st, grads, ms)
    metrics = tuple(jnp.mean(jnp.stack(v)) for v in zip(*losses)) if last else None
    return st, metrics

  # -- evaluation ------------------------------------------------------------------------------------

  def evaluate(self, st, x_test, y_test):
    """The test set up the stages; the last stage returns (accuracy, loss), the others None."""
    L = self.links
    h = jax.device_put(x_test, self.device) if self.k == 0 else L.eval_lower.up()
    h = self.ev_fwd(st["params"], st["model_state"], h)
    if not self.last:
      L.eval_upper.up(h)
      return None
    y = jax.device_put(y_test, self.device)
    return float(losses_lib.accuracy(h, y)), float(losses_lib.cross_entropy(h, y))

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


def checkpoint_rows(processes, device):
  """RunLog's per_process triple: this stage's state as its row of (stages, ...) arrays and back, a row
  per stage process (`processes`: their indices; the hybrid's replicas' stages too)."""
  mesh = Mesh(np.array([[stage_device(j)] for j in processes]), (WORKER, LOCAL))
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


def _record(
  sp: Stage, log: RunLog, p: pipeline_inputs.PipelineSetup, clock, loop: Loop, done: int, losses: list
):
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


def _loop(sp: Stage, log: RunLog, p: pipeline_inputs.PipelineSetup, loop: Loop, progress: dict) -> None:
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
    sp.links.load_slots(sp.state)
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
        sp.state = sp.links.settle(sp.state)
      _record(sp, log, p, clock, loop, done, losses)
      losses = []
      loop.tick, loop.time = t + 1, clock()
      if saving:
        log.checkpoint(done, sp.pack(sp.state), dataclasses.asdict(loop), force=done == n)
      saved = done if config.checkpoint_every and done % config.checkpoint_every == 0 else saved
    elif done > 0:
      log.progress(done)
  if sch is not None:
    sp.state = sp.links.settle(sp.state)
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
  p = pipeline_inputs.build_pipeline(config, workdir)  # every stage reads the one split.json
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
    per_process=checkpoint_rows(range(K), sp.device),
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
    transfer_s = sp.links.calibrate()  # before the clock starts: not training time
    watchdog.start()
    try:
      _loop(sp, log, p, loop, progress)
      sp.links.close()
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
  save_array(os.path.join(workdir, "snapshots", f"final-{k}.npy"), np.asarray(flat))
  progress["done"] = True
  timings = [
    json.loads(kv.blocking_key_value_get(f"{coord.PREFIX}/pipe/timing/{j}", int(rt.stall_timeout * 1000)))
    for j in range(sp.K)
  ]
  kv.wait_at_barrier(f"{coord.PREFIX}/pipe/end", int(10 * rt.stall_timeout * 1000))
  return timings


def _summary(
  sp: Stage, log: RunLog, p: pipeline_inputs.PipelineSetup, loop: Loop, timings: list, workdir: str
):
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
