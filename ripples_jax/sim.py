"""executor=sim: schedule + timeline + engine. Exact numerics, virtual time, deterministic under a seed.

The clock (timeline.simulate) runs first and alone: with the speeds and the network model it decides
every event of the run. The events are packed into rounds and executed in order on stacked per-worker
state; metrics carry the virtual time of the round that produced them.
"""
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from ripples_jax import checkpoint
from ripples_jax import data as data_lib
from ripples_jax import engine
from ripples_jax import metrics as metrics_lib
from ripples_jax import timeline
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.models import build_model, num_params
from ripples_jax.optim import make_optimizer
from ripples_jax.progress import Progress
from ripples_jax.schedule import group_gen, static_layouts


def make_group_generator(config, rng: np.random.Generator):
  """The Group Generator of a ripples_* algorithm (None for the baselines)."""
  n, s = config.num_workers, config.schedule
  if config.algorithm == "ripples_static":
    return group_gen.static_gg(static_layouts(config))
  if config.algorithm == "ripples_random":
    return group_gen.random_gg(n, s.group_size, rng)
  if config.algorithm == "ripples_division":
    return group_gen.division_gg(n, s.group_size, rng)
  if config.algorithm == "ripples_smart":
    return group_gen.smart_gg(n, s.group_size, s.smart_tolerance, s.smart_max_gap)
  return None


def measure_step_time(model, optimizer, sample_x, sample_y, reps: int = 20) -> float:
  """Median seconds of one worker's real jitted step (gradient + update) on one device."""
  state = engine.init_state(model, optimizer, jax.random.key(0), sample_x[:1], 1,
                            make_worker_mesh(1))
  fn = engine.make_round_fn(model, optimizer, make_worker_mesh(1), (((0,),),), "segment")
  x, y, mask = sample_x[None], sample_y[None], np.ones(1, bool)
  state, loss = fn(state, x, y, mask, 0)
  loss.block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    state, loss = fn(state, x, y, mask, 0)
    loss.block_until_ready()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def build_clock(config, model_bytes: float, base_time: float):
  hetero, tl = config.hetero, config.timeline
  speed = timeline.SpeedModel(base_time, config.num_workers, tuple(hetero.slow_workers),
                              float(hetero.slowdown), float(hetero.random_p), float(hetero.jitter),
                              config.seed)
  net = timeline.Network(model_bytes, tl.alpha, tl.bandwidth, tl.ps_bandwidth)
  return speed, net


