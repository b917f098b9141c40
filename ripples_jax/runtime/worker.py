"""executor=async: one controller process per worker, each running the Ripples worker loop for real.

  loop: local step on this worker's devices (padded to runtime.step_time, slowed if this worker is
        slow) -> its next group from the global plan -> P-Reduce over the group's sub-mesh -> repeat

No global barrier inside the run: a worker blocks only in the collectives of its own groups. The groups
come from runtime.plan (the Group Buffer the simulator uses), in one global order, so no cyclic wait
can occur. Step-time estimates (EMA of this worker's measured steps) are exchanged at block boundaries
through the coordination service; block b is planned with the estimates published at block
b - runtime.estimate_lag, so a fast worker rarely waits for them.
"""
import dataclasses
import functools
import glob
import os
import signal
import time

import jax
import numpy as np
import optax
from absl import logging
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ripples_jax import checkpoint as ckpt_lib
from ripples_jax import data as data_lib
from ripples_jax import engine
from ripples_jax import setup as setup_lib
from ripples_jax.models import init_model
from ripples_jax.runlog import RunLog, check_finite, make_workdir
from ripples_jax.runtime import coord, plan as plan_lib, summary as summary_lib
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.preduce import LOCAL, WORKER, GroupAverager, to_global, to_local

EMA = 0.3  # weight of the newest step in this worker's step-time estimate


def snapshot_path(workdir: str, block, worker: int) -> str:
  name = f"{block:06d}" if isinstance(block, int) else block
  return os.path.join(workdir, "snapshots", f"{name}-{worker}.npy")


def fail_now(manager, saved, block: int) -> None:
  """Fault injection (runtime.fail_worker/fail_block): SIGKILL this process at a fixed point of the run.

  Waits until this worker's newest checkpoint has committed first, so the block a resumed run starts
  from is fixed by the config, not by how far the background write got (tests need both fixed).
  """
  manager.wait_until_finished()
  deadline = time.monotonic() + 60
  while saved is not None and saved not in ckpt_lib.restorable_steps(manager) and time.monotonic() < deadline:
    time.sleep(0.05)  # process 0 renames the checkpoint into place once every process has written
  logging.warning("runtime.fail_worker: worker %d kills itself at block %d", jax.process_index(), block)
  os.kill(os.getpid(), signal.SIGKILL)


def make_step_fn(model, optimizer, unravel, local_mesh: Mesh):
  """The local step on the flat state: gradient, optimizer update, re-flatten (one jitted program)."""
  rep = NamedSharding(local_mesh, P())
  batch = NamedSharding(local_mesh, P(LOCAL))  # several local devices: data parallel inside the worker

  def step(state, x_BxI, y_B):
    tree = unravel(state["flat"])
    grad_fn = jax.value_and_grad(functools.partial(engine.cross_entropy_loss, model), has_aux=True)
    (loss, model_state), grads = grad_fn(tree["params"], tree["model_state"], x_BxI, y_B)
    updates, opt_state = optimizer.update(grads, state["opt_state"], tree["params"])
    params = optax.apply_updates(tree["params"], updates)
    flat, _ = ravel_pytree({"params": params, "model_state": model_state})
    return {"flat": flat, "opt_state": opt_state}, loss

  return jax.jit(step, in_shardings=(rep, batch, batch), out_shardings=(rep, rep), donate_argnums=0), rep, batch


@dataclasses.dataclass
class Loop:
  """This worker's loop state. `block` and `planned` are the same on every worker (the checkpoint's
  cursor); the rest is this worker's own and travels in its row of the checkpointed arrays."""
  state: dict                 # {"flat": D, "opt_state"} on this worker's devices
  block: int = 0              # the block about to run
  planned: int = 0            # worker steps planned before `block`, all workers
  steps_done: int = 0         # this worker's local steps
  estimate: float = 0.0       # EMA of this worker's step time
  est_history: dict = dataclasses.field(default_factory=dict)  # block -> the estimate published there
  time: float = 0.0           # seconds of the run before this process started (resume)
  resumed_at: int | None = None


