"""executor=async: one controller process per worker, each running the Ripples worker loop for real.

  loop: local step on this worker's devices (padded to runtime.step_time, slowed if this worker is
        slow) -> its next group from the global plan -> P-Reduce over the group's sub-mesh -> repeat

No global barrier inside the run: a worker blocks only in the collectives of its own groups. The groups
come from runtime.plan (the Group Buffer the simulator uses), in one global order, so no cyclic wait
can occur. Step-time estimates (EMA of this worker's measured steps) are exchanged at block boundaries
through the coordination service; block b is planned with the estimates published at block
b - runtime.estimate_lag, so a fast worker rarely waits for them.
"""
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

from ripples_jax import data as data_lib
from ripples_jax import checkpoint as ckpt_lib
from ripples_jax import engine
from ripples_jax import metrics as metrics_lib
from ripples_jax.models import build_model, init_model
from ripples_jax.optim import make_optimizer
from ripples_jax.progress import Progress
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


def run(config, workdir: str) -> dict:
  """This process's worker: runs its part of the plan, then (process 0) writes the run's summary."""
  rt, n = config.runtime, config.num_workers
  me = jax.process_index()
  kv = coord.client()
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed)
  shards = data_lib.shard_indices(data["y_train"], n, config.data_sharding, seed=config.seed)
  model = build_model(config.model, data["num_classes"])
  optimizer = make_optimizer(config.optimizer, config.num_steps)

  # Devices per worker, in the global order every process sees the same way.
  devices_of = {w: [d for d in jax.devices() if d.process_index == w] for w in range(n)}
  local_mesh = Mesh(np.array(devices_of[me]), (LOCAL,))
  params, model_state = init_model(model, jax.random.key(config.seed), data["x_train"][:1])
  flat0, unravel = ravel_pytree({"params": params, "model_state": model_state})
  step_fn, rep, batch_sharding = make_step_fn(model, optimizer, unravel, local_mesh)
  averager = GroupAverager(local_mesh, devices_of, rt.cache_size)
  model_bytes = config.timeline.model_bytes or 4 * flat0.size

  def batch(step):
    idx = data_lib.batch_indices([shards[me]], config.batch_size, config.seed, [step], workers=[me])[0]
    return (jax.device_put(data["x_train"][idx], batch_sharding),
            jax.device_put(data["y_train"][idx], batch_sharding))

  # From host copies: the step donates its input, so every fresh state needs buffers of its own.
  flat0_host, opt0_host = np.asarray(flat0), jax.device_get(optimizer.init(params))
  fresh = lambda: jax.device_put({"flat": flat0_host, "opt_state": opt0_host}, rep)
  hetero = config.hetero
  slow = me in tuple(hetero.slow_workers)

  def slowdown(step):
    """Injected heterogeneity (DESIGN 3.5): this step takes `slowdown` x its real time."""
    if slow:
      return float(hetero.slowdown)
    if hetero.random_p and np.random.default_rng([5, config.seed, me, step]).random() < hetero.random_p:
      return float(hetero.slowdown)
    return 1.0

  def timed_step(state, step):
    x, y = batch(step)
    t0 = time.perf_counter()
    state, loss = step_fn(state, x, y)
    loss = float(loss)  # blocks: the step's real time is what the padding and the estimates need
    t_compute = time.perf_counter()
    padded = max(t_compute - t0, rt.step_time)
    target = t0 + padded * slowdown(step)
    while (left := target - time.perf_counter()) > 0:
      time.sleep(left)
    return state, loss, t0, t_compute, time.perf_counter()

  # Warm-up on a throw-away state: compiles the step and measures this worker's step time, the
  # estimate every process plans the first blocks with.
  scratch = fresh()
  scratch, *_ = timed_step(scratch, 0)
  warm = []
  for k in range(rt.warmup_steps):
    scratch, _, t0, _, t1 = timed_step(scratch, k)
    warm.append(t1 - t0)
  del scratch
  estimate = float(np.median(warm))

  # Checkpoints are global: at an agreed block every worker contributes its shard of one array per
  # leaf, stacked on a worker axis (orbax writes each process's shards; it refuses per-process
  # host-local arrays in a multi-process job). Resume from the newest one that reads back.
  global_mesh = Mesh(np.array([devices_of[w] for w in range(n)]), (WORKER, LOCAL))
  manager = ckpt_lib.manager(os.path.abspath(os.path.join(workdir, "ckpt")), rt.checkpoint_keep)
  lag = rt.estimate_lag

  def pack(state, steps_done, est_history, estimate, t):
    blocks = sorted(est_history)[-(lag + 1):]
    est = np.full(lag + 1, np.nan)
    est[:len(blocks)] = [est_history[b] for b in blocks]
    ids = np.full(lag + 1, -1, np.int32)
    ids[:len(blocks)] = blocks
    exact = lambda a: np.asarray(a, np.float64).reshape(-1).view(np.int32)  # float64, bit for bit
    local = {**state, "steps_done": np.int32(steps_done), "est": exact(est), "est_blocks": ids,
             "estimate": exact(estimate), "time": exact(t)}
    return jax.tree.map(lambda a: to_global(jax.device_put(a, rep), global_mesh), local)

  def unpack(global_tree):
    local = jax.tree.map(lambda a: to_local(a, rep), global_tree)
    f64 = lambda a: np.asarray(a).view(np.float64)
    est = {int(b): float(v) for b, v in zip(np.asarray(local["est_blocks"]), f64(local["est"])) if b >= 0}
    state = {"flat": local["flat"], "opt_state": local["opt_state"]}
    return state, int(local["steps_done"]), est, float(f64(local["estimate"])[0]), float(f64(local["time"])[0])

  like = pack(fresh(), 0, {0: 0.0}, 0.0, 0.0)
  got = ckpt_lib.restore_latest(manager, like)  # a corrupt latest one: warned about, the previous used
  if got is not None:
    start, restored, meta = got
    state, steps_done, est_history, estimate, t_offset = unpack(restored)
    block, planned = start, meta["planned"]
    for b, v in est_history.items():
      coord.publish_estimate(kv, b, me, v)
    logging.info("worker %d: resuming at block %d after %d local steps", me, block, steps_done)
  else:
    start = None
    state, block, steps_done, planned, est_history, t_offset = fresh(), 0, 0, 0, {}, 0.0
  for b in ckpt_lib.restorable_steps(manager):
    if start is None or b > start:
      manager.delete(b)  # past the resume point (or unusable): this run writes its own
  for path in glob.glob(os.path.join(workdir, "snapshots", f"*-{me}.npy")):
    name = os.path.basename(path).split("-")[0]
    if not name.isdigit() or int(name) >= block:
      os.remove(path)  # what the lost run did after the resume point is redone
  os.makedirs(os.path.join(workdir, "snapshots"), exist_ok=True)
  trace = trace_lib.TraceWriter(workdir, me, keep_before_block=block if start is not None else None)

  progress = {"steps": steps_done, "events": 0, "done": False}
  watchdog = coord.Watchdog(kv, me, n, lambda: (progress["steps"], progress["events"], progress["done"]),
                            rt.heartbeat_s, rt.heartbeat_timeout, rt.stall_timeout)
  kv.wait_at_barrier(f"{coord.PREFIX}/start/{block}", int(rt.stall_timeout * 1000))
  t_start = time.perf_counter() - t_offset
  now = lambda: time.perf_counter() - t_start
  watchdog.start()
  bar = Progress(config.num_steps, config.log_every) if me == 0 else None
  eval_blocks = max(1, config.eval_every // rt.block_steps)
  fetched, saved = {}, start
  try:
    while True:
      if me == rt.fail_worker and block == rt.fail_block:
        fail_now(manager, saved, block)
      if block not in est_history:
        coord.publish_estimate(kv, block, me, estimate)
        est_history[block] = estimate
      est_block = max(0, block - rt.estimate_lag)
      if config.algorithm in plan_lib.PLANNED and est_block not in fetched:
        fetched[est_block] = coord.fetch_estimates(kv, est_block, n, 10 * rt.stall_timeout)
      b_plan = plan_lib.plan_block(config, block, planned, fetched.get(est_block, [1.0] * n), model_bytes)
      trace.add(k="block", b=block, t=now(), s=steps_done)
      if block % eval_blocks == 0:
        np.save(snapshot_path(workdir, block, me), np.asarray(state["flat"]))
      if rt.checkpoint_every and block and block % rt.checkpoint_every == 0 and start != block:
        # Collective: every worker saves at this block (the plan is the same everywhere).
        ckpt_lib.save(manager, block, pack(state, steps_done, est_history, estimate, now()),
                      {"planned": planned, "block": block})
        saved = block
      trace.flush()
      if not any(b_plan.tokens):
        break
      for tok in b_plan.tokens[me]:
        if tok == plan_lib.STEP:
          state, loss, t0, tc, t1 = timed_step(state, steps_done)
          estimate = (1 - EMA) * estimate + EMA * (t1 - t0)
          trace.add(k="step", b=block, s=steps_done, t0=t0 - t_start, t1=t1 - t_start, c=tc - t_start,
                    loss=loss)
          steps_done += 1
          progress["steps"] = steps_done
          if not np.isfinite(loss):  # stops this worker; its peers' watchdogs then stop theirs
            last_ckpt = manager.latest_step()
            metrics_lib.check_finite(steps_done, f"{manager.directory}/{last_ckpt}" if last_ckpt else None,
                                     train_loss=loss)
          if bar:
            bar.update(min(steps_done, config.num_steps), train_loss=loss)
        else:
          members = b_plan.groups[tok]
          t0 = now()
          state["flat"] = averager.average(members, state["flat"])
          state["flat"].block_until_ready()
          trace.add(k="group", b=block, g=tok, m=list(members), t0=t0, t1=now())
        progress["events"] += 1
      planned += int(b_plan.steps().sum())
      block += 1
    np.save(snapshot_path(workdir, "final", me), np.asarray(state["flat"]))
    trace.add(k="end", b=block, t=now(), s=steps_done, compiles=averager.compiles)
    trace.flush()
    ckpt_lib.finish(manager)
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
  logging.info("worker %d: %d local steps, %d P-Reduce programs compiled", me, steps_done, averager.compiles)
  if me != 0:
    return {"algorithm": config.algorithm, "executor": "async", "worker": me, "worker_steps": steps_done,
            "workdir": workdir}
  return summary_lib.summarize(config, workdir, model, unravel, data)
