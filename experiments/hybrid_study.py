r"""The hybrid study: Ripples across DSP pipelines beside All-Reduce across replicas (simulated part).

  python -m experiments.hybrid_study --out=results/hybrid --studies=4x2 --seeds=5 --workers=2

reaches (results/hybrid/README.md) with a 5x device Smart GG 4.31x [3.76, 4.93] All-Reduce's time to
85%, and at 64 x 4 (`--studies=64x4 --algorithms=ripples_smart "--scenarios=homogeneous,5x device"
--seeds=3`) 6.24x [4.66, 8.36] to 80%.

R replicas of DSP's K-stage MNIST-1D CNN1D pipeline (executor hybrid, docs/design.md 4.7) on the VGG-16
clock split in K equal stages (ledger_claims.SETTINGS["heavy"]: 0.3 s and 528e6 bytes for the whole
model, 56 Gb/s links; a stage 0.3/K s and 528e6/K bytes), at R x K = 4 x 2 and 64 x 4. Algorithms:
Smart GG and Random GG (groups of 3), All-Reduce of every stage across the replicas after every tick
(data-parallel pipelines as GPipe and MaxText run them), and no averaging (R independent pipelines, for
reference). Scenarios: homogeneous, one device (replica 1's stage 0) 2x or 5x slower, and a 5x device
moving to the next replica every 10 virtual seconds.

Tuning (tuning_<study>.md): each algorithm's step size from one grid per study (STUDIES) on the
validation split, seeds 100-101, homogeneous, by the ledger's rule (study.py's tuning_score: the median
validation time to the target, final validation accuracy as the tie-break). Reported (study_<study>.md
and .json; every run's curve in runs.json): time to the target test accuracy (virtual s) as a paired
ratio over seeds against All-Reduce (ripples_jax.verdict, 95% intervals, misses censored at the run's
end), final accuracy with its paired difference, and the limit a perfect router of the slow device's
load would reach (`router_limit`).
"""

import os
import shutil

import numpy as np
from absl import app, flags

from configs import dsp as dsp_config
from experiments import study as study_lib
from experiments.ledger_claims import SETTINGS
from experiments.study import crossing, final, tuning_score
from ripples_jax import algorithms, verdict
from ripples_jax.runlog import write_json
from ripples_jax.tables import Table

TUNE_SEEDS = (100, 101)
# The registry's labels (replicas.algorithm: every algorithm with groups runs; these four are studied).
ALGORITHMS = {a: algorithms.get(a).label for a in ("ripples_smart", "ripples_random", "allreduce")}
ALGORITHMS["none"] = "no averaging"
# All-Reduce over the R - 1 replicas without the slow device (its shard to the others), in the fixed
# slow-device scenarios only; its step size All-Reduce's (homogeneous, the two are one job).
ALGORITHMS["allreduce_drop"] = "All-Reduce, slow replica dropped"
VARIANT = {"allreduce_drop": "allreduce/drop_slow=True"}
# name: (slow (replica, stage) or (), slowdown, rotate_every virtual s)
SCENARIOS = {
  "homogeneous": ((), 1.0, 0.0),
  "2x device": ((1, 0), 2.0, 0.0),
  "5x device": ((1, 0), 5.0, 0.0),
  "moving 5x device": ((1, 0), 5.0, 10.0),
}
# name: (R, K, epochs, target test accuracy, step-size grid, batch per replica); epochs are passes over
# the training set by all the replicas together. The grids are the ledger's kind (2x apart). 64 x 4
# keeps 4 x 2's batch of all the replicas together (256) and takes ~3,290 ticks a replica (240 epochs):
# with batch 64 a replica and ~843 ticks All-Reduce ended at 52-70% (results/hybrid/README.md,
# runs.json's keys 64x4-b64|...), with batch 4 and 60 epochs at 65%. Its grid reaches 0.05, where
# DSP alone diverges at K=4 (configs/dsp.py), because Smart GG's best on 0.00625-0.025 was the top.
STUDIES = {
  "4x2": (4, 2, 60, 0.85, (0.0125, 0.025, 0.05, 0.1, 0.2), 64),
  "64x4": (64, 4, 240, 0.80, (0.00625, 0.0125, 0.025, 0.05), 4),
}
VALIDATION_EXAMPLES = 500

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", "results/hybrid", "Output folder.")
  flags.DEFINE_list("studies", list(STUDIES), f"Of {', '.join(STUDIES)}.")
  flags.DEFINE_list("parts", ["tune", "study"], "tune, study, clock (the clock alone: throughput).")
  flags.DEFINE_integer("seeds", 3, "Reported seeds: first_seed .. first_seed + seeds - 1.")
  flags.DEFINE_integer("first_seed", 0, "The first reported seed (20: held out, no earlier run used it).")
  flags.DEFINE_list("scenarios", list(SCENARIOS), "Scenarios of the study part.")
  flags.DEFINE_list("algorithms", list(ALGORITHMS), "Algorithms.")
  flags.DEFINE_integer("workers", 1, "Runs at once (one core each).")
  flags.DEFINE_string("workdir", "", "Where the runs' folders go (default: OUT/runs; deleted after each).")