class Worker:
  """This process's worker: its devices, jitted step, P-Reduce programs and checkpoint layout."""

  def __init__(self, config, s: setup_lib.Setup):
    self.config, self.s, self.rt = config, s, config.runtime
    n, self.me = config.num_workers, jax.process_index()
    # Devices per worker, in the global order every process sees the same way.
    self.devices_of = {w: [d for d in jax.devices() if d.process_index == w] for w in range(n)}
    self.local_mesh = Mesh(np.array(self.devices_of[self.me]), (LOCAL,))
    self.global_mesh = Mesh(np.array([self.devices_of[w] for w in range(n)]), (WORKER, LOCAL))
    params, model_state = init_model(s.model, jax.random.key(config.seed), s.data["x_train"][:1])
    flat0, self.unravel = ravel_pytree({"params": params, "model_state": model_state})
    self.step_fn, self.rep, self.batch_sharding = make_step_fn(s.model, s.optimizer, self.unravel,
                                                               self.local_mesh)
    self.averager = GroupAverager(self.local_mesh, self.devices_of, self.rt.cache_size)
    self.model_bytes = config.timeline.model_bytes or 4 * flat0.size
    # From host copies: the step donates its input, so every fresh state needs buffers of its own.
    self._flat0, self._opt0 = np.asarray(flat0), jax.device_get(s.optimizer.init(params))
    hetero = config.hetero
    self.slow = self.me in tuple(hetero.slow_workers)

  def fresh(self) -> dict:
    return jax.device_put({"flat": self._flat0, "opt_state": self._opt0}, self.rep)

  def batch(self, step: int):
    c, s = self.config, self.s
    idx = data_lib.batch_indices([s.shards[self.me]], c.batch_size, c.seed, [step], workers=[self.me])[0]
    return (jax.device_put(s.data["x_train"][idx], self.batch_sharding),
            jax.device_put(s.data["y_train"][idx], self.batch_sharding))

  def slowdown(self, step: int) -> float:
    """Injected heterogeneity (DESIGN 3.5): this step takes `slowdown` x its real time."""
    hetero = self.config.hetero
    if self.slow:
      return float(hetero.slowdown)
    if hetero.random_p and np.random.default_rng([5, self.config.seed, self.me, step]).random() < hetero.random_p:
      return float(hetero.slowdown)
    return 1.0

  def timed_step(self, state, step: int):
    """(state, loss, t0, end of compute, t1): the step, padded to runtime.step_time and slowed."""
    x, y = self.batch(step)
    t0 = time.perf_counter()
    state, loss = self.step_fn(state, x, y)
    loss = float(loss)  # blocks: the step's real time is what the padding and the estimates need
    t_compute = time.perf_counter()
    padded = max(t_compute - t0, self.rt.step_time)
    target = t0 + padded * self.slowdown(step)
    while (left := target - time.perf_counter()) > 0:
      time.sleep(left)
    return state, loss, t0, t_compute, time.perf_counter()

  def warm_up(self) -> float:
    """Compiles the step on a throw-away state; the median of the timed steps after it is this
    worker's first estimate, the one every process plans the first blocks with."""
    scratch = self.fresh()
    scratch, *_ = self.timed_step(scratch, 0)
    warm = []
    for k in range(self.rt.warmup_steps):
      scratch, _, t0, _, t1 = self.timed_step(scratch, k)
      warm.append(t1 - t0)
    return float(np.median(warm))

  # Checkpoints are global: at an agreed block every worker contributes its row of one array per leaf,
  # stacked on a worker axis (orbax writes each process's shards; it refuses per-process host-local
  # arrays in a multi-process job).
  def pack(self, loop: Loop, t: float):
    lag = self.rt.estimate_lag
    blocks = sorted(loop.est_history)[-(lag + 1):]
    est = np.full(lag + 1, np.nan)
    est[:len(blocks)] = [loop.est_history[b] for b in blocks]
    ids = np.full(lag + 1, -1, np.int32)
    ids[:len(blocks)] = blocks
    exact = lambda a: np.asarray(a, np.float64).reshape(-1).view(np.int32)  # float64, bit for bit
    local = {**loop.state, "steps_done": np.int32(loop.steps_done), "est": exact(est), "est_blocks": ids,
             "estimate": exact(loop.estimate), "time": exact(t)}
    return jax.tree.map(lambda a: to_global(jax.device_put(a, self.rep), self.global_mesh), local)

  def unpack(self, global_tree, cursor: dict) -> Loop:
    local = jax.tree.map(lambda a: to_local(a, self.rep), global_tree)
    f64 = lambda a: np.asarray(a).view(np.float64)
    est = {int(b): float(v) for b, v in zip(np.asarray(local["est_blocks"]), f64(local["est"])) if b >= 0}
    return Loop({"flat": local["flat"], "opt_state": local["opt_state"]}, cursor["block"], cursor["planned"],
                int(local["steps_done"]), float(f64(local["estimate"])[0]), est, float(f64(local["time"])[0]),
                resumed_at=cursor["block"])


def resume(worker: Worker, log: RunLog, kv, workdir: str, estimate: float) -> Loop:
  """The loop state from the newest checkpoint that reads back, or a fresh one; what the lost run did
  after that point (snapshots, trace events) is dropped so this run redoes it."""
  me = worker.me
  got = log.restore(worker.pack(Loop(worker.fresh(), est_history={0: 0.0}), 0.0))
  if got is None:
    loop = Loop(worker.fresh(), estimate=estimate)
  else:
    loop = worker.unpack(got[1], got[2])
    for b, v in loop.est_history.items():
      coord.publish_estimate(kv, b, me, v)
    logging.info("worker %d: resuming at block %d after %d local steps", me, loop.block, loop.steps_done)
  for path in glob.glob(os.path.join(workdir, "snapshots", f"*-{me}.npy")):
    name = os.path.basename(path).split("-")[0]
    if not name.isdigit() or int(name) >= loop.block:
      os.remove(path)
  os.makedirs(os.path.join(workdir, "snapshots"), exist_ok=True)
  return loop


def run(config, workdir: str) -> dict:
  """This process's worker: runs its part of the plan, then (process 0) writes the run's summary."""
  rt, n = config.runtime, config.num_workers
  sigterm = coord.SigtermStop().install()  # SIGTERM ends this worker: one line, coord.EXIT_TERM
  s = setup_lib.build(config)
  workdir = make_workdir(workdir, config)
  kv = coord.client()
  worker = Worker(config, s)
  me = worker.me
  estimate = worker.warm_up()
  with RunLog(workdir, config, config.num_steps, checkpoint_every=rt.checkpoint_every,
              checkpoint_keep=rt.checkpoint_keep) as log:
    loop = resume(worker, log, kv, workdir, estimate)
    trace = trace_lib.TraceWriter(workdir, me, keep_before_block=loop.block if loop.resumed_at is not None else None)
    progress = {"steps": loop.steps_done, "events": 0, "done": False}
    watchdog = coord.Watchdog(kv, me, n, lambda: (progress["steps"], progress["events"], progress["done"]),
                              rt.heartbeat_s, rt.heartbeat_timeout, rt.stall_timeout)
    sigterm.watchdog = watchdog
    kv.wait_at_barrier(f"{coord.PREFIX}/start/{loop.block}", int(rt.stall_timeout * 1000))
    t_start = time.perf_counter() - loop.time
    watchdog.start()
    try:
      run_blocks(worker, loop, log, kv, trace, progress, t_start, workdir)
      if rt.checkpoint_every:  # the final state, loadable (run.load); every worker is at this block
        log.checkpoint(loop.block, worker.pack(loop, time.perf_counter() - t_start),
                       {"block": loop.block, "planned": loop.planned}, force=True)
      np.save(snapshot_path(workdir, "final", me), np.asarray(loop.state["flat"]))
      trace.add(k="end", b=loop.block, t=time.perf_counter() - t_start, s=loop.steps_done,
                compiles=worker.averager.compiles)
      trace.flush()
      log.wait()
      progress["done"] = True
      kv.wait_at_barrier(f"{coord.PREFIX}/end", int(10 * rt.stall_timeout * 1000))
    except Exception:
      # A collective or the key-value store may fail (rather than hang) when a peer dies: give the
      # watchdog the time to name the lost worker before the error surfaces.
      trace.flush()
      watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
      raise
    finally:
      trace.flush()
    watchdog.stop()
    logging.info("worker %d: %d local steps, %d P-Reduce programs compiled", me, loop.steps_done,
                 worker.averager.compiles)
    if me != 0:
      return {"algorithm": config.algorithm, "executor": "async", "worker": me,
              "worker_steps": loop.steps_done, "workdir": workdir}
    return summary_lib.summarize(config, workdir, s, worker.unravel, log)


