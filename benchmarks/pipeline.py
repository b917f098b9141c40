r"""Pipeline methods timed for real: single-process BP against every method in the multi-process runtime.

  python -m benchmarks.pipeline --num_stages=2 --json_out=results/pipeline/k2.json
  python -m benchmarks.pipeline --num_stages=4 --json_out=results/pipeline/k4.json
  python -m benchmarks.pipeline --num_stages=2 --slowdowns=2,4 --json_out=results/pipeline/k2_stragglers.json

One run of this script, on one model (CNN2D on CIFAR-shaped synthetic data, batch 64):
1. BP in one process (the whole model, one jitted step), timed pinned to one core and unpinned,
   interleaved; the faster is the reference (docs/design.md 4.5). It is timed again after the methods, and the
   spread of the two is printed: the machine is shared.
2. Every method in the runtime (pipeline/per_process.py), K processes through experiments.launch, one
   stage per core where there are cores: model-parallel BP, GPipe (M=4, remat), DDG, FR, DSP in its
   three modes (recompute, fused, residuals). Measured iteration = the steady tick spacing of the
   slowest stage (evaluation outside the clock).
3. The timing model (timing.runtime_iteration) fed with each run's own measured call and transfer
   times; its prediction against the measured iteration, with the error.
4. --slowdowns: the last stage padded to s x its compute for DSP, GPipe and model-parallel BP, and
   single-process BP padded by (s - 1) x that stage's measured compute (from the model-parallel run).

Writes {"<method>": {"measured_speedup_vs_bp": x, "modeled_speedup_vs_bp": y, ...}, "_bp": {...}}.
"""

