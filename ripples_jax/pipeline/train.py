"""Pipeline (model-parallel) training: DSP and its baselines, behind experiments/train_dsp.py.

Every method runs the same loop (baselines.METHODS): tick t feeds batch t to stage 0 and the labels of
batch t - F_{K-1} to the last stage; a method with link delays runs `drain` more ticks after the last
batch so that every stage applies its update. Batch `done` = t + 1 - drain is recorded every log_every
batches; a checkpoint is taken right after a record (no loss pending), with the loop's Cursor as its
metadata. Files are written only through RunLog.
"""
import copy
import dataclasses
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ripples_jax import data as data_lib
from ripples_jax.optim import make_optimizer
from ripples_jax.pipeline import baselines, split, tick, timing
from ripples_jax.runlog import RunLog, make_workdir
from ripples_jax.config import validate_dsp_config


@dataclasses.dataclass
class Cursor:
  """Where the loop stands: the checkpoint's metadata (dataclasses.asdict saved, Cursor(**d) restored)."""
  tick: int = 0       # the next tick to run
  time: float = 0.0   # training seconds before this tick (carried over a resume)


class _Feed:
  """Batch t of the one training stream (the pipeline is a single model: one shard of every index)."""

  def __init__(self, data, config, num_batches):
    self.data, self.config, self.num_batches = data, config, num_batches
    self.everything = [np.arange(len(data["y_train"]))]
    self.sample = data["x_train"][:config.batch_size]

  def indices(self, i):  # negative: warm-up, any batch (its update is masked)
    return data_lib.batch_indices(self.everything, self.config.batch_size, self.config.seed, max(i, 0))[0]

  def x(self, t):
    """Stage 0's input at tick t: batch t, zeros once every batch is in (the drain)."""
    return self.data["x_train"][self.indices(t)] if t < self.num_batches else np.zeros_like(self.sample)

  def labels(self, i):
    return self.data["y_train"][self.indices(i)]


def _model_times(config, stages, state, sample):
  """Measured stage times and what the timing model makes of them (logged)."""
  fwd_K, bwd_K = timing.measure_stage_times(stages, state, sample)
  # What this process runs: the recompute is its own forward call (fused exists only per_process), DNI's
  # predictors cost what they measure.
  kw = dict(microbatches=config.microbatches, fused=False)
  if config.method == "dni":
    kw["predictor_K"] = timing.measure_predictor_times(state)
  out = {"fwd_K": fwd_K, "bwd_K": bwd_K, "kw": kw,
         "iteration": timing.iteration_time(config.method, fwd_K, bwd_K, **kw),
         "speedup": timing.speedup_vs_bp(config.method, fwd_K, bwd_K, **kw)}
  logging.info("%s K=%d: per-stage forward %s ms, backward %s ms; modeled speedup over BP %.2f",
               config.method, len(stages), np.round(1e3 * np.array(fwd_K), 3),
               np.round(1e3 * np.array(bwd_K), 3), out["speedup"])
  return out


def _straggler(config, times):
  """Steady iteration time of the method and of BP under the configured slowdown (None without one)."""
  if config.slowdown <= 1:
    return None
  stage = config.straggler_stage if config.straggler_stage >= 0 else None
  per_iter = lambda m: timing.simulate(m, times["fwd_K"], times["bwd_K"], 200, straggler_stage=stage,
                                       slowdown=config.slowdown, random_p=config.straggler_p,
                                       seed=config.seed, **times["kw"])
  return {"slowed_iteration": float(np.diff(per_iter(config.method))[50:].mean()),
          "bp_slowed_iteration": float(np.diff(per_iter("bp"))[50:].mean())}


def _record(log, config, run, state, done, elapsed, losses):
  """One metrics line at batch `done`: the mean train loss since the last, test metrics every eval_every."""
  n = run["num_batches"]
  scalars = {"epoch": done / run["batches_per_epoch"], "modeled_time": done * run["times"]["iteration"],
             "train_loss": float(np.mean(np.asarray(jnp.stack(losses)))) if losses else float("nan")}
  if done % config.eval_every == 0 or done == n:
    # The composed model on the test set's device (the stages may sit on one device each).
    model = jax.device_put([{"params": st["params"], "model_state": st["model_state"]} for st in state],
                           run["test"][0].sharding)
    acc_test, loss_test = run["evaluate"](model, *run["test"])
    scalars.update(test_accuracy=float(acc_test), test_loss=float(loss_test))
  log.record(done, elapsed, **scalars)