def run_blocks(worker: Worker, loop: Loop, log: RunLog, kv, trace, progress, t_start, workdir) -> None:
  """Block after block until the plan is empty: estimates, plan, snapshot, checkpoint, then the
  block's tokens (local steps and groups, in the plan's order)."""
  config, rt, me, n = worker.config, worker.rt, worker.me, worker.config.num_workers
  now = lambda: time.perf_counter() - t_start
  eval_blocks = max(1, config.eval_every // rt.block_steps)
  fetched, saved = {}, loop.resumed_at
  while True:
    block = loop.block
    if me == rt.fail_worker and block == rt.fail_block:
      fail_now(log.mgr, saved, block)
    if block not in loop.est_history:
      coord.publish_estimate(kv, block, me, loop.estimate)
      loop.est_history[block] = loop.estimate
    est_block = max(0, block - rt.estimate_lag)
    if config.algorithm in plan_lib.PLANNED and est_block not in fetched:
      fetched[est_block] = coord.fetch_estimates(kv, est_block, n, 10 * rt.stall_timeout)
    b_plan = plan_lib.plan_block(config, block, loop.planned, fetched.get(est_block, [1.0] * n),
                                 worker.model_bytes)
    trace.add(k="block", b=block, t=now(), s=loop.steps_done)
    if block % eval_blocks == 0:
      np.save(snapshot_path(workdir, block, me), np.asarray(loop.state["flat"]))
    if rt.checkpoint_every and block and block % rt.checkpoint_every == 0 and loop.resumed_at != block:
      # Collective: every worker saves at this block (the plan is the same everywhere).
      log.checkpoint(block, worker.pack(loop, now()), {"block": block, "planned": loop.planned}, force=True)
      saved = block
    trace.flush()
    if not any(b_plan.tokens):
      return
    for tok in b_plan.tokens[me]:
      if tok == plan_lib.STEP:
        run_step(worker, loop, log, trace, t_start)
        progress["steps"] = loop.steps_done
      else:
        members = b_plan.groups[tok]
        t0 = now()
        loop.state["flat"] = worker.averager.average(members, loop.state["flat"])
        loop.state["flat"].block_until_ready()
        trace.add(k="group", b=block, g=tok, m=list(members), t0=t0, t1=now())
      progress["events"] += 1
    loop.planned += int(b_plan.steps().sum())
    loop.block += 1


def run_step(worker: Worker, loop: Loop, log: RunLog, trace, t_start: float) -> None:
  """One local step: trace it, update the estimate, stop the worker on a non-finite loss."""
  loop.state, loss, t0, tc, t1 = worker.timed_step(loop.state, loop.steps_done)
  loop.estimate = (1 - EMA) * loop.estimate + EMA * (t1 - t0)
  trace.add(k="step", b=loop.block, s=loop.steps_done, t0=t0 - t_start, t1=t1 - t_start, c=tc - t_start,
            loss=loss)
  loop.steps_done += 1
  # Stops this worker; its peers' watchdogs then stop theirs.
  check_finite(loop.steps_done, log.describe_last(), train_loss=loss)
  log.progress(min(loop.steps_done, worker.config.num_steps), train_loss=loss)