import copy
import io
import json
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from configs import dsp as dsp_config
from ripples_jax.distributed.host import pin_threads
from ripples_jax.distributed.launcher import launch
from ripples_jax.optim import make_optimizer
from ripples_jax.pipeline import timing
from ripples_jax.pipeline import train as pipeline_train

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (method, mode, chunks). chunks: the residual calls over that many chunks of the batch (the
# micro-batch effect GPipe gets, given to DSP; BP gets it in `time_bp_accumulated`).
VARIANTS = {
  "bp_model_parallel": ("bp", "recompute", 1),
  "gpipe": ("gpipe", "recompute", 1),
  "ddg": ("ddg", "recompute", 1),
  "fr": ("fr", "recompute", 1),
  "dsp": ("dsp", "recompute", 1),
  "dsp_fused": ("dsp", "fused", 1),
  "dsp_residuals": ("dsp", "residuals", 1),
  "dsp_residuals_chunks4": ("dsp", "residuals", 4),
}
STRAGGLER_VARIANTS = ("bp_model_parallel", "gpipe", "dsp", "dsp_residuals")


def define_flags() -> None:
  flags.DEFINE_integer("num_stages", 2, "K: stages, one process each.")
  flags.DEFINE_list("variants", list(VARIANTS), "Methods (and DSP modes) to run in the runtime.")
  flags.DEFINE_list("slowdowns", [], "Straggler factors s for the last stage (e.g. 2,4); none by default.")
  flags.DEFINE_integer("iterations", 60, "Batches per runtime run.")
  flags.DEFINE_integer("bp_reps", 20, "Timed single-process BP steps per affinity, each time BP is timed.")
  flags.DEFINE_string("model", "cnn2d", "Model (split into K stages).")
  flags.DEFINE_list(
    "input_shape", ["32", "32", "3"], "The synthetic examples' shape (CIFAR-shaped by default)."
  )
  flags.DEFINE_bool("pin_cores", True, "Pin stage k to core k mod the cores (runtime.pin_cores).")
  flags.DEFINE_string("json_out", None, "Where the JSON goes.")


def bench_config(K: int, model: str, iterations: int, input_shape=(32, 32, 3), method="bp", mode="recompute"):
  c = dsp_config.get_config(
    f"method={method},num_stages={K},mode={mode},dataset=synthetic,model={model},epochs=1"
  )
  c.synthetic.update(
    input_shape=tuple(input_shape), num_classes=10, num_train=c.batch_size * iterations, num_test=c.batch_size
  )
  c.log_every = c.eval_every = iterations  # one record, one evaluation: at the end, outside the clock
  c.checkpoint_every = 0
  c.optimizer.lr = 0.01
  return c


def time_bp(config, reps: int) -> dict:
  """Median seconds of one single-process BP step, pinned to one core and on every core, interleaved."""
  stages, state, run = pipeline_train._setup(config)
  feed, step = run["feed"], run["step"]
  x, y = feed.x(0), feed.labels(0)
  every = sorted(os.sched_getaffinity(0))
  for _ in range(3):  # compile, warm
    state, (loss, _) = step(state, x, y, 0)
  float(loss)
  times = {"pinned": [], "unpinned": []}
  for _ in range(reps):
    for kind, cores in (("pinned", {every[0]}), ("unpinned", set(every))):
      pin_threads(cores)
      t0 = time.perf_counter()
      state, (loss, _) = step(state, x, y, 0)
      float(loss)
      times[kind].append(time.perf_counter() - t0)
  pin_threads(set(every))
  return {k: float(np.median(v)) for k, v in times.items()}


def time_bp_accumulated(config, reps: int) -> float:
  """Median seconds of single-process BP over the batch as M micro-batches (gradients accumulated, one
  update: GPipe's numerics without the pipeline), on every core: what micro-batching alone is worth."""
  import jax.numpy as jnp
  import optax

  from ripples_jax.pipeline import baselines

  stages, state, run = pipeline_train._setup(config)
  M, opt = config.microbatches, make_optimizer(config.optimizer, run["num_batches"])

  def loss_fn(params_K, ms_K, x, y):
    logits, _ = baselines.compose(stages, params_K, ms_K, x, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grad = jax.jit(jax.grad(loss_fn))
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
  update = jax.jit(
    lambda state, g: baselines.update_stages(
      opt, state, jax.tree.map(lambda a: a / M, g), [st["model_state"] for st in state]
    )
  )
  x, y = run["feed"].x(0), run["feed"].labels(0)
  xs, ys = np.split(np.asarray(x), M), np.split(np.asarray(y), M)

  def step(state):
    p, ms = [st["params"] for st in state], [st["model_state"] for st in state]
    g = None
    for xm, ym in zip(xs, ys):
      gm = grad(p, ms, xm, ym)
      g = gm if g is None else add(g, gm)
    return jax.block_until_ready(update(state, g))

  for _ in range(3):
    state = step(state)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state = step(state)
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def time_bp_padded(config, reps: int, pad_s: float) -> float:
  """Single-process BP with one stage's compute padded: a step, then a sleep of pad_s."""
  stages, state, run = pipeline_train._setup(config)
  x, y = run["feed"].x(0), run["feed"].labels(0)
  for _ in range(3):
    state, (loss, _) = run["step"](state, x, y, 0)
  float(loss)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, (loss, _) = run["step"](state, x, y, 0)
    float(loss)
    time.sleep(pad_s)
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


PASSED = (
  "placement",
  "chunks",
  "runtime.pin_cores",
  "log_every",
  "eval_every",
  "checkpoint_every",
  "optimizer.lr",
  "straggler_stage",
  "slowdown",
  "straggler_p",
  "delay",
  "runtime.slack",
  "synthetic.num_classes",
  "synthetic.num_train",
  "synthetic.num_test",
)


def run_variant(config, workdir: str) -> dict:
  """One launch of K stage processes with `config` (the keys that differ from configs/dsp.py are
  passed as flags); the lead's summary.json."""
  K = config.num_stages
  args = [
    f"--config=configs/dsp.py:method={config.method},num_stages={K},mode={config.mode},"
    f"dataset={config.dataset},model={config.model},epochs={config.num_epochs}",
    f"--workdir={workdir}",
    "--config.synthetic.input_shape=(" + ",".join(map(str, config.synthetic.input_shape)) + ")",
  ]
  for key in PASSED:
    node = config
    for part in key.split("."):
      node = node[part]
    args.append(f"--config.{key}={node}")
  out = io.StringIO()
  code = launch(K, args, module="experiments.train_dsp", out=out, cwd=ROOT, grace_s=10)
  if code != 0:
    raise RuntimeError(f"{config.method}/{config.mode} K={K} failed ({code}):\n{out.getvalue()[-3000:]}")
  return json.load(open(os.path.join(workdir, "summary.json")))


def row(name: str, summary: dict, bp_s: float, modeled_bp_s: float) -> dict:
  method = VARIANTS[name][0]
  measured = summary["iteration_s"]
  modeled = timing.runtime_iteration(method, summary["stages"], microbatches=4)
  return {
    "method": method,
    "mode": summary["mode"],
    "measured_iteration_s": measured,
    "modeled_iteration_s": modeled,
    "model_error": modeled / measured - 1,
    "measured_speedup_vs_bp": bp_s / measured,
    "modeled_speedup_vs_bp": modeled_bp_s / modeled,
    "stored_bytes": [s["stored_bytes"] for s in summary["stages"]],
    "xla_memory": [s.get("xla_memory") for s in summary["stages"]],
    "median_call_s": [s["median_s"] for s in summary["stages"]],
    "transfer_s": [s["transfer_s"] for s in summary["stages"]],
  }


def main(argv):
  del argv
  K, names = FLAGS.num_stages, FLAGS.variants
  base = bench_config(K, FLAGS.model, FLAGS.iterations, tuple(int(d) for d in FLAGS.input_shape))
  base.runtime.pin_cores = FLAGS.pin_cores
  tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
  bp_before = time_bp(base, FLAGS.bp_reps)
  summaries = {}
  for name in names:
    method, mode, chunks = VARIANTS[name]
    c = copy.deepcopy(base)
    c.method, c.mode, c.placement, c.chunks = method, mode, "per_process", chunks
    summaries[name] = run_variant(c, os.path.join(tmp, name))
    print(f"{name}: measured iteration {1e3 * summaries[name]['iteration_s']:.1f} ms", flush=True)
  bp_after = time_bp(base, FLAGS.bp_reps)
  bp_s = min(
    np.median([bp_before["pinned"], bp_after["pinned"]]),
    np.median([bp_before["unpinned"], bp_after["unpinned"]]),
  )
  # The model's single-process BP: every stage's forward and backward without transfers, from the
  # model-parallel BP run (its calls are BP's: residuals, no recompute).
  mp = summaries.get("bp_model_parallel")
  modeled_bp_s = (
    sum(s["median_s"]["forward"] + s["median_s"]["backward"] for s in mp["stages"]) if mp else float("nan")
  )
  accumulated = time_bp_accumulated(base, FLAGS.bp_reps)
  out = {
    "_bp": {
      "before": bp_before,
      "after": bp_after,
      "reference_s": float(bp_s),
      "accumulated_s": accumulated,
      "microbatches": base.microbatches,
      "modeled_s": modeled_bp_s,
      "num_stages": K,
      "model": FLAGS.model,
      "cores": len(os.sched_getaffinity(0)),
      "iterations": FLAGS.iterations,
    }
  }
  for name in names:
    out[name] = row(name, summaries[name], bp_s, modeled_bp_s)
  if FLAGS.slowdowns:
    out["_stragglers"] = stragglers(base, summaries, [float(s) for s in FLAGS.slowdowns], tmp)
  shutil.rmtree(tmp, ignore_errors=True)
  print_table(out)
  if FLAGS.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


def stragglers(base, summaries: dict, slowdowns: list, tmp: str) -> dict:
  """The last stage padded to s x its compute: measured iteration per method, and single-process BP
  padded by (s - 1) x that stage's compute in the model-parallel run."""
  K = base.num_stages
  last = summaries["bp_model_parallel"]["stages"][K - 1]["median_s"]
  share = last.get("forward", 0.0) + last.get("backward", 0.0)
  rows = {}
  for s in slowdowns:
    bp_padded = time_bp_padded(base, FLAGS.bp_reps, (s - 1) * share)
    r = {"bp_single_process": bp_padded}
    for name in STRAGGLER_VARIANTS:
      method, mode, chunks = VARIANTS[name]
      c = copy.deepcopy(base)
      c.method, c.mode, c.placement, c.chunks = method, mode, "per_process", chunks
      c.straggler_stage, c.slowdown = K - 1, s
      r[name] = run_variant(c, os.path.join(tmp, f"{name}_s{s}"))["iteration_s"]
    rows[str(s)] = {"iteration_s": r, "speedup_vs_bp": {k: bp_padded / v for k, v in r.items()}}
    print(f"s={s}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in r.items()), flush=True)
  return rows


def memory_rows(out: dict) -> list[str]:
  """Markdown rows: per method and stage, the KiB it keeps by kind (read from its live state) and
  XLA's compiled memory analysis (temporaries, arguments) of its largest program."""
  rows = [
    "| method | stage | params | inputs | param versions | residuals | FIFOs | micro-batch boundaries | "
    "optimizer | XLA temp (largest program) | XLA arguments |",
    "|" + " --- |" * 11,
  ]
  mb = lambda b: f"{b / 2**10:.0f}"
  for name, r in out.items():
    if name.startswith("_"):
      continue
    for k, (b, xla) in enumerate(zip(r["stored_bytes"], r["xla_memory"])):
      progs = [m for m in (xla or {}).values() if m]
      big = max(progs, key=lambda m: m["temp_size_in_bytes"]) if progs else None
      rows.append(
        f"| {name} | {k} | {mb(b['params'])} | {mb(b['inputs'])} | {mb(b['param_versions'])} | "
        f"{mb(b['residuals'])} | {mb(b['fifos'])} | {mb(b['micro_boundaries'])} | {mb(b['optimizer'])} | "
        + (f"{mb(big['temp_size_in_bytes'])} | {mb(big['argument_size_in_bytes'])} |" if big else "- | - |")
      )
  return rows


def print_table(out: dict) -> None:
  bp = out["_bp"]
  print(
    f"single-process BP: pinned {1e3 * bp['before']['pinned']:.1f}/{1e3 * bp['after']['pinned']:.1f} ms, "
    f"unpinned {1e3 * bp['before']['unpinned']:.1f}/{1e3 * bp['after']['unpinned']:.1f} ms "
    f"(before/after); reference {1e3 * bp['reference_s']:.1f} ms; K={bp['num_stages']}; "
    f"BP over {bp['microbatches']} accumulated micro-batches {1e3 * bp['accumulated_s']:.1f} ms"
  )
  print(
    "| method | mode | measured ms | modeled ms | model error | measured speedup vs BP | "
    "modeled speedup vs BP |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for name, r in out.items():
    if name.startswith("_"):
      continue
    print(
      f"| {name} | {r['mode']} | {1e3 * r['measured_iteration_s']:.1f} "
      f"| {1e3 * r['modeled_iteration_s']:.1f} | {100 * r['model_error']:+.1f}% "
      f"| {r['measured_speedup_vs_bp']:.2f} | {r['modeled_speedup_vs_bp']:.2f} |"
    )
  print("KiB per stage:")
  print("\n".join(memory_rows(out)))


if __name__ == "__main__":
  define_flags()
  jax.config.update("jax_platforms", "cpu")
  app.run(main)
