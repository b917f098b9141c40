r"""placement=devices: every tick method on the devices of this process against the best single-process
BP of the same run, each beside its ceiling (benchmarks.pipeline --placement=devices runs this).

  python -m benchmarks.pipeline --placement=devices --num_stages=2 --model=rescnn \
    --json_out=results/pipeline_devices/rescnn_k2.json

One process with K CPU devices (stage k on device k; on a GPU host, its GPUs), --reps repetitions,
each: the four BP variants of benchmarks/best_bp.py (time_bp_variants: pinned or not, whole batch or M
micro-batches), then every method a block of --ticks ticks after its warm-up, the methods' order
rotated each repetition. Per method:
- measured_speedup_vs_best_bp: best BP's step over the method's time per tick (one batch a tick in
  steady state), paired with that repetition's BP.
- ceiling_vs_best_bp: best BP over the method's ceiling (ceiling_s): each stage's forward and backward
  programs timed alone, with every core and with this process on one core; the ceiling is the larger
  of the slowest stage alone with every core (GPipe: its bubble too) and the stages' single-core work
  over the cores. It holds the split's imbalance and the method's extra work (a recompute, a stash)
  and leaves out transfers, dispatch and the stages contending for caches, memory bandwidth and XLA's
  pool. Beside it, one_core_per_stage: the same programs single-threaded on a core each (the
  per-process placement's model), which a run beats where one stage's program borrows the core the
  other leaves idle.
- gap: measured - ceiling in named parts, each measured on its own: `dispatch` (what a tick dispatches,
  devices.dispatches_per_tick, times one dispatch's measured cost), `transfers` (the links' copies
  between devices, each timed alone), `rest` (what neither explains: contention between the stages).
Variants name what differs from the method as published: `_chunks4` (the backward over 4 chunks),
`_delay2` (DSP's links of delay 2), `_no_donation` (the stage programs copy their state every tick).
"""

import os
import time

import jax
import numpy as np

from benchmarks.timing import fmt_spread, spread

# name: (method, mode, chunks, delay, donate)
VARIANTS = {
  "dsp": ("dsp", "recompute", 1, 1, True),
  "dsp_chunks4": ("dsp", "recompute", 4, 1, True),
  "dsp_delay2": ("dsp", "recompute", 1, 2, True),
  "dsp_no_donation": ("dsp", "recompute", 1, 1, False),
  "dsp_unfused": ("dsp", "recompute", 1, 1, True),
  "fr": ("fr", "recompute", 1, 1, True),
  "fr_chunks4": ("fr", "recompute", 4, 1, True),
  "pipemare": ("pipemare", "recompute", 1, 1, True),
  "pipedream": ("pipedream", "stash", 1, 1, True),
  "pipedream_chunks4": ("pipedream", "stash", 4, 1, True),
  "gpipe": ("gpipe", "recompute", 1, 1, True),
}
LABELS = {
  "dsp": "DSP as published (recompute)",
  "dsp_chunks4": "DSP, its recompute and backward over 4 chunks",
  "dsp_delay2": "DSP, links of delay 2",
  "dsp_no_donation": "DSP, stage state not donated (copied every tick)",
  "dsp_unfused": "DSP, a forward and a backward program per stage and a push per link (not fused)",
  "fr": "Features Replay (recompute)",
  "fr_chunks4": "Features Replay, backward over 4 chunks",
  "pipemare": "PipeMare (1F1B, no stashing, corrected backward)",
  "pipedream": "PipeDream-1F1B / DDG (weight stashing, recompute at the stashed weights)",
  "pipedream_chunks4": "PipeDream-1F1B, backward over 4 chunks",
  "gpipe": "GPipe, M micro-batches, remat, flush",
}
DEFAULT = ("dsp", "dsp_chunks4", "fr", "pipemare", "pipedream", "pipedream_chunks4", "gpipe")


def variant_config(base, name: str):
  method, mode, chunks, delay, _ = VARIANTS[name]
  c = base.copy_and_resolve_references()
  c.method, c.mode, c.chunks, c.delay, c.placement = method, mode, chunks, delay, "devices"
  return c


