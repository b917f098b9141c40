"""executor=spmd: a schedule's rounds on the engine, lockstep on the device mesh.

Every round is one jitted program over all workers (masked local steps, then P-Reduce over the
round's layout); with several processes (--jax_distributed) the mesh spans every process's devices
and each process feeds only its own workers' batches. The loss is fetched one round late so dispatch
stays asynchronous; process 0 writes the run's files (RunLog).
"""

import contextlib
import dataclasses
import os
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import algorithms, engine, workload
from ripples_jax import data as data_lib
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.distributed.collective_guard import CollectiveGuard
from ripples_jax.models import num_params
from ripples_jax.profiling import StepProfiler
from ripples_jax.runlog import RunLog, make_workdir


@dataclasses.dataclass
class Loop:
  """The loop state, saved as the checkpoint's cursor."""

  step: int = 0  # rounds completed
  worker_steps: list = None  # local steps per worker
  time: float = 0.0  # seconds of training before this process started (resume)


def train(config, workdir: str | None = None) -> dict:
  """Runs config.num_steps rounds; returns the summary."""
  n = config.num_workers
  s = workload.build(config)
  mesh = make_worker_mesh(n)
  schedule = algorithms.make_schedule(config)
  workdir = make_workdir(workdir, config)
  state = engine.init_state(s.model, s.optimizer, jax.random.key(config.seed), s.data["x_train"][:1], n, mesh)
  round_fn = engine.make_round_fn(s.model, s.optimizer, mesh, schedule.layouts, config.preduce_impl)
  eval_fn = engine.make_eval_fn(s.model)
  x_test, y_test = s.data["x_test"], s.data["y_test"]
  if jax.process_count() == 1:  # several processes: host arrays, the same on every process (replicated)
    x_test, y_test = jax.device_put((x_test, y_test))
  put, local_rows = worker_feeder(mesh, n, engine.worker_sharding(mesh))
  logging.info(
    "%s: %d workers on %d %s devices (%d processes), %s with %d params, %d layouts per period",
    config.algorithm,
    n,
    mesh.size,
    jax.default_backend(),
    jax.process_count(),
    config.model,
    num_params(jax.tree.map(lambda a: a[0], state["params"])),
    len(schedule.layouts),
  )

  stuck_s = config.get("stuck_timeout_s", 0.0)
  with (
    RunLog(workdir, config, config.num_steps) as log,
    contextlib.closing(CollectiveGuard(stuck_s, workdir, lambda: newest_checkpoint(log))) as guard,
  ):
    cur = Loop(worker_steps=[0] * n)
    got = log.restore(state)
    if got is not None:
      _, state, saved = got
      cur = Loop(**saved)
    worker_steps = np.array(cur.worker_steps, np.int64)
    t0 = time.time() - cur.time
    pending = None  # (step, loss_W on device): read one round late

    def flush(step, loss_W, extra=None):
      log.record(step, time.time() - t0, train_loss=float(np.nanmean(gather(loss_W))), **(extra or {}))

    def save(step, force=False):
      log.checkpoint(
        step, state, dataclasses.asdict(Loop(step, worker_steps.tolist(), time.time() - t0)), force=force
      )

    profiler = StepProfiler(config.get("profile_steps", ""), workdir, log.is_lead)
    what = [preduce_name(layout) for layout in schedule.layouts]
    for i in range(cur.step, config.num_steps):
      profiler.step(i)
      x_WxB, y_WxB = data_lib.batch_at(
        s.data["x_train"], s.data["y_train"], s.shards, config.batch_size, config.seed, i, workers=local_rows
      )
      r = schedule.round(i)
      guard.admit()  # at most two rounds in flight (docs/design.md 5.2)
      state, loss_W = round_fn(state, put(x_WxB), put(y_WxB), put(r.step_mask[local_rows]), r.layout_idx)
      guard.dispatched(i + 1, loss_W, what[r.layout_idx])
      worker_steps += r.step_mask
      step = i + 1
      if pending is not None:
        flush(*pending)
        pending = None
      if step % config.eval_every == 0 or step == config.num_steps:
        guard.drain()  # the evaluation's collectives alone on the pools
        flush(step, loss_W, {k: float(v) for k, v in eval_fn(state, x_test, y_test).items()})
      elif step % config.log_every == 0:
        pending = (step, loss_W)
      if config.checkpoint_every and step % config.checkpoint_every == 0:
        if pending is not None:  # the checkpoint's metrics line count includes this step's record
          flush(*pending)
          pending = None
        guard.drain()  # the checkpoint's fingerprint (collectives too) alone on the pools
        save(step)
      log.progress(step)
    profiler.close()
    guard.drain()
    save(config.num_steps, force=True)
    return log.finish(time=time.time() - t0, worker_steps=worker_steps)


def preduce_name(layout) -> str:
  """The collective a round with `layout` runs, as the stuck-collective line names it."""
  if len(layout) == 1:
    return "the all-reduce (psum of every worker)"
  return "the P-Reduce (grouped psum over " + " ".join(str(list(g)) for g in layout if len(g) > 1) + ")"


def newest_checkpoint(log) -> str:
  """The newest committed checkpoint folder of the run, or 'none' (orbax names a committed one by its
  step; an unfinished write is a temporary folder). Read from the folder, not orbax's manager: the
  guard's thread calls it while the main thread may be inside orbax."""
  steps = [int(d) for d in os.listdir(log.ckpt_dir) if d.isdigit()] if os.path.isdir(log.ckpt_dir) else []
  return os.path.join(log.ckpt_dir, str(max(steps))) if steps else "none"


def worker_feeder(mesh, num_workers: int, sharding):
  """(put, local_rows): put(rows of this process's workers) -> the global array sharded by worker.

  On one process that is device_put of every row. With several processes (--jax_distributed) each
  feeds only the workers whose devices it owns (jax.make_array_from_process_local_data), so no host
  ever holds another host's batches.
  """
  per_device = num_workers // mesh.size
  devices = mesh.devices.reshape(-1)
  local_rows = np.array(
    [w for w in range(num_workers) if devices[w // per_device].process_index == jax.process_index()]
  )
  if jax.process_count() == 1:
    return (lambda a: jax.device_put(a, sharding)), local_rows

  def put(rows):
    rows = np.asarray(rows)
    return jax.make_array_from_process_local_data(sharding, rows, (num_workers,) + rows.shape[1:])

  return put, local_rows


def gather(x) -> np.ndarray:
  """A (possibly multi-process) array as numpy on every process."""
  if jax.process_count() == 1 or x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
