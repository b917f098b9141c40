"""Pipeline (model-parallel) training: DSP and its baselines, behind experiments/train_dsp.py."""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from ripples_jax import checkpoint
from ripples_jax import data as data_lib
from ripples_jax import metrics as metrics_lib
from ripples_jax.benchmark import time_interleaved
from ripples_jax.models import apply_model
from ripples_jax.optim import make_optimizer
from ripples_jax.pipeline import dsp, split, timing
from ripples_jax.progress import Progress
from ripples_jax.train import make_workdir, write_config
from ripples_jax.validation import validate_dsp_config


def measure_stage_times(stages, state, sample_x, reps: int = 20):
  """Median forward and backward seconds of each stage's jitted program on one batch."""
  fwd_K, bwd_K = [], []
  x = jnp.asarray(sample_x)
  for stage, st in zip(stages, state):
    f = jax.jit(lambda p, x, stage=stage, ms=st["model_state"]: apply_model(stage, p, ms, x, True)[0])
    y = f(st["params"], x)

    def fb(p, x, stage=stage, ms=st["model_state"], y=y):
      out, pullback = jax.vjp(lambda p, x: apply_model(stage, p, ms, x, True)[0], p, x)
      return pullback(jnp.ones_like(out))
    fb = jax.jit(fb)
    med = time_interleaved({"f": lambda: f(st["params"], x), "fb": lambda: fb(st["params"], x)}, reps=reps)
    fwd_K.append(med["f"])
    bwd_K.append(max(med["fb"] - med["f"], 0.0))
    x = y
  return fwd_K, bwd_K


def train_and_evaluate(config, workdir: str | None = None) -> dict:
  validate_dsp_config(config, num_processes=jax.process_count())  # before anything loads or compiles
  workdir = make_workdir(workdir)
  write_config(config, workdir)
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed)
  K, B = config.num_stages, config.batch_size
  stages = split.split_model(config.model, data["num_classes"], K, sample_shape=data["input_shape"])
  batches_per_epoch = len(data["y_train"]) // B
  num_batches = config.num_epochs * batches_per_epoch
  optimizer = make_optimizer(config.optimizer, num_batches)
  everything = [np.arange(len(data["y_train"]))]  # one shard: the pipeline is a single model
  rng = jax.random.key(config.seed)
  sample = data["x_train"][:B]

  def batch_idx(i):  # negative: warm-up, any batch (its update is masked)
    return data_lib.batch_indices(everything, B, config.seed, max(i, 0))[0]

  def batch(i):
    idx = batch_idx(i)
    return data["x_train"][idx], data["y_train"][idx]

  if config.method == "dni":
    predictor_opt = optax.sgd(config.dni_lr)
    state = dsp.init_dni(stages, optimizer, predictor_opt, rng, sample, data["num_classes"])
    step_fn = dsp.make_dni_step(stages, optimizer, predictor_opt)
    schedule = None
  elif config.method == "bp":
    state = dsp.init_pipeline(stages, optimizer, dsp.method_schedule("bp", K), rng, sample)
    step_fn = dsp.make_bp_step(stages, optimizer)
    schedule = None
  elif config.method == "gpipe":
    state = dsp.init_pipeline(stages, optimizer, dsp.method_schedule("bp", K), rng, sample)
    step_fn = dsp.make_gpipe_step(stages, optimizer, config.microbatches)
    schedule = None
  else:
    mode = config.mode if config.method == "dsp" else None
    schedule = dsp.method_schedule(config.method, K, config.delay, mode)
    state = dsp.init_pipeline(stages, optimizer, schedule, rng, sample)
    devices = jax.devices()[:K] if config.placement == "per_stage" else None
    if devices:
      state = dsp.place(state, devices)
    tick = dsp.make_tick(stages, optimizer, schedule, num_batches, devices)
  evaluate = dsp.make_eval(stages)
  x_test, y_test = jax.device_put((data["x_test"], data["y_test"]))

  fwd_K, bwd_K = measure_stage_times(stages, state, sample)
  kw = dict(microbatches=config.microbatches, fused=True)
  modeled_iter = timing.iteration_time(config.method, fwd_K, bwd_K, **kw)
  speedup = timing.speedup_vs_bp(config.method, fwd_K, bwd_K, **kw)
  logging.info("%s K=%d: per-stage forward %s ms, backward %s ms; modeled speedup over BP %.2f",
               config.method, K, np.round(1e3 * np.array(fwd_K), 3), np.round(1e3 * np.array(bwd_K), 3),
               speedup)

  ckpt = checkpoint.Checkpointer(workdir, config.checkpoint_every, config.checkpoint_keep)
  got = ckpt.restore(state)
  first_tick, last, t_offset = 0, {}, 0.0
  if got is not None:
    _, state, meta = got
    first_tick, last, t_offset = meta["tick"], meta["last"], meta["time"]
  writer = metrics_lib.MetricWriter(workdir)
  progress = Progress(num_batches, config.log_every)
  drain = schedule.drain_ticks() if schedule else 0
  last_stage_offset = schedule.offsets[-1] if schedule else 0
  losses, t0 = [], time.time() - t_offset
  try:
    for t in range(first_tick, num_batches + drain):
      if schedule is None:
        state, (loss, acc) = step_fn(state, *batch(t))
      else:
        # Batch t enters stage 0 (nothing new during the drain); the labels of the batch the last
        # stage works on go straight to it.
        x_t = batch(t)[0] if t < num_batches else np.zeros_like(sample)
        y_t = data["y_train"][batch_idx(t - last_stage_offset)]
        state, (loss, acc) = tick(state, x_t, y_t, t)
      done = t + 1 - drain  # batches whose updates every stage has applied
      if 0 <= t - last_stage_offset < num_batches:
        losses.append(loss)
      if done > 0 and (done % config.log_every == 0 or done == num_batches):
        record = {"step": done, "epoch": done / batches_per_epoch, "time": time.time() - t0,
                  "modeled_time": done * modeled_iter,
                  "train_loss": float(np.mean(np.asarray(jnp.stack(losses)))) if losses else float("nan")}
        losses = []
        if done % config.eval_every == 0 or done == num_batches:
          acc_test, loss_test = evaluate(state, x_test, y_test)
          record.update(test_accuracy=float(acc_test), test_loss=float(loss_test))
        writer.write(record)
        last.update(record)
        metrics_lib.check_finite(done, ckpt.describe_last(), train_loss=record["train_loss"])
        if config.checkpoint_every and (done % config.checkpoint_every == 0 or done == num_batches):
          # Right after a record, so no loss is pending; the tick carries the pipeline's fill state.
          ckpt.save(done, state, {"tick": t + 1, "last": last, "time": time.time() - t0}, force=True)
      progress.update(max(done, 0))
  finally:
    writer.close()
    ckpt.close()

  straggler = None
  if config.slowdown > 1:
    stage = config.straggler_stage if config.straggler_stage >= 0 else None
    per_iter = lambda m: timing.simulate(m, fwd_K, bwd_K, 200, straggler_stage=stage,
                                         slowdown=config.slowdown, random_p=config.straggler_p,
                                         seed=config.seed, **kw)
    straggler = {"slowed_iteration": float(np.diff(per_iter(config.method))[50:].mean()),
                 "bp_slowed_iteration": float(np.diff(per_iter("bp"))[50:].mean())}
  summary = {
      "method": config.method, "num_stages": K, "mode": config.mode, "delay": config.delay,
      "final_test_accuracy": last.get("test_accuracy"), "final_train_loss": last.get("train_loss"),
      "time": time.time() - t0, "epochs": config.num_epochs, "num_batches": num_batches,
      "modeled_iteration": modeled_iter, "modeled_speedup_vs_bp": speedup,
      "stage_forward_s": fwd_K, "stage_backward_s": bwd_K,
      "staleness": list(schedule.staleness) if schedule else None,
      "stored_bytes": dsp.stored_bytes(state) if config.method != "dni" else None,
      "straggler": straggler, "workdir": workdir,
  }
  metrics_lib.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary
