r"""placement=spmd timed as a user runs it: every row a fresh process, the rows alternated and repeated.

  python -m benchmarks.pipeline --placement=spmd --num_stages=2 --model=rescnn \
      --json_out=results/pipeline_spmd/rescnn_k2.json

Rows (each a process of its own, never pinned; the stages of a pipeline on K forced CPU devices):
  bp       single-device BP: one jitted whole-batch step (baselines.make_bp_step) in a process with
           one device, as a user with one device runs it
  dp_bp    data-parallel BP on the K devices: one jitted shard_map step, each device the gradient of
           its 1/K of the same global batch, the gradients pmean'd, the same update everywhere
  <method> the pipeline as one program (pipeline/program.py): dsp, pipedream, pipemare, fr, ddg (the
           tick methods), gpipe, 1f1b, zbh1 (flush methods, --microbatches each step)
  devices:<method>  a tick method with placement=devices (pipeline/devices.py: a program per stage a
           tick, stage k on device k), in a fresh process like every row
A child runs --warmup dispatches (the compile among them), then times --dispatches dispatches of
--per_dispatch ticks (or steps) each; its figure is seconds per batch, the dispatch boundaries' skew
included. One round runs every row once, in an order rotated each round; --rounds rounds. A row's
ratio in a round is the best baseline of that round (the faster of bp and dp_bp) over the row's time
(> 1: faster than what the user would otherwise run); the table gives each row's median and range.

The bp child also records the split (each stage's layers and parameter count) and each stage's
forward and backward time on one device (timing.measure_stage_times): the unit costs the split was
made from and the ceiling, sum over stages / max over stages, are in the JSON.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK_ROWS = ("dsp", "pipedream", "pipemare", "fr", "ddg")
FLUSH_ROWS = ("gpipe", "1f1b", "zbh1")
ROWS = ("bp", "dp_bp") + TICK_ROWS + FLUSH_ROWS


# ----------------------------------------------------------------------------------------------------
# The child: one row in this process.


def _setup(spec):
  import optax

  from ripples_jax.models import split

  shape = tuple(spec["input_shape"])
  kw = {"hidden": tuple(spec["hidden"])} if spec.get("hidden") else {}
  stages = split.split_model(spec["model"], 10, spec["num_stages"], sample_shape=shape, **kw)
  rng = np.random.default_rng(0)
  batches = [
    (
      rng.normal(size=(spec["batch"],) + shape).astype(np.float32),
      rng.integers(0, 10, spec["batch"]).astype(np.int32),
    )
    for _ in range(4)
  ]
  return stages, optax.sgd(0.01, momentum=0.9), batches


def _time(step, n_warm: int, n_timed: int) -> float:
  for _ in range(n_warm):
    step()
  t0 = time.perf_counter()
  for _ in range(n_timed):
    step()
  return (time.perf_counter() - t0) / n_timed


def _child_bp(spec, stages, opt, batches):
  import jax

  from ripples_jax.pipeline import baselines, timing
  from ripples_jax.pipeline import tick as tick_lib

  init = tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", len(stages)), jax.random.key(0), batches[0][0]
  )
  step, box = baselines.make_bp_step(stages, opt), {"state": init, "i": 0}

  def one():
    x, y = batches[box["i"] % len(batches)]
    box["state"], (loss, _) = step(box["state"], x, y)
    box["i"] += 1
    jax.block_until_ready(loss)

  n = spec["dispatches"] * spec["per_dispatch"]
  out = {"s_per_batch": _time(one, 3 * spec["warmup"], n)}
  fresh = tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", len(stages)), jax.random.key(0), batches[0][0]
  )
  fwd, bwd = timing.measure_stage_times(stages, fresh, batches[0][0])
  out["stage_forward_s"], out["stage_backward_s"] = list(map(float, fwd)), list(map(float, bwd))
  work = np.add(fwd, bwd)
  out["ceiling"] = float(work.sum() / work.max())
  out["split"] = [
    {
      "layers": [getattr(u, "name", str(u)) for u in getattr(s, "units", [])],
      "params": int(sum(a.size for a in jax.tree.leaves(st["params"]))),
    }
    for s, st in zip(stages, fresh)
  ]
  return out


def _child_dp(spec, stages, opt, batches):
  import jax
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from ripples_jax import losses
  from ripples_jax.pipeline import baselines
  from ripples_jax.pipeline import tick as tick_lib

  K = spec["num_stages"]
  mesh = Mesh(np.array(jax.devices()[:K]), ("data",))
  init = tick_lib.init_pipeline(
    stages, opt, tick_lib.method_schedule("bp", K), jax.random.key(0), batches[0][0]
  )
  params = [st["params"] for st in init]
  ms = [st["model_state"] for st in init]
  opt_state = opt.init(params)

  def loss_fn(p, x, y):
    logits, _ = baselines.compose(stages, p, ms, x, train=True)
    return losses.cross_entropy(logits, y)

  def per_device(p, o, x, y):
    g = jax.grad(loss_fn)(p, x, y)
    g = jax.lax.pmean(g, "data")  # the data-parallel all-reduce: every device the global batch's gradient
    updates, o = opt.update(g, o, p)
    return optax.apply_updates(p, updates), o

  step = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()), check_vma=False
    ),
    donate_argnums=(0, 1),
  )
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  box = {"p": jax.device_put(params, rep), "o": jax.device_put(opt_state, rep), "i": 0}

  def one():
    x, y = batches[box["i"] % len(batches)]
    box["p"], box["o"] = step(box["p"], box["o"], jax.device_put(x, data), jax.device_put(y, data))
    box["i"] += 1
    jax.block_until_ready(box["p"])

  return {"s_per_batch": _time(one, 3 * spec["warmup"], spec["dispatches"] * spec["per_dispatch"])}


def _child_program(spec, stages, opt, batches):
  import jax

  from ripples_jax.pipeline import program
  from ripples_jax.pipeline import tick as tick_lib

  method, K, n = spec["row"], spec["num_stages"], spec["per_dispatch"]
  x_of = lambda t: batches[t % len(batches)][0]
  labels_of = lambda i: batches[max(i, 0) % len(batches)][1]
  if method in TICK_ROWS:
    schedule = tick_lib.method_schedule(method, K, 1, "recompute")
    init = tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), batches[0][0])
    trees = program.spmd_state(init, program.timetable(schedule))
    prog = program.Program(stages, opt, schedule, trees, jax.devices(), ticks=n)
  else:
    init = tick_lib.init_pipeline(
      stages, opt, tick_lib.method_schedule("bp", K), jax.random.key(0), batches[0][0]
    )
    prog = program.FlushProgram(stages, opt, method, init, jax.devices(), spec["microbatches"], steps=n)
    trees = prog.initial
  box = {"bufs": prog.place(trees), "t": 0}
  total = n * (spec["warmup"] + spec["dispatches"]) + 10

  def one():
    box["bufs"], _ = prog.advance(box["bufs"], box["t"], box["t"] + n, x_of, labels_of, total)
    box["t"] += n
    jax.block_until_ready(box["bufs"])

  out = {"s_per_batch": _time(one, spec["warmup"], spec["dispatches"]) / n}
  table = prog.table
  out["units_per_dispatch"] = int(table.units(n) if hasattr(table, "period") else n * table.units)
  return out


def _child_devices(spec, stages, opt, batches):
  """devices:<method>: placement=devices (pipeline/devices.py: a program per stage a tick, stage k on
  device k, dispatched asynchronously), its ticks timed like the program's dispatches."""
  import jax

  from ripples_jax.pipeline import devices
  from ripples_jax.pipeline import tick as tick_lib

  method, K = spec["row"].split(":", 1)[1], spec["num_stages"]
  schedule = tick_lib.method_schedule(method, K, 1, "recompute")
  devs = devices.stage_devices(K)
  make = devices.make_fused_device_tick if devices.fusable(schedule) else devices.make_device_tick
  total = spec["per_dispatch"] * (spec["warmup"] + spec["dispatches"]) + 10
  step = make(stages, opt, schedule, total, devs)
  init = tick_lib.init_pipeline(stages, opt, schedule, jax.random.key(0), batches[0][0])
  box, off = {"state": devices.place(init, devs), "t": 0}, schedule.offsets[-1]

  def one():
    for _ in range(spec["per_dispatch"]):
      t = box["t"]
      x, y = batches[t % len(batches)][0], batches[max(t - off, 0) % len(batches)][1]
      box["state"], _ = step(box["state"], x, y, t)
      box["t"] += 1
    jax.block_until_ready(box["state"])

  return {"s_per_batch": _time(one, spec["warmup"], spec["dispatches"]) / spec["per_dispatch"]}


