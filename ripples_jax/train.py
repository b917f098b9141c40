"""Decentralized data-parallel training: a schedule's rounds on the engine, lockstep on the device mesh.

The entry point experiments/train.py only parses flags and calls `train_and_evaluate(config, workdir)`.
"""
import os
import time

import jax
import numpy as np
from absl import logging

from ripples_jax import checkpoint
from ripples_jax import data as data_lib
from ripples_jax import engine
from ripples_jax import metrics as metrics_lib
from ripples_jax import schedule as schedule_lib
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.models import build_model, num_params
from ripples_jax.optim import make_optimizer
from ripples_jax.progress import Progress
from ripples_jax.validation import ConfigError, validate_train_config


def make_workdir(workdir: str | None) -> str:
  """The given workdir, or a fresh timestamped folder under runs/."""
  if not workdir:
    workdir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    base, k = workdir, 1
    while os.path.exists(workdir):
      workdir, k = f"{base}-{k}", k + 1
  os.makedirs(workdir, exist_ok=True)
  return workdir


def write_config(config, workdir: str) -> None:
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))


def shared_workdir(workdir: str | None) -> str:
  """The run's folder; with several processes it must be given (a folder every process sees)."""
  if workdir is None and jax.process_count() > 1:
    raise ConfigError("--workdir: None is not allowed with several processes: a folder every process sees")
  return make_workdir(workdir)


def train_and_evaluate(config, workdir: str | None = None) -> dict:
  """Runs config.num_steps rounds, writes config.json, metrics.jsonl, TensorBoard, summary.json."""
  validate_train_config(config, jax.device_count(), jax.process_count(), jax.local_device_count())
  n = config.num_workers
  if config.executor == "async":
    workdir = shared_workdir(workdir)
    if jax.process_index() == 0:
      write_config(config, workdir)
    from ripples_jax.runtime import worker  # the asynchronous multi-process executor
    return worker.run(config, workdir)
  if config.executor == "sim":
    workdir = make_workdir(workdir)
    write_config(config, workdir)
    from ripples_jax import sim  # the event-driven executor
    return sim.simulate_and_train(config, workdir)[0]

  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed)
  shards = data_lib.shard_indices(data["y_train"], n, config.data_sharding, seed=config.seed)
  mesh = make_worker_mesh(n)
  schedule = schedule_lib.make_schedule(config)
  model = build_model(config.model, data["num_classes"])
  optimizer = make_optimizer(config.optimizer, config.num_steps)

  workdir = shared_workdir(workdir)
  if jax.process_index() == 0:
    write_config(config, workdir)

  state = engine.init_state(model, optimizer, jax.random.key(config.seed), data["x_train"][:1], n, mesh)
  round_fn = engine.make_round_fn(model, optimizer, mesh, schedule.layouts, config.preduce_impl)
  eval_fn = engine.make_eval_fn(model)
  x_test, y_test = data["x_test"], data["y_test"]
  if jax.process_count() == 1:  # several processes: host arrays, the same on every process (replicated)
    x_test, y_test = jax.device_put((x_test, y_test))
  sharding = engine.worker_sharding(mesh)
  put, local_rows = worker_feeder(mesh, n, sharding)
  logging.info("%s: %d workers on %d %s devices (%d processes), %s with %d params, %d layouts per period",
               config.algorithm, n, mesh.size, jax.default_backend(), jax.process_count(), config.model,
               num_params(jax.tree.map(lambda a: a[0], state["params"])), len(schedule.layouts))

  lead = jax.process_index() == 0  # only process 0 writes metrics and the summary
  ckpt = checkpoint.Checkpointer(workdir, config.checkpoint_every, config.checkpoint_keep)
  got = ckpt.restore(state)
  first, worker_steps, last, t_offset = 0, np.zeros(n, np.int64), {}, 0.0
  if got is not None:
    first, state, meta = got
    worker_steps, last, t_offset = np.array(meta["worker_steps"]), meta["last"], meta["time"]
  writer = metrics_lib.MetricWriter(workdir) if lead else None
  progress = Progress(config.num_steps, config.log_every) if lead else None
  pending = None  # (step, loss_W on device): fetched one step late so dispatch stays asynchronous
  t0 = time.time() - t_offset

  def flush(step, loss_W, extra=None):
    loss = float(np.nanmean(gather(loss_W)))
    record = {"step": step, "time": time.time() - t0, "train_loss": loss, **(extra or {})}
    if writer:
      writer.write(record)
    last.update(record)
    # After logging, so the bad value is on disk.
    metrics_lib.check_finite(step, ckpt.describe_last(), train_loss=loss)

  try:
    for s in range(first, config.num_steps):
      x_WxB, y_WxB = data_lib.batch_at(data["x_train"], data["y_train"], shards, config.batch_size,
                                       config.seed, s, workers=local_rows)
      r = schedule.round(s)
      state, loss_W = round_fn(state, put(x_WxB), put(y_WxB), put(r.step_mask[local_rows]), r.layout_idx)
      worker_steps += r.step_mask
      step = s + 1
      if pending is not None:
        flush(*pending)
        pending = None
      if step % config.eval_every == 0 or step == config.num_steps:
        ev = {k: float(v) for k, v in eval_fn(state, x_test, y_test).items()}
        flush(step, loss_W, ev)
      elif step % config.log_every == 0:
        pending = (step, loss_W)
      if config.checkpoint_every and step % config.checkpoint_every == 0:
        if pending is not None:  # the checkpoint's metrics line count includes this step's record
          flush(*pending)
          pending = None
        ckpt.save(step, state, {"worker_steps": worker_steps.tolist(), "last": last,
                                "time": time.time() - t0})
      if progress:
        progress.update(step, **{k: last[k] for k in ("train_loss", "test_accuracy") if k in last})
    ckpt.save(config.num_steps, state, {"worker_steps": worker_steps.tolist(), "last": last,
                                        "time": time.time() - t0}, force=True)
    elapsed = time.time() - t0
  finally:
    if writer:
      writer.close()
    ckpt.close()

  summary = {
      "algorithm": config.algorithm, "executor": config.executor, "num_workers": n,
      "num_steps": config.num_steps, "final_test_accuracy": last["test_accuracy"],
      "final_worker_test_accuracy": last["worker_test_accuracy"],
      "final_consensus_distance": last["consensus_distance"], "final_train_loss": last["train_loss"],
      "time": elapsed, "worker_steps": worker_steps.tolist(),
      "throughput": float(worker_steps.sum() / elapsed), "workdir": workdir,
  }
  if lead:
    metrics_lib.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary


def worker_feeder(mesh, num_workers: int, sharding):
  """(put, local_rows): put(rows of this process's workers) -> the global array sharded by worker.

  On one process that is device_put of every row. With several processes (--jax_distributed) each
  feeds only the workers whose devices it owns (jax.make_array_from_process_local_data), so no host
  ever holds another host's batches.
  """
  per_device = num_workers // mesh.size
  devices = mesh.devices.reshape(-1)
  local_rows = np.array([w for w in range(num_workers)
                         if devices[w // per_device].process_index == jax.process_index()])
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
