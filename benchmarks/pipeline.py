r"""Pipeline methods timed for real, every one against the best single-process BP of the same run.

  python -m benchmarks.pipeline --num_stages=2 --json_out=results/pipeline/k2.json
  python -m benchmarks.pipeline --num_stages=4 --reps=3 --json_out=results/pipeline/k4.json
  python -m benchmarks.pipeline --placement=devices --num_stages=2 --model=rescnn --json_out=FILE

--placement=devices: the stages on the devices of this one process instead (benchmarks/
pipeline_devices.py has what it measures: each tick method against best BP beside its ceiling).
--placement=spmd: every method as one program (pipeline/program.py), each row a fresh process, the
rows alternated --reps rounds, against single-device BP and data-parallel BP (benchmarks/
pipeline_spmd.py has what it measures).

One run of this script, on one model (CNN2D on CIFAR-shaped synthetic data, batch 64), --reps
repetitions (at least 5 by default), each a full alternation of everything below, the order of the
methods rotated each repetition so that drift on a shared machine lands on every row alike:
1. Single-process BP in four variants, interleaved step by step: pinned to one core or on every core,
   the whole batch or M accumulated micro-batches (GPipe's numerics without the pipeline). The fastest
   variant (median over the repetitions) is "best BP"; its time in each repetition is what that
   repetition's ratios are taken against (paired). `best_bp.unstable`: it varied by more than 10%.
2. Every method in the runtime (pipeline/per_process.py), K processes through experiments.launch, one
   stage per core: model-parallel BP, GPipe (M=4, remat), DDG, PipeDream-1F1B, PipeMare, FR, DSP as
   published (recompute), DSP fused, and weight stashing on DSP's schedule (mode=residuals; with its
   calls over 4 chunks too). Measured iteration = the slowest stage's steady tick spacing.
3. The ceiling: K single-core stages that split the fastest single-core BP evenly, without transfers:
   best BP / (fastest pinned BP / K); each method's speedup over it as `vs_ceiling`.
4. `tick_efficiency` (timing.tick_efficiency): the slowest stage's compute (median call x calls per
   iteration) and transfer over the measured iteration.
5. The timing model, twice: fed with the run's own calls (`same_run`: accounting, no prediction), and
   fed with model-parallel BP's calls from the same repetition (`from_bp`, timing.calls_from_bp: a
   prediction across runs), each beside the measurement with its error.
6. --slowdowns: the last stage padded to s x its compute for DSP, GPipe and model-parallel BP (inside
   the calls), single-process BP padded by (s - 1) x that stage's compute in the model-parallel run.
7. --ablate=allocator,threads (either placement): this benchmark in whole processes, each setting
   against the default, alternated --ablate_rounds times; the per-process stages inherit the setting.
   Ratios setting / default of best BP's step and of each row's time per iteration (or tick).
"""

import copy
import io
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.best_bp import BP_VARIANTS, time_bp_variants
from benchmarks.timing import fmt_spread, spread
from configs import dsp as dsp_config
from ripples_jax.distributed.launcher import launch
from ripples_jax.pipeline import timing
from ripples_jax.pipeline import train as pipeline_train

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (method, mode, chunks). chunks: the residual calls over that many chunks of the batch (the
# micro-batch effect GPipe gets, given to the stash variant; BP gets it as its micro-batched variants).
VARIANTS = {
  "bp_model_parallel": ("bp", "recompute", 1),
  "gpipe": ("gpipe", "recompute", 1),
  "ddg": ("ddg", "recompute", 1),
  "pipedream": ("pipedream", "recompute", 1),
  "pipemare": ("pipemare", "recompute", 1),
  "fr": ("fr", "recompute", 1),
  "dsp": ("dsp", "recompute", 1),
  "dsp_fused": ("dsp", "fused", 1),
  "dsp_weight_stash": ("dsp", "residuals", 1),
  "dsp_weight_stash_chunks4": ("dsp", "residuals", 4),
}
# What each row is, for the tables (the stash variant is not DSP as published: it keeps the forward's
# residuals, so its gradients are taken at the weights the forward used).
LABELS = {
  "bp_model_parallel": "BP, stage k in process k, no pipelining",
  "gpipe": "GPipe, M=4, remat, flush",
  "ddg": "DDG (locked forward, delayed gradients, stored graph)",
  "pipedream": "PipeDream-1F1B, weight stashing",
  "pipemare": "PipeMare (1F1B, no stashing, corrected backward)",
  "fr": "Features Replay (recompute)",
  "dsp": "DSP as published (recompute)",
  "dsp_fused": "DSP, the recompute fused with the forward",
  "dsp_weight_stash": "weight stashing on DSP's schedule (not DSP as published)",
  "dsp_weight_stash_chunks4": "weight stashing on DSP's schedule, calls over 4 chunks",
}
# The model's name for a row (timing.runtime_iteration, timing.calls_from_bp); None: no prediction
# from BP's calls (a fused or chunked call's cost is not a sum of BP's).
MODEL_METHOD = {
  "bp_model_parallel": "bp",
  "dsp_weight_stash": "dsp_residuals",
  "dsp_fused": None,
  "dsp_weight_stash_chunks4": None,
}
STRAGGLER_VARIANTS = ("bp_model_parallel", "gpipe", "dsp", "dsp_weight_stash")


def define_flags() -> None:
  flags.DEFINE_enum("placement", "per_process", ["per_process", "devices", "spmd"], "Where the stages run.")
  flags.DEFINE_integer("batch", 64, "placement=spmd: the global batch of every row.")
  flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"], "placement=spmd: forced CPU devices or the GPUs.")
  flags.DEFINE_list("hidden", [], "placement=spmd, model=mlp: the hidden widths.")
  flags.DEFINE_integer("microbatches", 4, "placement=spmd: M of gpipe, 1f1b and zbh1.")
  flags.DEFINE_integer("per_dispatch", 16, "placement=spmd: ticks (steps) a dispatch.")
  flags.DEFINE_integer("dispatches", 3, "placement=spmd: timed dispatches a row (after 2 of warm-up).")
  flags.DEFINE_integer("num_stages", 2, "K: stages, one process (or device) each.")
  flags.DEFINE_list(
    "variants", None, "Rows to run (default: every per_process row, or pipeline_devices.DEFAULT)."
  )
  flags.DEFINE_integer("ticks", 10, "placement=devices: ticks per timed block.")
  flags.DEFINE_list(
    "ablate",
    [],
    "Process settings, each against the default (allocator, threads), whole processes alternated.",
  )
  flags.DEFINE_integer("ablate_rounds", 4, "--ablate: alternations of whole processes per setting.")
  flags.DEFINE_list("slowdowns", [], "Straggler factors s for the last stage (e.g. 2,4); none by default.")
  flags.DEFINE_integer("iterations", 60, "Batches per runtime run.")
  flags.DEFINE_integer("reps", 5, "Repetitions: full alternations of the BP variants and every method.")
  flags.DEFINE_integer("bp_reps", 20, "Timed single-process BP steps per variant, each repetition.")
  flags.DEFINE_string("model", "cnn2d", "Model (split into K stages).")
  flags.DEFINE_list(
    "input_shape", ["32", "32", "3"], "The synthetic examples' shape (CIFAR-shaped by default)."
  )
  flags.DEFINE_bool("pin_cores", True, "Pin stage k to core k mod the cores (runtime.pin_cores).")
  flags.DEFINE_enum(
    "malloc", "default", ["default", "tuned"], "The stage processes' allocator (experiments.launch --malloc)."
  )
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
  code = launch(K, args, module="experiments.train_dsp", out=out, cwd=ROOT, grace_s=10, malloc=FLAGS.malloc)
  if code != 0:
    raise RuntimeError(f"{config.method}/{config.mode} K={K} failed ({code}):\n{out.getvalue()[-3000:]}")
  return json.load(open(os.path.join(workdir, "summary.json")))


def row(name: str, runs: list, best_bp: list, ceiling_s: list, bp_runs: list) -> dict:
  """One method's figures over the repetitions, each ratio paired with its repetition's BP."""
  its = np.array([r["iteration_s"] for r in runs])
  speedup = np.array(best_bp) / its
  out = {
    "label": LABELS[name],
    "method": VARIANTS[name][0],
    "mode": runs[-1]["mode"],
    "measured_iteration_s": {**spread(its), "all": its.tolist()},
    "measured_speedup_vs_best_bp": spread(speedup),
    "vs_ceiling": spread(np.array(ceiling_s) / its),
    "tick_efficiency": spread([timing.tick_efficiency(r) for r in runs]),
    "stored_bytes": [s["stored_bytes"] for s in runs[-1]["stages"]],
    "xla_memory": [s.get("xla_memory") for s in runs[-1]["stages"]],
    "median_call_s": [s["median_s"] for s in runs[-1]["stages"]],
    "transfer_s": [s["transfer_s"] for s in runs[-1]["stages"]],
  }
  model = MODEL_METHOD.get(name, VARIANTS[name][0])
  same = [timing.runtime_iteration(model or VARIANTS[name][0], r["stages"], microbatches=4) for r in runs]
  out["same_run_model_error"] = spread(np.array(same) / its - 1)
  # The per-tick overhead this run's own calls leave unexplained (the same for every method if the
  # model's overhead term is right), and the cross-run check: fitted on BP's run of the repetition,
  # added to the prediction from BP's calls.
  out["tick_overhead_s"] = spread(
    [timing.tick_overhead(model or VARIANTS[name][0], r["stages"], r["iteration_s"], 4) for r in runs]
  )
  if model is not None and bp_runs:
    from_bp = [timing.calls_from_bp(model, bp["stages"], 4) for bp in bp_runs]
    pred = [timing.runtime_iteration(model, c, microbatches=4) for c in from_bp]
    out["predicted_from_bp_s"] = spread(pred)
    out["prediction_error"] = spread(np.array(pred) / its - 1)
    bp_o = [timing.tick_overhead("bp", bp["stages"], bp["iteration_s"], 4) for bp in bp_runs]
    pred_o = [timing.runtime_iteration(model, c, 4, o) for c, o in zip(from_bp, bp_o)]
    out["prediction_error_with_overhead"] = spread(np.array(pred_o) / its - 1)
  return out


def main_devices(base) -> dict:
  from benchmarks import pipeline_devices

  names = list(FLAGS.variants or pipeline_devices.DEFAULT)
  bad = [n for n in names if n not in pipeline_devices.VARIANTS]
  if bad:
    raise app.UsageError(
      f"--variants: {bad} not allowed with --placement=devices: {list(pipeline_devices.VARIANTS)}"
    )
  if FLAGS.ablate:
    return run_ablations(names)
  out = pipeline_devices.run(base, names, FLAGS.reps, FLAGS.ticks, FLAGS.bp_reps)
  pipeline_devices.print_table(out)
  return out


def run_ablations(names: list) -> dict:
  """--ablate, either placement: this benchmark in whole processes, each setting against the default
  (benchmarks/pipeline_devices.py ablate); a per-process run's stage processes inherit the setting."""
  from benchmarks import pipeline_devices

  bad = [a for a in FLAGS.ablate if a not in pipeline_devices.ABLATIONS]
  if bad:
    raise app.UsageError(f"--ablate: {bad} not allowed: a list of {list(pipeline_devices.ABLATIONS)}")
  keep = [a for a in sys.argv[1:] if not a.startswith(("--ablate", "--json_out", "--reps"))]
  tmp = tempfile.mkdtemp(prefix="bench_ablate_")
  try:
    return {
      "ablations": pipeline_devices.ablate(keep + ["--reps=1"], names, FLAGS.ablate, FLAGS.ablate_rounds, tmp)
    }
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def main_spmd() -> dict:
  from benchmarks import pipeline_spmd

  base = {
    "model": FLAGS.model,
    "input_shape": [int(d) for d in FLAGS.input_shape],
    "hidden": [int(h) for h in FLAGS.hidden],
    "num_stages": FLAGS.num_stages,
    "batch": FLAGS.batch,
    "microbatches": FLAGS.microbatches,
    "warmup": 2,
    "dispatches": FLAGS.dispatches,
    "per_dispatch": FLAGS.per_dispatch,
    "platform": FLAGS.platform,
  }
  out = pipeline_spmd.measure(
    base, FLAGS.variants or pipeline_spmd.ROWS, FLAGS.reps, log=lambda m: print(m, flush=True)
  )
  out["machine"] = {"cores": len(os.sched_getaffinity(0)), "jax": jax.__version__}
  print(pipeline_spmd.markdown(out))
  return out


def main(argv):
  del argv
  if FLAGS.placement == "spmd":  # fresh processes per row: this process never starts a backend
    write_json(main_spmd())
    return
  K, names = FLAGS.num_stages, FLAGS.variants or list(VARIANTS)
  base = bench_config(K, FLAGS.model, FLAGS.iterations, tuple(int(d) for d in FLAGS.input_shape))
  if FLAGS.placement == "devices" or FLAGS.ablate:  # whole processes per setting, or one process
    write_json(main_devices(base) if FLAGS.placement == "devices" else run_ablations(names))
    return
  base.runtime.pin_cores = FLAGS.pin_cores
  tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
  bp_reps, runs = [], {name: [] for name in names}
  for rep in range(FLAGS.reps):
    bp_reps.append(time_bp_variants(base, FLAGS.bp_reps))
    print(f"rep {rep}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in bp_reps[-1].items()), flush=True)
    for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotated
      method, mode, chunks = VARIANTS[name]
      c = copy.deepcopy(base)
      c.method, c.mode, c.placement, c.chunks = method, mode, "per_process", chunks
      runs[name].append(run_variant(c, os.path.join(tmp, f"{name}_{rep}")))
      print(f"rep {rep} {name}: {1e3 * runs[name][-1]['iteration_s']:.1f} ms", flush=True)
  best = min(BP_VARIANTS, key=lambda v: np.median([r[v] for r in bp_reps]))
  best_bp = [r[best] for r in bp_reps]
  single_core = [min(r["bp_pinned"], r["bp_micro_pinned"]) / K for r in bp_reps]
  bp_spread = (max(best_bp) - min(best_bp)) / np.median(best_bp)
  out = {
    "best_bp": {"variant": best, "ms": spread(1e3 * np.array(best_bp)), "spread": float(bp_spread)},
    "unstable": bool(bp_spread > 0.1),
    "ceiling_vs_best_bp": spread(np.array(best_bp) / np.array(single_core)),
    "bp_variants_ms": {v: [1e3 * r[v] for r in bp_reps] for v in BP_VARIANTS},
    "setting": {
      "num_stages": K,
      "model": FLAGS.model,
      "cores": len(os.sched_getaffinity(0)),
      "iterations": FLAGS.iterations,
      "reps": FLAGS.reps,
      "microbatches": base.microbatches,
      "malloc": FLAGS.malloc,
    },
  }
  bp_runs = runs.get("bp_model_parallel", [])
  for name in names:
    out[name] = row(name, runs[name], best_bp, single_core, bp_runs)
  if FLAGS.slowdowns:
    out["_stragglers"] = stragglers(
      base, {n: r[-1] for n, r in runs.items()}, [float(s) for s in FLAGS.slowdowns], tmp
    )
  shutil.rmtree(tmp, ignore_errors=True)
  print_table(out)
  write_json(out)


def write_json(out: dict) -> None:
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
  bp = out["best_bp"]
  print(
    f"best BP: {bp['variant']} {fmt_spread(bp['ms'], spec='.1f')} ms (spread {100 * bp['spread']:.0f}%"
    f"{', UNSTABLE' if out['unstable'] else ''}); ceiling vs best BP {fmt_spread(out['ceiling_vs_best_bp'])}"
  )
  print(
    "| row | what it is | ms | speedup vs best BP | vs ceiling | tick efficiency | same-run model error "
    "| predicted from BP's calls: error | with BP's tick overhead | tick overhead ms |"
  )
  print("|" + " --- |" * 10)
  for name, r in out.items():
    if not isinstance(r, dict) or "label" not in r:
      continue
    pred = fmt_spread(r["prediction_error"], 100, "+.1f") + "%" if "prediction_error" in r else "-"
    key = "prediction_error_with_overhead"
    pred_o = fmt_spread(r[key], 100, "+.1f") + "%" if key in r else "-"
    print(
      f"| {name} | {r['label']} | {fmt_spread(r['measured_iteration_s'], 1e3, '.1f')} "
      f"| {fmt_spread(r['measured_speedup_vs_best_bp'])} | {fmt_spread(r['vs_ceiling'])} "
      f"| {fmt_spread(r['tick_efficiency'])} "
      f"| {fmt_spread(r['same_run_model_error'], 100, '+.1f')}% | {pred} | {pred_o} "
      f"| {fmt_spread(r['tick_overhead_s'], 1e3, '.2f')} |"
    )
  print("KiB per stage:")
  print("\n".join(memory_rows({k: v for k, v in out.items() if isinstance(v, dict) and "label" in v})))


if __name__ == "__main__":
  define_flags()
  if "--placement=devices" in sys.argv:  # the stages' devices, before the backend starts
    from ripples_jax.distributed.host import use_cpu_devices

    use_cpu_devices(8)
  else:
    jax.config.update("jax_platforms", "cpu")
  app.run(main)