def config_of(study: str, scenario: str, algorithm: str, lr: float, seed: int):
  """The run's config: configs/dsp.py's DSP on MNIST-1D, the hybrid's keys for the study's setting."""
  R, K, epochs, target, _, batch = STUDIES[study]
  model_bytes, bandwidth, step_s = SETTINGS["heavy"]
  c = dsp_config.get_config(f"method=dsp,num_stages={K},epochs={epochs}")
  c.seed, c.batch_size = seed, batch
  c.validation_examples = VALIDATION_EXAMPLES  # held out in tuning and reporting alike (same training set)
  c.optimizer.update(lr=lr, lr_schedule="constant", warmup_steps=20)
  c.log_every, c.eval_every, c.checkpoint_every = 5, 5, 0
  slow, slowdown, rotate = SCENARIOS[scenario]
  algorithm, *keys = algorithm.split("/")  # "allreduce/drop_slow=True": the replica with the slow device
  if "drop_slow=True" in keys and slow:  # left out, its shard to the others (R - 1 replicas)
    if rotate:
      raise ValueError("drop_slow: a moving slow device cannot be left out of the job")
    R, slow, slowdown = R - 1, (), 1.0
  c.replicas.update(
    count=R,
    algorithm=algorithm,
    group_size=3,
    slow=slow,
    slowdown=slowdown,
    rotate_every=rotate,
    stage_s=(step_s / K,) * K,
    stage_bytes=(model_bytes / K,) * K,
    bandwidth=bandwidth,
  )
  return c


def run_key(study, scenario, algorithm, lr, seed, own=False) -> str:
  """own: a study run with the deployable columns (the consensus clock, the median and worst
  replica's own model); the first edition's runs (and every tuning run) have none."""
  return f"{study}|{scenario}|{algorithm}|lr={lr:g}|seed={seed}" + ("|own" if own else "")


def one_run(job) -> dict:
  """A fresh run of the job in workdir; its curve (virtual time, test and validation accuracy) and
  summary figures."""
  from ripples_jax import run as run_lib
  from ripples_jax.distributed.host import quiet_library_logs

  quiet_library_logs()
  study, scenario, algorithm, lr, seed, workdir, *_ = job
  config = config_of(study, scenario, VARIANT.get(algorithm, algorithm), lr, seed)
  name = job_key(job).replace("|", "-").replace(" ", "_")
  summary, records = run_lib.run_fresh(config, workdir, name)
  evals = [r for r in records if "test_accuracy" in r]
  curve = {
    "time": [r["time"] for r in evals],
    "step": [r["step"] for r in evals],
    "test": [r["test_accuracy"] for r in evals],
    "val": [r["val_accuracy"] for r in evals],
  }
  # The deployable columns (baselines2.METRICS'): the consensus is the replicas' mean at its clock, the
  # All-Reduce that builds it charged (none where every replica holds it); the median and worst
  # replica's own model.
  if evals and "worker_median_test_accuracy" in evals[0]:
    curve["consensus"] = curve["test"]
    curve["ctime"] = [r.get("consensus_time", r["time"]) for r in evals]
    curve["median"] = [r["worker_median_test_accuracy"] for r in evals]
    curve["worst"] = [r["worker_min_test_accuracy"] for r in evals]
  out = {
    "curve": curve,
    "end": summary.get("time"),
    "diverged": bool(summary.get("diverged")),
    "ticks": summary.get("worker_steps"),
    "throughput": sum(summary.get("worker_steps") or [0]) / (summary.get("time") or 1.0),  # ticks / virtual s
    "groups": summary.get("groups"),
    "wait": summary.get("wait_time"),
    "comm": summary.get("comm_time"),
  }
  shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
  return out