def _loop(log, config, run, state, cursor: Cursor):
  """Ticks from cursor.tick to the end of the drain; returns (state, the training seconds)."""
  n, feed, step = run["num_batches"], run["feed"], run["step"]
  schedule = baselines.schedule_of(config)
  drain = schedule.drain_ticks() if schedule else 0
  offset = schedule.offsets[-1] if schedule else 0  # the last stage works on batch t - offset
  losses, t0 = [], time.time() - cursor.time
  for t in range(cursor.tick, n + drain):
    state, (loss, _) = step(state, feed.x(t), feed.labels(t - offset), t)
    done = t + 1 - drain  # batches whose updates every stage has applied
    if 0 <= t - offset < n:
      losses.append(loss)
    if done > 0 and (done % config.log_every == 0 or done == n):
      _record(log, config, run, state, done, time.time() - t0, losses)
      losses = []
      # Right after a record, so no loss is pending; the tick carries the pipeline's fill state.
      cursor = Cursor(tick=t + 1, time=time.time() - t0)
      log.checkpoint(done, state, dataclasses.asdict(cursor), force=done == n)
    elif done > 0:
      log.progress(done)
  return state, time.time() - t0


def _data(config):
  """Data, stages, the batch feed and the optimizer: what every placement shares."""
  kw = dict(config.synthetic) if config.dataset == "synthetic" and "synthetic" in config else {}
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed, **kw)
  stages = split.split_model(config.model, data["num_classes"], config.num_stages,
                             sample_shape=data["input_shape"])
  batches_per_epoch = len(data["y_train"]) // config.batch_size
  num_batches = config.num_epochs * batches_per_epoch
  feed = _Feed(data, config, num_batches)
  optimizer = make_optimizer(config.optimizer, num_batches)
  return stages, optimizer, feed, data, num_batches, batches_per_epoch


def _setup(config):
  """Data, stages, optimizer and the method's (init_fn, step_fn), before any compile."""
  stages, optimizer, feed, data, num_batches, batches_per_epoch = _data(config)
  init_fn, step_fn = baselines.METHODS[config.method]
  state = init_fn(stages, optimizer, config, jax.random.key(config.seed), feed.sample, data["num_classes"])
  run = {"num_batches": num_batches, "batches_per_epoch": batches_per_epoch, "feed": feed,
         "step": step_fn(stages, optimizer, config, num_batches),
         "evaluate": baselines.make_eval(stages),
         "test": jax.device_put((data["x_test"], data["y_test"]))}
  return stages, state, run


def train_and_evaluate(config, workdir: str | None = None) -> dict:
  validate_dsp_config(config, num_processes=jax.process_count())  # before anything loads or compiles
  if config.placement == "per_process":  # stage k in process k: pipeline/runtime.py
    from ripples_jax.pipeline import runtime
    return runtime.run(config, workdir, _data(config))
  workdir = make_workdir(workdir, config)
  stages, state, run = _setup(config)
  run["times"] = times = _model_times(config, stages, state, run["feed"].sample)
  n = run["num_batches"]
  with RunLog(workdir, config, total_steps=n) as log:
    got = log.restore(state)
    cursor = Cursor()
    if got is not None:
      _, state, saved = got
      cursor = Cursor(**saved)
    state, seconds = _loop(log, config, run, state, cursor)
    schedule = baselines.schedule_of(config)
    return log.finish(
        time=seconds, worker_steps=[n],
        method=config.method, num_stages=config.num_stages, mode=config.mode, delay=config.delay,
        epochs=config.num_epochs, num_batches=n, modeled_iteration=times["iteration"],
        modeled_speedup_vs_bp=times["speedup"], stage_forward_s=times["fwd_K"],
        stage_backward_s=times["bwd_K"], staleness=list(schedule.staleness) if schedule else None,
        stored_bytes=tick.stored_bytes(state) if config.method != "dni" else None,
        straggler=_straggler(config, times))


def run_fresh(base, out_dir: str, name: str, **overrides):
  """(summary, metrics records) of a fresh run of `base` with dotted-key overrides in out_dir/name (an
  earlier run there is deleted); a diverged run (the NaN stop) is a result, its summary marked
  `diverged`. For experiments that run many configs."""
  config = copy.deepcopy(base)
  config.unlock()
  for k, v in overrides.items():
    node = config
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  workdir = os.path.join(out_dir, name)
  shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
  try:
    summary = train_and_evaluate(config, workdir)
  except FloatingPointError as e:  # a diverged run is a result, not the end of the experiment
    summary = json.load(open(os.path.join(workdir, "config.json")))
    summary.update(diverged=str(e), final_test_accuracy=float("nan"), final_train_loss=float("nan"),
                   modeled_speedup_vs_bp=float("nan"), stage_forward_s=None, stage_backward_s=None,
                   stored_bytes=None, staleness=None, time=float("nan"))
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return summary, records