def child(spec: dict) -> dict:
  import jax

  assert len(jax.devices()) >= (1 if spec["row"] == "bp" else spec["num_stages"]), jax.devices()
  stages, opt, batches = _setup(spec)
  run = {"bp": _child_bp, "dp_bp": _child_dp}.get(spec["row"], _child_program)
  if spec["row"].startswith("devices:"):
    run = _child_devices
  return dict(run(spec, stages, opt, batches), row=spec["row"], devices=len(jax.devices()))


# ----------------------------------------------------------------------------------------------------
# The parent: fresh processes, alternated.


def run_row(spec: dict) -> dict:
  """One row in a fresh process, nothing pinned: K forced CPU devices (one for bp), or with
  spec["platform"] == "gpu" the first K GPUs (one for bp)."""
  env = dict(os.environ)
  devices = 1 if spec["row"] == "bp" else spec["num_stages"]
  if spec.get("platform", "cpu") == "gpu":
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
  else:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
    [sys.executable, "-m", "benchmarks.pipeline_spmd", json.dumps(spec)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  if out.returncode != 0:
    raise RuntimeError(f"row {spec['row']} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def measure(base: dict, rows, rounds: int, log=print) -> dict:
  """Every row once a round in a rotated order, `rounds` rounds; per row its seconds per batch over
  the rounds and its paired ratio against each round's best baseline."""
  from benchmarks.timing import spread

  rows = list(rows)
  got = {r: [] for r in rows}
  extra = {}
  for i in range(rounds):
    for row in rows[i % len(rows) :] + rows[: i % len(rows)]:
      res = run_row(dict(base, row=row))
      got[row].append(res["s_per_batch"])
      extra.setdefault(row, {k: v for k, v in res.items() if k not in ("s_per_batch", "row")})
      log(f"round {i} {row}: {1e3 * res['s_per_batch']:.2f} ms/batch")
  best = [min(got[b][i] for b in ("bp", "dp_bp") if b in got) for i in range(rounds)]
  out = {"config": base, "rounds": rounds, "rows": {}}
  for row in rows:
    s = got[row]
    out["rows"][row] = {
      "s_per_batch": spread(s),
      "runs": s,
      "vs_best_baseline": spread([b / t for b, t in zip(best, s)]),
      **extra[row],
    }
  if "zbh1" in got:
    for row in rows:
      out["rows"][row]["vs_zbh1"] = spread([z / t for z, t in zip(got["zbh1"], got[row])])
  return out


def markdown(out: dict) -> str:
  """The table: each row's ms per batch, its ratio to the best baseline and to ZB-H1."""
  from benchmarks.timing import fmt_spread

  lines = [
    "| row | ms per batch | vs best of BP, DP-BP (x) | vs ZB-H1 (x) |",
    "|---|---|---|---|",
  ]
  for row, r in out["rows"].items():
    z = fmt_spread(r["vs_zbh1"]) if "vs_zbh1" in r else "-"
    lines.append(
      f"| {row} | {fmt_spread(r['s_per_batch'], 1e3)} | {fmt_spread(r['vs_best_baseline'])} | {z} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  print(json.dumps(child(json.loads(sys.argv[1]))))
