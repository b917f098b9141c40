r"""The hybrid on the wall clock (docs/design.md 4.7) against All-Reduce across replicas: on the devices of
one process (placement=devices) or with a process per (replica, stage) under the launcher
(placement=per_process: R x K stage processes and the coordinator), each run beside the simulator's
prediction fed with what it measured.

  python -m benchmarks.hybrid_devices --json_out=results/hybrid/devices.json
  python -m benchmarks.hybrid_devices --placement=per_process --pad_s=0.05 \
      --json_out=results/hybrid/processes.json

R x K devices (forced CPU devices here, set below before jax loads; a GPU host's GPUs there), DSP's
MNIST-1D pipeline at the step sizes results/hybrid's 4 x 2 study chose, ticks padded to --pad_s (x5 on
the slow device's replica). For every seed the scenarios and algorithms run in a rotated order, one
after another in this process. Per run: the wall-clock time to --target (the sampled model's test
accuracy) and the run's end; beside them the simulated hybrid (placement=one_device) of the same
config, its clock fed with the run's measured costs: every stage's tick = the run's mean tick time of
its unslowed replicas, every group's averages = the run's mean average time. Printed: the measured and
predicted figures, their error, and Smart GG's speedup over All-Reduce, paired by seed
(ripples_jax.verdict).
"""

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and os.environ.get(
  "JAX_PLATFORMS", "cpu"
) in ("", "cpu"):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

