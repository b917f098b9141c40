"""Decentralized data-parallel training: a schedule's rounds on the engine, lockstep on the device mesh.

The entry point experiments/train.py only parses flags and calls `train_and_evaluate(config, workdir)`.
"""
import os
import time

import jax
import numpy as np
from absl import logging

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


def train_and_evaluate(config, workdir: str | None = None) -> dict:
  """Runs config.num_steps rounds, writes config.json, metrics.jsonl, TensorBoard, summary.json."""
  validate_train_config(config, jax.device_count(), jax.process_count(), jax.local_device_count())
  n = config.num_workers
  if config.executor == "async":
    # One directory shared by every worker process: process 0 names it when none is given.
    workdir = workdir or (make_workdir(None) if jax.process_index() == 0 else None)
    if workdir is None:
      raise ConfigError("--workdir: None is not allowed with executor=async on several processes: "
                        "a folder every process sees")
    os.makedirs(workdir, exist_ok=True)
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

  workdir = make_workdir(workdir)
  write_config(config, workdir)

  state = engine.init_state(model, optimizer, jax.random.key(config.seed), data["x_train"][:1], n, mesh)
  round_fn = engine.make_round_fn(model, optimizer, mesh, schedule.layouts, config.preduce_impl)
  eval_fn = engine.make_eval_fn(model)
  x_test, y_test = jax.device_put((data["x_test"], data["y_test"]))
  sharding = engine.worker_sharding(mesh)
  logging.info("%s: %d workers on %d %s devices, %s with %d params, %d layouts per period",
               config.algorithm, n, mesh.size, jax.default_backend(), config.model,
               num_params(jax.tree.map(lambda a: a[0], state["params"])), len(schedule.layouts))

  writer = metrics_lib.MetricWriter(workdir)
  progress = Progress(config.num_steps, config.log_every)
  worker_steps = np.zeros(n, np.int64)
  pending = None  # (step, loss_W on device): fetched one step late so dispatch stays asynchronous
  last = {}
  t0 = time.time()

  def flush(step, loss_W, extra=None):
    loss = float(np.nanmean(np.asarray(loss_W)))
    record = {"step": step, "time": time.time() - t0, "train_loss": loss, **(extra or {})}
    writer.write(record)
    last.update(record)
    metrics_lib.check_finite(step, train_loss=loss)  # after logging, so the bad value is on disk

  try:
    for s in range(config.num_steps):
      x_WxB, y_WxB = data_lib.batch_at(data["x_train"], data["y_train"], shards, config.batch_size,
                                       config.seed, s)
      r = schedule.round(s)
      state, loss_W = round_fn(state, jax.device_put(x_WxB, sharding), jax.device_put(y_WxB, sharding),
                               jax.device_put(r.step_mask, sharding), r.layout_idx)
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
      progress.update(step, **{k: last[k] for k in ("train_loss", "test_accuracy") if k in last})
    elapsed = time.time() - t0
  finally:
    writer.close()

  summary = {
      "algorithm": config.algorithm, "executor": config.executor, "num_workers": n,
      "num_steps": config.num_steps, "final_test_accuracy": last["test_accuracy"],
      "final_worker_test_accuracy": last["worker_test_accuracy"],
      "final_consensus_distance": last["consensus_distance"], "final_train_loss": last["train_loss"],
      "time": elapsed, "worker_steps": worker_steps.tolist(),
      "throughput": float(worker_steps.sum() / elapsed), "workdir": workdir,
  }
  metrics_lib.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary
