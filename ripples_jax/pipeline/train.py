"""Pipeline (model-parallel) training: DSP and its baselines, behind experiments/train_dsp.py.

Every method runs the same loop (baselines.METHODS): tick t feeds batch t to stage 0 and the labels of
batch t - F_{K-1} to the last stage; a method with link delays runs `drain` more ticks after the last
batch so that every stage applies its update. Batch `done` = t + 1 - drain is recorded every log_every
and every eval_every batches (an evaluation at the latter); a checkpoint is taken right after a record
(no loss pending), with the loop's Loop as its metadata. Files are written only through RunLog.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ripples_jax.pipeline import baselines, devices, methods, program, tick, timing
from ripples_jax.pipeline import inputs as pipeline_inputs
from ripples_jax.runlog import RunLog, make_workdir


@dataclasses.dataclass
class Loop:
  """Where the loop stands: the checkpoint's metadata (dataclasses.asdict saved, Loop(**d) restored)."""

  tick: int = 0  # the next tick to run
  time: float = 0.0  # training seconds before this tick, evaluation excluded (carried over a resume)
  eval_s: float = 0.0  # seconds spent evaluating (not training time, as in the per-process runtime)


def _model_times(config, stages, state, sample):
  """Measured stage times and what the timing model makes of them (logged)."""
  fwd_K, bwd_K = timing.measure_stage_times(stages, state, sample)
  # What this process runs: the recompute is its own forward call (fused exists only per_process), DNI's
  # predictors cost what they measure.
  kw = dict(microbatches=config.microbatches, fused=False)
  if methods.get(config.method).backward == methods.SYNTHETIC:
    kw["predictor_K"] = timing.measure_predictor_times(state)
  out = {
    "fwd_K": fwd_K,
    "bwd_K": bwd_K,
    "kw": kw,
    "iteration": timing.iteration_time(config.method, fwd_K, bwd_K, **kw),
    "speedup": timing.speedup_vs_bp(config.method, fwd_K, bwd_K, **kw),
  }
  logging.info(
    "%s K=%d: per-stage forward %s ms, backward %s ms; modeled speedup over BP %.2f",
    config.method,
    len(stages),
    np.round(1e3 * np.array(fwd_K), 3),
    np.round(1e3 * np.array(bwd_K), 3),
    out["speedup"],
  )
  return out


def _straggler(config, times):
  """Steady iteration time of the method and of BP under the configured slowdown (None without one)."""
  if config.slowdown <= 1:
    return None
  stage = config.straggler_stage if config.straggler_stage >= 0 else None
  per_iter = lambda m: timing.simulate(
    m,
    times["fwd_K"],
    times["bwd_K"],
    200,
    straggler_stage=stage,
    slowdown=config.slowdown,
    random_p=config.straggler_p,
    seed=config.seed,
    **times["kw"],
  )
  return {
    "slowed_iteration": float(np.diff(per_iter(config.method))[50:].mean()),
    "bp_slowed_iteration": float(np.diff(per_iter("bp"))[50:].mean()),
  }


def _scalars(config, run, state, done, losses) -> dict:
  """The metrics at batch `done`: the mean train loss since the last record; test (and validation, when
  the config holds one out) metrics every eval_every."""
  n = run["num_batches"]
  scalars = {"epoch": done / run["batches_per_epoch"], "modeled_time": done * run["times"]["iteration"]}
  if losses:  # none in a window of drain ticks: no train_loss (a NaN would stop the run as diverged)
    scalars["train_loss"] = float(np.mean(np.asarray(jnp.stack(losses))))
  if done % config.eval_every == 0 or done == n:
    # The composed model on the test set's device (the stages may sit on one device each).
    model = jax.device_put(
      [{"params": st["params"], "model_state": st["model_state"]} for st in state], run["test"][0].sharding
    )
    for split in ("test", "val"):
      if split in run:
        acc, loss = run["evaluate"](model, *run[split])
        scalars.update({f"{split}_accuracy": float(acc), f"{split}_loss": float(loss)})
  return scalars


def _loop(log, config, run, state, cursor: Loop):
  """Ticks from cursor.tick to the end of the drain; returns (state, the training seconds)."""
  n, feed, step = run["num_batches"], run["feed"], run["step"]
  schedule = baselines.schedule_of(config)
  drain = schedule.drain_ticks() if schedule else 0
  offset = schedule.offsets[-1] if schedule else 0  # the last stage works on batch t - offset
  losses, eval_s = [], cursor.eval_s
  settle = getattr(step, "settle", lambda state: state)
  # The clock is net of evaluation, as in the per-process runtime: a record's time is training time.
  t0 = time.perf_counter() - cursor.time
  clock = lambda: time.perf_counter() - t0 - (eval_s - cursor.eval_s)
  for t in range(cursor.tick, n + drain):
    state, (loss, _) = step(state, feed.x(t), feed.labels(t - offset), t)
    done = t + 1 - drain  # batches whose updates every stage has applied
    if 0 <= t - offset < n:
      losses.append(loss)
    if done > 0 and (done % config.log_every == 0 or done % config.eval_every == 0 or done == n):
      state = settle(state)  # the fused device tick's pending arrivals into their FIFOs: the canonical state
      jax.block_until_ready(state)  # the training this record covers is done before the clock reads
      elapsed, e0 = clock(), time.perf_counter()
      scalars = _scalars(config, run, state, done, losses)
      eval_s += time.perf_counter() - e0
      log.record(done, elapsed, **scalars)
      losses = []
      # Right after a record, so no loss is pending; the tick carries the pipeline's fill state.
      cursor_now = Loop(tick=t + 1, time=clock(), eval_s=eval_s)
      log.checkpoint(done, state, dataclasses.asdict(cursor_now), force=done == n)
    elif done > 0:
      log.progress(done)
  return settle(state), clock()