flags.DEFINE_enum("placement", "devices", ["devices", "per_process"], "Where the replicas' stages run.")
flags.DEFINE_integer("replicas", 4, "R.")
flags.DEFINE_integer("stages", 2, "K.")
flags.DEFINE_float("pad_s", 0.03, "Each tick's wall seconds (x5 on the slow device's replica).")
flags.DEFINE_integer("epochs", 30, "Passes over MNIST-1D's training set by the replicas together.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
flags.DEFINE_list("scenarios", ["homogeneous", "5x device"], "Of experiments.hybrid_study.SCENARIOS.")
flags.DEFINE_list("algorithms", ["ripples_smart", "allreduce"], "replicas.algorithm values.")
flags.DEFINE_float("target", 0.8, "Test accuracy whose time is measured.")
flags.DEFINE_string("chosen", "results/hybrid/study_4x2.json", "The 4 x 2 study's chosen step sizes.")
flags.DEFINE_string("workdir", "/tmp/hybrid_devices_runs", "The runs' folders.")
flags.DEFINE_string("json_out", "", "Where the results go (JSON).")
FLAGS = flags.FLAGS

FALLBACK_LR = {"ripples_smart": 0.1, "ripples_random": 0.1, "allreduce": 0.05, "none": 0.05}


def config_for(scenario: str, algorithm: str, lr: float, seed: int, placement: str):
  from experiments import hybrid_study

  c = hybrid_study.config_of("4x2", scenario, algorithm, lr, seed)
  c.num_epochs, c.num_stages = FLAGS.epochs, FLAGS.stages
  c.placement = placement
  c.replicas.update(
    count=FLAGS.replicas,
    pad_s=FLAGS.pad_s,
    rotate_every=0.0,
    jitter=0.0,
    stage_s=(FLAGS.pad_s,) * FLAGS.stages,
    stage_bytes=(1.0,) * FLAGS.stages,
  )
  return c


def reached(records: list, target: float):
  return next((r["time"] for r in records if r.get("test_accuracy", 0) >= target), None)


def tick_seconds(config, events) -> float:
  """The median tick of the replicas without the slow device, from a run's log: a tick lasts from the
  replica's previous event (its tick or its group's average) to its end."""
  from ripples_jax.hybrid.clock import TICK_END as TICK

  slow = tuple(config.replicas.slow)
  last, ticks = {}, []
  for e in events:
    if e[1] == TICK:
      r = e[2]
      if r in last and (not slow or r != slow[0]):
        ticks.append(e[0] - last[r])
      last[r] = e[0]
    else:
      for m in e[2]:
        last[m] = e[0]
  return float(np.median(ticks))


def config_args(config) -> list[str]:
  """experiments.train_dsp's flags for `config`: the config file and every key that differs from it."""
  from configs import dsp as dsp_config

  spec = f"method={config.method},num_stages={config.num_stages},epochs={config.num_epochs}"
  base = dsp_config.get_config(spec)
  fmt = lambda v: (
    "(" + ",".join(repr(x) for x in v) + ("," if len(v) == 1 else "") + ")" if isinstance(v, tuple) else v
  )  # noqa: E731
  want, have = flatten(config.to_dict()), flatten(base.to_dict())
  return [f"--config=configs/dsp.py:{spec}"] + [
    f"--config.{k}={fmt(v)}" for k, v in want.items() if have.get(k) != v
  ]


def flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
  return out


def launched(config, workdir: str) -> tuple:
  """One placement=per_process run under the launcher: (summary, the run's events)."""
  from ripples_jax.distributed.launcher import launch
  from ripples_jax.hybrid import processes

  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  n = config.replicas.count * config.num_stages
  with open(os.path.join(workdir + ".launch.log"), "w") as log:
    code = launch(n, [*config_args(config), f"--workdir={workdir}"], module="experiments.train_dsp", out=log,
                  grace_s=10, coordinator=True)  # fmt: skip
  if code:
    raise RuntimeError(f"{workdir} failed with exit code {code}: see {workdir}.launch.log")
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  traces = processes.read_traces(workdir, config.replicas.count, config.num_stages)
  return summary, processes.events_of(traces, config.replicas.count)


def one(scenario, algorithm, lr, seed) -> dict:
  from ripples_jax import run as run_lib
  from ripples_jax.hybrid import devices as hybrid_devices

  config = config_for(scenario, algorithm, lr, seed, FLAGS.placement)
  name = f"{scenario}-{algorithm}-{seed}".replace(" ", "_")
  t = time.perf_counter()
  if FLAGS.placement == "per_process":
    summary, events = launched(config, os.path.join(FLAGS.workdir, name))
  else:
    run_lib.validate(config)
    summary, _, events = hybrid_devices.train_replicas(config, os.path.join(FLAGS.workdir, name))
  wall = time.perf_counter() - t
  records = [json.loads(line) for line in open(os.path.join(summary["workdir"], "metrics.jsonl"))]
  tick_s = tick_seconds(config, events)
  # The prediction: the simulated hybrid of the same config, fed with this run's costs.
  sim_config = config_for(scenario, algorithm, lr, seed, "one_device")
  sim_config.replicas.update(stage_s=(tick_s,) * FLAGS.stages, avg_s=summary["average_s"] or 0.0)
  predicted, sim_records = run_lib.run_fresh(sim_config, FLAGS.workdir, name + "-sim")
  return {
    "scenario": scenario,
    "algorithm": algorithm,
    "lr": lr,
    "seed": seed,
    "end": summary["time"],
    "time": reached(records, FLAGS.target),
    "final": summary["final_test_accuracy"],
    "ticks": summary["worker_steps"],
    "groups": summary["groups"],
    "tick_s": tick_s,
    "average_s": summary["average_s"],
    "predicted_end": predicted["time"],
    "predicted_time": reached(sim_records, FLAGS.target),
    "wall_s": wall,
  }


def main(argv):
  del argv
  from ripples_jax import verdict
  from ripples_jax.tables import Table

  chosen = json.load(open(FLAGS.chosen))["chosen"] if os.path.exists(FLAGS.chosen) else FALLBACK_LR
  jobs = [(sc, a) for sc in FLAGS.scenarios for a in FLAGS.algorithms]
  runs = []
  for i, seed in enumerate(int(s) for s in FLAGS.seeds):
    order = jobs[i % len(jobs) :] + jobs[: i % len(jobs)]  # rotated: no job always first or last
    for sc, a in order:
      r = one(sc, a, chosen[a], seed)
      runs.append(r)
      print(json.dumps({k: v for k, v in r.items() if k != "ticks"}), flush=True)
  rows, ratios = [], {}
  err = lambda p, m: "-" if p is None or m is None else f"{100 * (p - m) / m:+.1f}%"
  for r in runs:
    rows.append(
      [
        r["scenario"],
        r["algorithm"],
        r["seed"],
        f"{r['end']:.2f}",
        f"{r['predicted_end']:.2f}",
        err(r["predicted_end"], r["end"]),
        r["time"] and f"{r['time']:.2f}",
        r["predicted_time"] and f"{r['predicted_time']:.2f}",
        err(r["predicted_time"], r["time"]),
        f"{100 * r['final']:.1f}",
      ]
    )
  for sc in FLAGS.scenarios:
    by = {
      a: sorted((r for r in runs if r["scenario"] == sc and r["algorithm"] == a), key=lambda r: r["seed"])
      for a in FLAGS.algorithms
    }
    if "allreduce" in by and "ripples_smart" in by:
      ar, sm = by["allreduce"], by["ripples_smart"]
      ratios[sc] = str(
        verdict.paired(
          [r["time"] for r in sm], [r["time"] for r in ar], ([r["end"] for r in sm], [r["end"] for r in ar])
        )
      )
  head = [
    "scenario",
    "algorithm",
    "seed",
    "end (s)",
    "predicted end",
    "error",
    f"time to {FLAGS.target:g}",
    "predicted",
    "error",
    "final %",
  ]
  text = (
    str(Table(head, rows)) + "\n\nSmart GG's speedup over All-Reduce to the target (wall clock, paired): "
  )
  text += ", ".join(f"{sc} {v}" for sc, v in ratios.items())
  print(text)
  if FLAGS.json_out:
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
      json.dump({"runs": runs, "speedup": ratios, "argv": sys.argv}, f, indent=1)
    with open(FLAGS.json_out.replace(".json", ".md"), "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