def simulate_and_train(config, workdir: str) -> dict:
  """Runs the clock, then the numerics, writing the same outputs as the lockstep executor."""
  n = config.num_workers
  os.makedirs(workdir, exist_ok=True)
  data = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed)
  shards = data_lib.shard_indices(data["y_train"], n, config.data_sharding, seed=config.seed)
  model = build_model(config.model, data["num_classes"])
  if config.algorithm == "ps_async":
    # The server applies every worker's gradient on its own: n updates where synchronous data parallel
    # makes one with the mean gradient. Scale the step (and the schedule's horizon) by n to match.
    opt = config.optimizer.to_dict()
    opt["lr"] /= n
    opt["warmup_steps"] *= n
    optimizer = make_optimizer(ml_collections.ConfigDict(opt), config.num_steps * n)
  else:
    optimizer = make_optimizer(config.optimizer, config.num_steps)

  has_server = config.algorithm == "ps_async"
  slots = n + has_server  # the parameter server is one more slot
  # All slots on one device: the rounds are many and small, and their cross-slot gathers would be
  # collectives between CPU device threads, which starve (rendezvous timeouts) when thousands of tiny
  # rounds are queued on 2 cores. The numerics do not depend on placement.
  mesh = make_worker_mesh(slots, jax.devices()[:1])
  state = engine.init_sim_state(model, optimizer, jax.random.key(config.seed), data["x_train"][:1],
                                slots, mesh)
  model_bytes = config.timeline.model_bytes or 4 * num_params(
      jax.tree.map(lambda a: a[0], state["params"]))
  base_time = config.timeline.compute_time or measure_step_time(
      model, optimizer, data["x_train"][:config.batch_size], data["y_train"][:config.batch_size])
  speed, net = build_clock(config, model_bytes, base_time)
  gg = make_group_generator(config, np.random.default_rng([4, config.seed]))

  t_clock = time.time()
  trace = timeline.simulate(config.algorithm, speed, net, config.num_steps * n, config.time_budget, gg,
                            config.seed)
  logging.info("%s clock: %d events, %.1f virtual s, %.2f wall s; %d workers x %.4f s base step, "
               "%.0f model bytes", config.algorithm, len(trace.events), trace.end_time,
               time.time() - t_clock, n, base_time, model_bytes)

  round_fn = engine.make_sim_round_fn(model, optimizer, mesh, n, slots, cross_apply=has_server,
                                      ring=config.algorithm == "dpsgd", pull=has_server,
                                      start_capacity=1 if has_server else None)
  eval_fn = engine.make_eval_fn(model)
  x_test, y_test = jax.device_put((data["x_test"], data["y_test"]))
  sharding = engine.worker_sharding(mesh)
  eval_slots = slice(n, n + 1) if has_server else slice(0, n)  # PS: the server's model is the model

  # Resume: the clock is deterministic, so it is simply run again; the rounds the checkpoint had
  # executed are skipped and the engine state and loop counters restored.
  ckpt = checkpoint.Checkpointer(workdir, config.checkpoint_every, config.checkpoint_keep)
  got = ckpt.restore(state)
  total = config.num_steps * n
  progress = Progress(config.num_steps, config.log_every)
  starts = np.zeros(n, np.int64)
  applied, first_round = 0, 0
  losses = []
  last, time_to_target = {}, None
  next_log, next_eval = config.log_every, config.eval_every
  evaluated_step = None
  if got is not None:
    _, state, meta = got
    starts, applied, first_round = np.array(meta["starts"]), meta["applied"], meta["round"]
    next_log, next_eval, evaluated_step = meta["next_log"], meta["next_eval"], meta["evaluated_step"]
    last, time_to_target = meta["last"], meta["time_to_target"]
  next_ckpt = (applied // n // config.checkpoint_every + 1) * config.checkpoint_every \
      if config.checkpoint_every else None
  writer = metrics_lib.MetricWriter(workdir)
  x_zero = np.zeros((slots, config.batch_size) + data["x_train"].shape[1:], data["x_train"].dtype)
  y_zero = np.zeros((slots, config.batch_size), data["y_train"].dtype)
  try:
    for i, r in enumerate(timeline.pack_rounds(trace.events, n, slots)):
      if i < first_round:
        continue
      # A server round is apply -> pull -> start for one worker: the next push to the server ends it.
      assert not has_server or r["start"].sum() <= 1
      # Batches only for the workers that start (each at its own step); other rows are never read.
      x, y = x_zero.copy(), y_zero.copy()
      started = np.flatnonzero(r["start"][:n])
      if len(started):
        idx = data_lib.batch_indices([shards[w] for w in started], config.batch_size, config.seed,
                                     starts[started], workers=started)
        x[started], y[started] = data["x_train"][idx], data["y_train"][idx]
      put = lambda a: jax.device_put(a, sharding)
      state, loss_S = round_fn(state, put(x), put(y), put(r["apply_src"]), put(r["gid"]), r["ring"],
                               put(r["pull_src"]), put(r["start"]))
      if len(started):
        losses.append(loss_S)
      starts += r["start"][:n]
      applied += len(r["applied"])
      step = applied // n
      if step >= next_log or applied >= total:
        next_log = (step // config.log_every + 1) * config.log_every
        # The loss of the gradients started since the last record (a tail of apply-only rounds
        # started none: it repeats the last value rather than inventing one).
        loss = (float(np.nanmean(np.asarray(jax.numpy.stack(losses))[:, :n])) if losses
                else last["train_loss"])
        losses = []
        record = {"step": step, "time": r["time"], "train_loss": loss}
        if step >= next_eval or applied >= total:
          next_eval = (step // config.eval_every + 1) * config.eval_every
          evaluated_step = step
          sub = jax.tree.map(lambda a: a[eval_slots], state)
          record.update({k: float(v) for k, v in eval_fn(sub, x_test, y_test).items()})
          if (time_to_target is None and config.target_accuracy
              and record["test_accuracy"] >= config.target_accuracy):
            time_to_target = r["time"]
        writer.write(record)
        last.update(record)
        metrics_lib.check_finite(step, ckpt.describe_last(), train_loss=loss)
        if next_ckpt is not None and step >= next_ckpt:  # right after a record: no loss is pending
          next_ckpt = (step // config.checkpoint_every + 1) * config.checkpoint_every
          ckpt.save(step, state, {"round": i + 1, "starts": starts.tolist(), "applied": applied,
                                  "next_log": next_log, "next_eval": next_eval,
                                  "evaluated_step": evaluated_step, "last": last,
                                  "time_to_target": time_to_target}, force=True)
        progress.update(min(step, config.num_steps), **{k: last[k] for k in ("train_loss", "test_accuracy")
                                                         if k in last})
    if evaluated_step != applied // n:
      # A time budget ended the run between records: evaluate where it stopped.
      record = {"step": applied // n, "time": trace.end_time, "train_loss": last.get("train_loss")}
      record.update({k: float(v) for k, v in eval_fn(jax.tree.map(lambda a: a[eval_slots], state),
                                                     x_test, y_test).items()})
      writer.write(record)
      last.update(record)
  finally:
    writer.close()
    ckpt.close()

  split = trace.time_split()
  summary = {
      "algorithm": config.algorithm, "executor": "sim", "num_workers": n, "num_steps": config.num_steps,
      "final_test_accuracy": last.get("test_accuracy"), "final_train_loss": last.get("train_loss"),
      "final_consensus_distance": last.get("consensus_distance"),
      "time": trace.end_time, "throughput": float(trace.worker_steps.sum() / trace.end_time),
      "worker_steps": trace.worker_steps.tolist(), "conflicts": trace.conflicts.tolist(),
      "compute_time": split["compute"].tolist(), "wait_time": split["wait"].tolist(),
      "comm_time": split["comm"].tolist(), "base_step_time": base_time, "model_bytes": model_bytes,
      "time_to_target": time_to_target, "target_accuracy": config.target_accuracy, "workdir": workdir,
  }
  metrics_lib.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary, trace