class Method:
  """One variant on the devices: its stages, placed state and tick, advanced a block at a time."""

  def __init__(self, base, name: str):
    from ripples_jax.config import validate_dsp_config
    from ripples_jax.pipeline import baselines, devices, methods
    from ripples_jax.pipeline import inputs as pipeline_inputs

    self.config = c = variant_config(base, name)
    validate_dsp_config(c)
    p = pipeline_inputs.build_pipeline(c)
    self.stages, self.optimizer, self.feed, self.n = p.stages, p.optimizer, p.feed, p.num_batches
    init_fn = baselines.METHODS[c.method][0]
    state = init_fn(p.stages, p.optimizer, c, jax.random.key(c.seed), p.feed.sample, p.data["num_classes"])
    self.schedule = baselines.schedule_of(c)
    self.devices = devices.stage_devices(c.num_stages)
    self.state = devices.place(state, self.devices)
    # A tick method's stage programs, else GPipe's (the one other method placement=devices runs).
    self.ticks = methods.get(c.method).runs_tick("devices")
    # DSP's schedule runs fused (one program per stage a tick), as the training loop runs it.
    self.fused = self.ticks and devices.fusable(self.schedule) and name != "dsp_unfused"
    if not self.ticks:
      self.tick = devices.make_device_gpipe(self.stages, self.optimizer, c.microbatches, self.devices)
    else:
      make = devices.make_fused_device_tick if self.fused else devices.make_device_tick
      args = (self.stages, self.optimizer, self.schedule, self.n, self.devices, VARIANTS[name][4])
      self.tick = make(*args)
    self.t = 0

  def advance(self, ticks: int) -> float:
    """Runs `ticks` ticks; returns the seconds per tick, the state ready at both ends."""
    jax.block_until_ready(self.state)
    t0 = time.perf_counter()
    for _ in range(ticks):
      b = self.t % self.n  # the data wraps; the warm-up is behind the first timed block
      self.state, _ = self.tick(self.state, self.feed.x(b), self.feed.labels(b), self.t)
      self.t += 1
    jax.block_until_ready(self.state)
    return (time.perf_counter() - t0) / ticks