def _next_record(config, tick: int, drain: int, n: int) -> int:
  """The batch count the program loop records next when it stands at `tick`: the first after the
  tick - drain batches every stage has applied that is a multiple of log_every or eval_every, or the
  end."""
  done = max(tick - drain, 0)
  every = [config.log_every, config.eval_every]
  return min([n] + [(done // e + 1) * e for e in every if e > 0])


def _loop_program(log, config, run, prog, bufs, cursor: Loop):
  """placement=spmd: the program in dispatches from cursor.tick to the end of the drain, read back only
  at records (pipeline/program.py); returns (bufs, the training seconds)."""
  n, feed = run["num_batches"], run["feed"]
  schedule = baselines.schedule_of(config) if methods.get(config.method).runs_tick("spmd") else None
  drain = schedule.drain_ticks() if schedule else 0
  offset = schedule.offsets[-1] if schedule else 0
  eval_s, t = cursor.eval_s, cursor.tick
  t0 = time.perf_counter() - cursor.time
  clock = lambda: time.perf_counter() - t0 - (eval_s - cursor.eval_s)
  while t < n + drain:
    done = _next_record(config, t, drain, n)
    end = done + drain
    bufs, outs = prog.advance(bufs, t, end, feed.x, feed.labels, n)
    t = end
    jax.block_until_ready(bufs)  # the training this record covers is done before the clock reads
    elapsed, e0 = clock(), time.perf_counter()
    losses = [loss for tick_, loss, _ in prog.losses(outs) if 0 <= tick_ - offset < n]
    state = prog.state(bufs)
    scalars = _scalars(config, run, state, done, losses)
    eval_s += time.perf_counter() - e0
    log.record(done, elapsed, **scalars)
    log.checkpoint(
      done, state, dataclasses.asdict(Loop(tick=t, time=clock(), eval_s=eval_s)), force=done == n
    )
  return bufs, clock()


def _setup(config, workdir: str | None = None):
  """Data, stages, optimizer and the method's (init_fn, step_fn), before any compile (with a workdir,
  the split the run first used: pipeline_inputs.split_stages)."""
  p = pipeline_inputs.build_pipeline(config, workdir)
  init_fn, step_fn = baselines.METHODS[config.method]
  if config.placement == "devices":  # validated: the method runs there
    step_fn = devices.STEPS[methods.get(config.method).step_in("devices")]
  state = init_fn(
    p.stages, p.optimizer, config, jax.random.key(config.seed), p.feed.sample, p.data["num_classes"]
  )
  run = {
    "num_batches": p.num_batches,
    "batches_per_epoch": p.batches_per_epoch,
    "feed": p.feed,
    "step": step_fn(p.stages, p.optimizer, config, p.num_batches),
    "evaluate": baselines.make_eval(p.stages),
    "optimizer": p.optimizer,
    "test": jax.device_put((p.data["x_test"], p.data["y_test"])),
  }
  if "x_val" in p.data:
    run["val"] = jax.device_put((p.data["x_val"], p.data["y_val"]))
  return p.stages, state, run


def run(config, workdir: str | None = None) -> dict:
  """The pipeline in this one process (placement=one_device, or devices: stage k on device k); the
  config was validated by run.train_and_evaluate."""
  workdir = make_workdir(workdir, config)
  stages, state, run = _setup(config, workdir)
  run["times"] = times = _model_times(config, stages, state, run["feed"].sample)
  if config.placement == "devices":  # after the stage timings, which run the stages on one device
    state = devices.place(state, devices.stage_devices(config.num_stages))
  prog = None
  if config.placement == "spmd":  # the state becomes the program's trees, stacked on the stage axis
    prog, state = program.build(stages, run["optimizer"], config, state, baselines.schedule_of(config))
  n = run["num_batches"]
  with RunLog(workdir, config, total_steps=n) as log:
    got = log.restore(state)
    cursor = Loop()
    if got is not None:
      _, state, saved = got
      cursor = Loop(**saved)
    if prog is None:
      state, seconds = _loop(log, config, run, state, cursor)
    else:
      bufs, seconds = _loop_program(log, config, run, prog, prog.place(state), cursor)
      state = prog.state(bufs)
    schedule = baselines.schedule_of(config)
    # A synthetic gradient's predictors are no kind of the tick's stored state: not counted.
    counted = methods.get(config.method).backward != methods.SYNTHETIC and "in_ring" in state[0]
    return log.finish(
      time=seconds,
      worker_steps=[n],
      method=config.method,
      num_stages=config.num_stages,
      mode=config.mode,
      delay=config.delay,
      epochs=config.num_epochs,
      num_batches=n,
      modeled_iteration=times["iteration"],
      modeled_speedup_vs_bp=times["speedup"],
      stage_forward_s=times["fwd_K"],
      stage_backward_s=times["bwd_K"],
      staleness=list(schedule.staleness) if schedule else None,
      stored_bytes=tick.stored_bytes(state) if counted else None,
      straggler=_straggler(config, times),
    )