def job_key(job) -> str:
  """A job's run_key (its workdir is no part of it): (study, scenario, algorithm, lr, seed, workdir[,
  own])."""
  return run_key(*job[:5], own=bool(job[6:7] and job[6]))


def algorithms_of(scenario: str, algorithms) -> list[str]:
  """The dropped replica only where a fixed slow device can be dropped."""
  slow, _, rotate = SCENARIOS[scenario]
  return [a for a in algorithms if a != "allreduce_drop" or (slow and not rotate)]


def tune(out_dir, study, algorithms, workers, workdir) -> dict:
  """{algorithm: chosen lr}, and tuning.md's rows."""
  target, grid = STUDIES[study][3:5]
  dropped = "allreduce_drop" in algorithms  # homogeneous, it is All-Reduce: All-Reduce's choice
  algorithms = [a for a in algorithms if a != "allreduce_drop"]
  jobs = [(study, "homogeneous", a, lr, s, workdir) for a in algorithms for lr in grid for s in TUNE_SEEDS]
  runs = study_lib.run_jobs(out_dir, jobs, workers, run=one_run, key=job_key)
  chosen, rows = {}, []
  for a in algorithms:
    scores = {}
    for lr in grid:
      got = [runs[run_key(study, "homogeneous", a, lr, s)] for s in TUNE_SEEDS]
      scores[lr] = tuning_score(got, target)
      rows.append([study, ALGORITHMS[a], f"{lr:g}", _fmt_time(scores[lr][0]), f"{-100 * scores[lr][1]:.1f}"])
    chosen[a] = min(grid, key=lambda lr: scores[lr])
    rows.append([study, ALGORITHMS[a], f"chosen {chosen[a]:g}", "", ""])
  if dropped:
    chosen["allreduce_drop"] = chosen["allreduce"]
  return chosen, rows


def _fmt_time(t) -> str:
  return "never" if not np.isfinite(t) else f"{t:.4g}"


def study(out_dir, name, chosen, scenarios, algorithms, seeds, workers, workdir) -> dict:
  """Per scenario and algorithm: the runs' times to the target, ends and final accuracies, on `seeds`
  (a tuple)."""
  from experiments import baselines2

  target = STUDIES[name][3]
  jobs = [
    (name, sc, a, chosen[a], s, workdir, True)
    for sc in scenarios
    for a in algorithms_of(sc, algorithms)
    for s in seeds
  ]
  runs = study_lib.run_jobs(out_dir, jobs, workers, run=one_run, key=job_key)
  out = {}
  for sc in scenarios:
    per = {}
    for a in algorithms_of(sc, algorithms):
      got = [runs[run_key(name, sc, a, chosen[a], s, own=True)] for s in seeds]
      hits = [crossing(r["curve"], target) for r in got]
      metrics = baselines2.summarize(got, target) if a != "none" else {}
      per[a] = {
        **{m: metrics[m] for m in ("deployable", "own", "worst_final") if m in metrics},
        "lr": chosen[a],
        "time": [h[0] if h else None for h in hits],
        "end": [r["end"] for r in got],
        "final": [final(r) for r in got],
        "ticks": [sum(r["ticks"]) for r in got],
        "wait": [float(np.mean(r["wait"])) for r in got],
        "comm": [float(np.mean(r["comm"])) for r in got],
      }
    out[sc] = per
  return out