def _timed(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _timed_both(fn, reps: int, core: int) -> tuple:
  """fn's median seconds with this process on one core, then with every core."""
  from ripples_jax.distributed.host import pin_threads

  every = set(os.sched_getaffinity(0))
  pin_threads({core})
  try:
    one = _timed(fn, reps)
  finally:
    pin_threads(every)
  return one, _timed(fn, reps)


def _costs(fwd: list, bwd: list) -> dict:
  """Lists of (one core, every core) seconds per stage as the cost keys."""
  return {
    "forward_s": [f[0] for f in fwd],
    "backward_s": [b[0] for b in bwd],
    "forward_all_s": [f[1] for f in fwd],
    "backward_all_s": [b[1] for b in bwd],
  }


def stage_costs(m: Method, reps: int, core: int) -> dict:
  """Each stage's forward and backward program timed alone, on one core and on every core, the
  links' copies timed alone, and one dispatch's cost; from fresh copies of the method's placed state."""
  from ripples_jax.pipeline import devices

  K, sch = len(m.stages), m.schedule
  devs = m.devices
  progs = [devices._stage_programs(m.stages[k], m.optimizer, sch, k, m.n) for k in range(K)]
  state = [jax.tree.map(lambda a: a.copy(), st) for st in m.state]
  t = sch.drain_ticks()  # every stage's backward batch in range: its update is applied
  x, y = m.feed.x(0), m.feed.labels(0)
  ins, outs = [jax.device_put(x, devs[0])], []
  for k in range(K):  # inputs of the right shapes and values: one pass up the stages
    state[k], out = progs[k][0](state[k], ins[k], t)
    outs.append(out)
    if k < K - 1:
      ins.append(jax.device_put(out, devs[k + 1]))
  labels = jax.device_put(y, devs[-1])
  cots = [None if k == K - 1 else jax.device_put(outs[k] * 1e-3, devs[k]) for k in range(K)]
  fwd, bwd = [], []
  for k in range(K):
    box = {"st": state[k]}

    def f(k=k, box=box):
      box["st"], out = progs[k][0](box["st"], ins[k], t)
      return box["st"]

    def b(k=k, box=box):
      box["st"], g, _ = progs[k][1](box["st"], cots[k], labels if k == K - 1 else None, t)
      return box["st"]

    for fn in (f, b, f, b):  # compile, warm
      jax.block_until_ready(fn())
    fwd.append(_timed_both(f, reps, core))
    bwd.append(_timed_both(b, reps, core))
  return {**_costs(fwd, bwd), **overhead_costs(devs, outs[:-1], reps, core)}


def overhead_costs(devs, boundary: list, reps: int, core: int, per_iteration: int = 1) -> dict:
  """The links' copies between devices (each boundary array up, and its error gradient, of the same
  shape, down; `per_iteration` of each a step) timed alone, and one dispatch's cost to the caller (a
  trivial program dispatched 200 times without waiting), this process on one core."""
  from ripples_jax.distributed.host import pin_threads

  every = set(os.sched_getaffinity(0))
  pin_threads({core})
  try:
    copies = []
    for k, a in enumerate(boundary):
      above = jax.block_until_ready(jax.device_put(a, devs[k + 1]))  # the gradient's shape, up there
      up = _timed(lambda: jax.device_put(a, devs[k + 1]), reps)
      down = _timed(lambda: jax.device_put(above, devs[k]), reps)
      copies += [per_iteration * up, per_iteration * down]
    small = jax.device_put(np.zeros(4, np.float32), devs[0])
    one = jax.jit(lambda a: a + 1)
    jax.block_until_ready(one(small))
    t0, calls = time.perf_counter(), 200
    for _ in range(calls):
      small = one(small)
    dispatch_s = (time.perf_counter() - t0) / calls  # asynchronous: the caller's time per dispatch
    jax.block_until_ready(small)
  finally:
    pin_threads(every)
  return {"copies_s": copies, "dispatch_s": dispatch_s}


def gpipe_costs(m: Method, reps: int, core: int) -> dict:
  """GPipe's per-micro-batch programs of each stage (forward; rematerialised backward; the last
  stage's loss and backward) timed alone on one core and on every core, as stage_costs does."""
  from ripples_jax.pipeline import gpipe

  K, M, devs = len(m.stages), m.config.microbatches, m.devices
  progs = [gpipe.stage_programs(m.stages[k], m.optimizer, k == 0, k == K - 1, M) for k in range(K)]
  x = np.split(np.asarray(m.feed.x(0)), M)[0]
  y = jax.device_put(np.split(np.asarray(m.feed.labels(0)), M)[0], devs[-1])
  fwd, bwd, outs, h = [], [], [], jax.device_put(x, devs[0])
  for k in range(K):
    p, ms = m.state[k]["params"], m.state[k]["model_state"]
    if k == K - 1:
      fn = lambda p=p, ms=ms, h=h: progs[k]["backward"](p, ms, h, y)
      jax.block_until_ready(fn())
      fwd.append((0.0, 0.0))  # the loss's forward is inside its backward program
      bwd.append(_timed_both(fn, reps, core))
      break
    out, _ = progs[k]["forward"](p, ms, h)
    outs.append(out)
    f = lambda p=p, ms=ms, h=h, k=k: progs[k]["forward"](p, ms, h)
    b = lambda p=p, ms=ms, h=h, k=k, c=out * 1e-3: progs[k]["backward"](p, ms, h, c)
    for fn in (f, b, f, b):
      jax.block_until_ready(fn())
    fwd.append(_timed_both(f, reps, core))
    bwd.append(_timed_both(b, reps, core))
    h = jax.device_put(out, devs[k + 1])
  overhead = overhead_costs(devs, outs, reps, core, per_iteration=M)
  return {**_costs(fwd, bwd), "microbatches": M, **overhead}


def ceiling_s(costs: dict, cores: int) -> float:
  """The method's fastest possible iteration from its stages' own programs, the larger of two bounds:
  no stage's tick runs faster than its programs do alone with every core (GPipe: M + K - 1
  micro-batch slots of its slowest stage a flush), and no tick does its stages' work faster than that
  work single-threaded spread over the cores (parallel execution adds work, it does not remove it).
  It holds the split's imbalance and the method's extra work (a recompute, a stash, the bubble); it
  leaves out transfers, dispatch and the stages contending for caches, memory bandwidth and XLA's
  pool. The single-core times are taken with XLA's pool pinned to one core, which may overstate a
  single thread's work: a run above the ceiling (fraction_of_ceiling > 1) shows where."""
  return _bound(costs, cores, "forward_all_s", "backward_all_s")


def one_core_per_stage_s(costs: dict, cores: int) -> float:
  """The iteration if each stage ran single-threaded on a core of its own (the per-process model):
  the most expensive stage, no less than all stages' work over the cores. A run beats it where a
  stage's program borrows the cores the other stage leaves idle (XLA's intra-op pool)."""
  return _bound(costs, cores, "forward_s", "backward_s")


def _bound(costs: dict, cores: int, forward: str, backward: str) -> float:
  """max(slots x the slowest stage's work (the `forward` + `backward` costs), the single-core work
  over the cores); slots: 1 a tick, M + K - 1 a GPipe flush of M micro-batches."""
  stage = [f + b for f, b in zip(costs[forward], costs[backward])]
  one = [f + b for f, b in zip(costs["forward_s"], costs["backward_s"])]
  M = costs.get("microbatches", 1)
  slots = M + len(stage) - 1 if "microbatches" in costs else 1
  return max(slots * max(stage), M * sum(one) / cores)


def row(name: str, per_tick: list, best_bp: list, costs: dict, schedule, cores: int, fused=False) -> dict:
  """One method's figures: the paired ratios over the repetitions and its ceiling's parts."""
  from ripples_jax.pipeline import devices

  its = np.asarray(per_tick)
  ceiling, one_core = ceiling_s(costs, cores), one_core_per_stage_s(costs, cores)
  measured = float(np.median(its))
  M = costs.get("microbatches")
  count = (
    devices.gpipe_dispatches(len(costs["forward_s"]), M)
    if M
    else devices.dispatches_per_tick(schedule, fused)
  )
  dispatch = count * costs["dispatch_s"]
  transfers = float(sum(costs["copies_s"]))
  work = [(M or 1) * (f + b) for f, b in zip(costs["forward_s"], costs["backward_s"])]
  return {
    "label": LABELS[name],
    "method": VARIANTS[name][0],
    "measured_tick_s": {**spread(its), "all": its.tolist()},
    "measured_speedup_vs_best_bp": spread(np.asarray(best_bp) / its),
    "ceiling_vs_best_bp": spread(np.asarray(best_bp) / ceiling),
    "fraction_of_ceiling": spread(ceiling / its),
    "ceiling_s": ceiling,
    "one_core_per_stage_s": one_core,
    "one_core_per_stage_vs_best_bp": spread(np.asarray(best_bp) / one_core),
    "stage_work_one_core_s": work,
    "imbalance": max(work) / (sum(work) / len(work)),
    **{f"stage_{k}": v for k, v in costs.items() if k.endswith("_s") and isinstance(v, list)},
    "gap_s": {
      "total": measured - ceiling,
      "dispatch": dispatch,
      "transfers": transfers,
      "rest": measured - ceiling - dispatch - transfers,
    },
    "dispatches_per_tick": count,
  }


def reprice(out: dict) -> dict:
  """The ceiling fields of every row of a stored result recomputed from its stored stage costs (for a
  result measured before a change of ceiling_s; the measurements are untouched)."""
  from ripples_jax.pipeline import methods

  cores = out["setting"]["cores"]
  bp = np.asarray(out["bp_variants_ms"][out["best_bp"]["variant"]]) / 1e3
  for r in out.values():
    if not isinstance(r, dict) or "label" not in r:
      continue
    costs = {k: r[f"stage_{k}"] for k in ("forward_s", "backward_s", "forward_all_s", "backward_all_s")}
    if methods.get(r["method"]).microbatched:  # its bound counts M + K - 1 micro-batch slots
      costs["microbatches"] = out["setting"]["microbatches"]
    its, ceiling = np.asarray(r["measured_tick_s"]["all"]), ceiling_s(costs, cores)
    gap = r["gap_s"]
    r.update(
      ceiling_s=ceiling, ceiling_vs_best_bp=spread(bp / ceiling), fraction_of_ceiling=spread(ceiling / its)
    )
    total = float(np.median(its)) - ceiling
    r["gap_s"] = dict(gap, total=total, rest=total - gap["dispatch"] - gap["transfers"])
  return out


def run(base, names, reps: int, ticks: int, bp_reps: int, cost_reps: int = 7) -> dict:
  """The whole benchmark (module doc): BP variants and every method interleaved, then the costs."""
  from benchmarks.best_bp import BP_VARIANTS, time_bp_variants

  methods = {name: Method(base, name) for name in names}
  for m in methods.values():
    m.advance(max(3, m.schedule.drain_ticks() + 2 if m.schedule else 3))  # compile, fill, warm
  bp_reps_out, per_tick = [], {name: [] for name in names}
  for rep in range(reps):
    bp_reps_out.append(time_bp_variants(base, bp_reps))
    for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotated
      per_tick[name].append(methods[name].advance(ticks))
    print(
      f"rep {rep}: "
      + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in bp_reps_out[-1].items())
      + " | "
      + ", ".join(f"{n} {1e3 * per_tick[n][-1]:.1f}" for n in names)
      + " ms",
      flush=True,
    )
  best = min(BP_VARIANTS, key=lambda v: np.median([r[v] for r in bp_reps_out]))
  best_bp = [r[best] for r in bp_reps_out]
  cores = len(os.sched_getaffinity(0))
  core = min(os.sched_getaffinity(0))
  out = {
    "best_bp": {"variant": best, "ms": spread(1e3 * np.asarray(best_bp))},
    "bp_variants_ms": {v: [1e3 * r[v] for r in bp_reps_out] for v in BP_VARIANTS},
    "setting": {
      "placement": "devices",
      "num_stages": base.num_stages,
      "model": base.model,
      "cores": cores,
      "reps": reps,
      "ticks": ticks,
      "batch_size": base.batch_size,
      "microbatches": base.microbatches,
      "platform": jax.default_backend(),
      "loadavg_start": os.getloadavg(),
    },
  }
  for name, m in methods.items():
    costs = (stage_costs if m.ticks else gpipe_costs)(m, cost_reps, core)
    out[name] = row(name, per_tick[name], best_bp, costs, m.schedule, cores, m.fused)
  out["setting"]["loadavg_end"] = os.getloadavg()
  # Each stage device's peak memory over the whole run, where the platform reports it (GPUs; the
  # CPU reports none).
  stats = {
    str(d): (d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()[: base.num_stages]
  }
  out["device_peak_bytes"] = stats
  return out


def print_table(out: dict) -> None:
  f = fmt_spread
  bp = out["best_bp"]
  print(f"best BP: {bp['variant']} {f(bp['ms'], spec='.1f')} ms")
  print(
    "| row | ms/tick | speedup vs best BP | ceiling vs best BP | of its ceiling | one core per stage vs "
    "best BP | imbalance | gap ms: dispatch / transfers / rest |"
  )
  print("|" + " --- |" * 8)
  for name, r in out.items():
    if not isinstance(r, dict) or "label" not in r:
      continue
    g = r["gap_s"]
    print(
      f"| {name} | {f(r['measured_tick_s'], 1e3, '.1f')} | {f(r['measured_speedup_vs_best_bp'])} "
      f"| {r['ceiling_vs_best_bp']['median']:.2f} | {f(r['fraction_of_ceiling'])} "
      f"| {r['one_core_per_stage_vs_best_bp']['median']:.2f} | {r['imbalance']:.2f} "
      f"| {1e3 * g['dispatch']:.1f} / {1e3 * g['transfers']:.1f} / {1e3 * g['rest']:.1f} |"
    )


# Process-wide settings, each measured on its own (--ablate): the environment a child process starts
# with. allocator: glibc keeps and reuses the programs' large temporaries (ripples_jax.allocator)
# instead of faulting fresh zeroed pages every call; threads: XLA:CPU's pools sized to the cores
# (NPROC) instead of host.cpu_pool_size's two per forced device plus one per core.
ABLATIONS = ("allocator", "threads")


def ablation_env(name: str) -> dict:
  from ripples_jax import allocator

  if name == "allocator":
    return allocator.env()
  if name == "threads":
    return dict(os.environ, NPROC=str(len(os.sched_getaffinity(0))))
  raise ValueError(f"--ablate: {name!r} is not one of {ABLATIONS}")


def ablate(child_args: list, names: list, settings: list, rounds: int, tmp: str) -> dict:
  """Each setting against the default, whole processes alternated `rounds` times (A B A B ...):
  per row, the median of the paired ratios setting / default of best BP's step and of the rows'
  time per tick. `child_args`: this benchmark's own flags, one repetition each."""
  import json
  import subprocess
  import sys

  def one(env, tag) -> dict:
    path = os.path.join(tmp, f"{tag}.json")
    cmd = [sys.executable, "-m", "benchmarks.pipeline", *child_args, f"--json_out={path}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.load(open(path))

  out = {}
  for setting in settings:
    pairs = []
    for i in range(rounds):
      order = [("default", dict(os.environ)), (setting, ablation_env(setting))]
      got = {tag: one(env, f"{setting}_{i}_{tag}") for tag, env in (order if i % 2 == 0 else order[::-1])}
      pairs.append(got)
    rows = {
      "best_bp": [
        p[setting]["best_bp"]["ms"]["median"] / p["default"]["best_bp"]["ms"]["median"] for p in pairs
      ]
    }
    for name in names:
      # devices: time per tick; per_process: time per iteration
      key = "measured_tick_s" if "measured_tick_s" in pairs[0]["default"][name] else "measured_iteration_s"
      rows[name] = [p[setting][name][key]["median"] / p["default"][name][key]["median"] for p in pairs]
    out[setting] = {k: {**spread(v), "all": v} for k, v in rows.items()}
    print(
      f"{setting} / default: " + ", ".join(f"{k} {v['median']:.3f}" for k, v in out[setting].items()),
      flush=True,
    )
  return out