def clock_part(name: str, scenarios, algorithms, seeds: int) -> tuple[dict, Table]:
  """The clock alone (no numerics) of every run of the study: its end for the budget of ticks, the
  groups, each replica's wait: throughput (the same ticks sooner is the same work sooner, not the
  same accuracy sooner), for every scenario and algorithm at a fraction of the numerics' cost."""
  from ripples_jax.hybrid import clock as clock_lib
  from ripples_jax.hybrid import sim as hybrid_sim

  R, K, epochs, _, _, batch = STUDIES[name]
  batches = epochs * ((4000 - VALIDATION_EXAMPLES) // batch)  # MNIST-1D's training set
  total = R * (-(-batches // R) + 2 * (K - 1))  # DSP's drain: sum of the links' delays, up and down
  out, rows = {}, []
  for sc in scenarios:
    for a in algorithms_of(sc, algorithms):
      got = []
      for seed in range(seeds):
        c = config_of(name, sc, VARIANT.get(a, a), 0.01, seed)
        got.append(
          clock_lib.simulate_replicas(
            hybrid_sim.clock_spec(c, c.replicas.stage_s, c.replicas.stage_bytes, total)
          )
        )
      out.setdefault(sc, {})[a] = {
        "end": [t.end_time for t in got],
        "groups": [clock_lib.averages(t) for t in got],
      }
  for sc, per in out.items():
    ar = np.mean(per["allreduce"]["end"])
    for a, p in per.items():
      rows.append(
        [
          sc,
          ALGORITHMS[a],
          f"{np.mean(p['end']):.1f}",
          f"{ar / np.mean(p['end']):.2f}x",
          f"{router_limit(name, sc):.2f}x",
          f"{np.mean(p['groups']):.0f}",
        ]
      )
  head = [
    "scenario",
    "algorithm",
    "end (virtual s)",
    "throughput vs All-Reduce",
    "perfect router (compute only)",
    "groups",
  ]
  return out, Table(head, rows, f"{name}: the clock alone, {total} ticks, {seeds} seeds")


def router_limit(name: str, scenario: str) -> float:
  """The speedup over All-Reduce a perfect router of the slow device's load would reach on the clock's
  compute alone: All-Reduce ticks at the slow device's pace (slowdown x the stage time per tick, every
  replica), a perfect router spreads the slow stage's work so that the R stage-k devices together
  deliver R - 1 + 1/slowdown devices' worth, the replicas' ticks at full speed otherwise; ratio
  slowdown x (R - 1 + 1/slowdown) / R. Communication, equal for both, is left out: a bound."""
  R = STUDIES[name][0]
  s = SCENARIOS[scenario][1]
  return s * (R - 1 + 1 / s) / R


def study_table(out: dict, name: str) -> Table:
  target = STUDIES[name][3]
  rows = []
  for sc, per in out.items():
    ar = per["allreduce"]
    for a, p in per.items():
      seeds = len(p["time"])
      reached = [t for t in p["time"] if t is not None]
      ratio = verdict.paired(p["time"], ar["time"], (p["end"], ar["end"]))
      diff = 100 * (np.array(p["final"]) - np.array(ar["final"]))
      mean, lo, hi = verdict.t_interval(diff)
      rows.append(
        [
          sc,
          ALGORITHMS[a],
          f"{p['lr']:g}",
          f"{len(reached)}/{seeds}",
          f"{np.mean(reached):.3g}" if reached else "-",
          "-" if a == "allreduce" else str(ratio),
          f"{100 * np.mean(p['final']):.1f} ± {100 * np.std(p['final'], ddof=1 if seeds > 1 else 0):.1f}",
          "-" if a == "allreduce" else f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}]",
          f"{np.mean(p['ticks']) / np.mean(ar['ticks']):.2f}x",
          f"{np.mean(p['wait']):.3g}",
        ]
      )
  return Table(
    [
      "scenario",
      "algorithm",
      "step size",
      f"reached {100 * target:.0f}%",
      "mean time to it (virtual s)",
      "speedup vs All-Reduce (95% interval)",
      "final test accuracy %",
      "final minus All-Reduce's (points, paired)",
      "ticks vs All-Reduce",
      "wait per replica (s)",
    ],
    rows,
  )


def deployable_table(out: dict, name: str) -> Table:
  """Time to the target on the two deployable models (baselines2.METRICS): the consensus with its
  All-Reduce charged, the median replica's own; behind a fixed slow device against the better of
  All-Reduce and All-Reduce over the R - 1 fast replicas."""
  from experiments import baselines2

  rows = []
  for sc, per in out.items():
    have = {a: p for a, p in per.items() if "deployable" in p}
    for a, p in have.items():
      row = [sc, ALGORITHMS[a]]
      for m in ("deployable", "own"):
        base = baselines2.baseline_of(have, m)
        hit = [t for t in p[m]["time"] if t is not None]
        row += [
          f"{len(hit)}/{len(p[m]['time'])}",
          f"{np.mean(hit):.3g}" if hit else "-",
          "-"
          if a == base
          else str(baselines2.ratio(p, have[base], m)) + ("" if base == "allreduce" else " (vs dropped)"),
        ]
      row += [f"{100 * np.mean(p['own']['final']):.1f}", f"{100 * np.mean(p['worst_final']):.1f}"]
      rows.append(row)
  head = ["scenario", "algorithm"]
  for m in ("deployable", "own"):
    head += [f"{m}: reached", f"{m}: mean time (virtual s)", f"{m}: speedup vs the better All-Reduce"]
  return Table(
    head + ["final % (median replica)", "final % (worst replica)"], rows, f"{name}: deployable models"
  )


def main(argv):
  del argv
  bad = [s for s in FLAGS.studies if s not in STUDIES] + [a for a in FLAGS.algorithms if a not in ALGORITHMS]
  bad += [s for s in FLAGS.scenarios if s not in SCENARIOS]
  bad += [p for p in FLAGS.parts if p not in ("tune", "study", "clock")]
  if bad:
    raise SystemExit(
      f"hybrid_study: {', '.join(bad)} not allowed (studies {list(STUDIES)}, algorithms "
      f"{list(ALGORITHMS)}, scenarios {list(SCENARIOS)}, parts tune, study, clock)"
    )
  os.makedirs(FLAGS.out, exist_ok=True)
  workdir = FLAGS.workdir or os.path.join(FLAGS.out, "runs")
  algorithms = list(dict.fromkeys(["allreduce", *FLAGS.algorithms]))  # the baseline of every ratio
  for name in FLAGS.studies:
    if "clock" in FLAGS.parts:
      out, table = clock_part(name, FLAGS.scenarios, algorithms, FLAGS.seeds)
      write_json(os.path.join(FLAGS.out, f"clock_{name}.json"), out)
      with open(os.path.join(FLAGS.out, f"clock_{name}.md"), "w") as f:
        f.write(f"{table}\n")
      print(table, flush=True)
    if "tune" not in FLAGS.parts and "study" not in FLAGS.parts:
      continue
    chosen, rows = tune(FLAGS.out, name, algorithms, FLAGS.workers, workdir)
    with open(os.path.join(FLAGS.out, f"tuning_{name}.md"), "w") as f:
      head = ["study", "algorithm", "step size", "median val time to target (s)", "final val %"]
      f.write(f"{Table(head, rows)}\n")
    if "study" not in FLAGS.parts:
      continue
    seeds = tuple(range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds))
    out = study(FLAGS.out, name, chosen, FLAGS.scenarios, algorithms, seeds, FLAGS.workers, workdir)
    write_json(os.path.join(FLAGS.out, f"study_{name}.json"), {"chosen": chosen, "out": out})
    limits = {sc: router_limit(name, sc) for sc in FLAGS.scenarios}
    text = f"{study_table(out, name)}\n\n{deployable_table(out, name)}"
    text += "\n\nA perfect router's limit over All-Reduce (compute only): " + ", ".join(
      f"{sc} {v:.2f}x" for sc, v in limits.items()
    )
    with open(os.path.join(FLAGS.out, f"study_{name}.md"), "w") as f:
      f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
