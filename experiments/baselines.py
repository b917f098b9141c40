"""The baselines study (experiments.baselines_study): Ripples beside today's baselines, every algorithm
in one study, tuned one way, on the ledger's scenarios.

Simulated part: the MNIST-1D MLP's numerics on the VGG-16 clock (ledger_claims.SETTINGS["heavy"]:
528e6-byte messages, 56 Gb/s, 0.3 s steps), 300 steps per worker, at 16 workers (STUDY_16) and 256
(STUDY_256). Every run is ledger_tta.train_run; runs.json holds each (resumable: only one study
process writes it).

Tuning (tuning.md): each algorithm's step size from the ledger's one grid (LR_GRID, sqrt(2) apart) on
its validation split, over the tuning seeds (none reported), in the homogeneous scenario, by the
ledger's rule (study.tuning_score); DiLoCo's outer step size then from OUTER_GRID at its chosen
inner step size (a coordinate search: the inner grid is searched at the paper's outer 0.7, Nesterov
0.9). 256 workers use the 16-worker choice. The runtime's step sizes are tuned the same way on the
light clock (the MLP's own messages; tuning_light.md).

Reported (study.md, study.json): per scenario and algorithm the time to the target (test accuracy of
the averaged model, virtual s) and to 95% of All-Reduce's final accuracy, each as a paired ratio over
seeds against All-Reduce and against Smart GG (ripples_jax.verdict: 95% intervals, misses censored at
the run's end), final accuracy, throughput, and the communication volume: model-sized messages sent per
worker-step (ledger_tta.sent_models). winners.md: the fastest per scenario and Smart GG against the
fastest other method.

Real-process part (runtime.md, runtime_runs.json): the asynchronous runtime, 16 worker processes and
the coordinator under the local launcher, steps padded to 0.5 s, the first 80 steps of the 300-step
schedule (ledger_runtime's setting), homogeneous and one worker 5x slower, each run beside the
simulator's prediction fed with what it measured.
"""

import json
import math
import os
import textwrap

import numpy as np

from experiments import ledger_runtime
from experiments.ledger_claims import numerics
from experiments.ledger_tta import (
  LR_GRID,
  TUNE_SEEDS,
  VALIDATION_EXAMPLES,
  ends_of_training,
  run_key,
  scenario_workers,
  summarize,
  train_runs,
  variant,
)
from experiments.study import tuning_score
from ripples_jax import algorithms, verdict
from ripples_jax.runlog import write_json
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.tables import Table

# The algorithms (runs.json's names: ledger_tta.variant) and their names in the tables. DiLoCo's outer
# step size is tuned (OUTER_GRID): the chosen variant's name holds it.
_label = lambda name, extra="": algorithms.get(name).label + extra  # noqa: E731  (the registry's label)
ALGORITHMS = {
  "allreduce": _label("allreduce"),
  "ripples_smart": _label("ripples_smart"),
  "ripples_smart/schedule.smart_fresh=True": _label("ripples_smart", " (fresh)"),
  "ripples_random": _label("ripples_random"),
  "adpsgd": _label("adpsgd"),
  "diloco/inner_steps=4": _label("diloco", " H=4"),
  "diloco/inner_steps=16": _label("diloco", " H=16"),
  "diloco/inner_steps=64": _label("diloco", " H=64"),
  "moshpit": _label("moshpit"),
  "ps_sync": _label("ps_sync"),
  "ps_async": _label("ps_async"),
}
# At 256 workers a run costs 1-3 core-minutes: every algorithm but Smart GG (fresh), which only
# reorders a repeated group and 256 workers in groups of 3 repeat none (results/baselines/README.md).
ALGORITHMS_256 = tuple(a for a in ALGORITHMS if a != "ripples_smart/schedule.smart_fresh=True")
# sim256's tuning grid: the 16-worker grid's ends, every other point (7 runs, not 11, per algorithm).
GRID_256 = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
OUTER_GRID = (0.35, 0.5, 0.7, 1.0)
OUTER_FIRST = 0.7  # the inner grid's outer step size (Douillard et al.'s)
# DiLoCo as published, for a next study (ALGORITHMS above reproduces results/baselines, whose DiLoCo's
# inner steps were the run's momentum SGD): AdamW inner steps with the paper's decoupled weight decay
# 0.1 (b1, b2, eps at optax's defaults: the paper names none), its step size from ADAMW_GRID, then the
# outer lr x outer momentum (OUTER_GRID x OUTER_MOMENTUM_GRID; 0: plain outer SGD).
_ADAMW = "optimizer.name=adamw/optimizer.weight_decay=0.1"
DILOCO_PUBLISHED = {
  f"diloco/inner_steps={h}/{_ADAMW}": _label("diloco", f" H={h}, AdamW") for h in (4, 16, 64)
}
# Periodic averaging (local SGD): the outer step at lr 1 without momentum sets the global model to the
# workers' mean every H steps; its inner steps are the run's optimizer (All-Reduce's), and its name
# fixes the outer step, so only the inner step size is tuned.
LOCAL_SGD = {"diloco/inner_steps=16/outer_lr=1/outer_momentum=0": _label("diloco", " H=16, local SGD")}
# All-Reduce over the fast workers (ledger_tta.drop_slow): what a practitioner tries first against a
# fixed straggler; the straggler headlines are stated against the better of it and All-Reduce.
DROP_SLOW = {"allreduce/drop_slow=True": _label("allreduce", ", straggler dropped")}
LABELS = {**ALGORITHMS, **DILOCO_PUBLISHED, **LOCAL_SGD, **DROP_SLOW}  # every name the study can run
OUTER_MOMENTUM_GRID = (0.0, 0.9)
ADAMW_GRID = tuple(round(lr / 100, 6) for lr in LR_GRID)  # the ledger's grid / 100: 5e-4 .. 0.016
# The async PS a next study tunes (not in ALGORITHMS, which reproduces results/baselines): Zhang et al.'s
# staleness-aware step (each gradient at lr / its staleness) and the server's momentum on a grid (0.9:
# the server every earlier study ran).
PS_STALENESS = "ps_async/ps.staleness=divide"
SERVER_MOMENTUM_GRID = (0.0, 0.9)


def ps_async_variants(momenta=SERVER_MOMENTUM_GRID) -> dict:
  """{variant: label} of the async PS with and without the staleness-aware step at each server momentum
  (ledger_tta.variant names: 'ps_async/ps.staleness=divide/ps.server_momentum=0')."""
  out = {}
  for base, extra in (("ps_async", ""), (PS_STALENESS, ", lr / staleness")):
    for mu in momenta:
      out[f"{base}/ps.server_momentum={mu:g}"] = _label("ps_async", f" (momentum {mu:g}{extra})")
  return out


STUDY_16 = (
  "homogeneous, VGG-16 clock",
  "2x straggler, VGG-16 clock",
  "5x straggler, VGG-16 clock",
  "moving 5x straggler, VGG-16 clock",
  "random p=0.2, s=5, VGG-16 clock",
  "worker killed and restarted, VGG-16 clock",
)
STUDY_256 = ("homogeneous, VGG-16 clock, 256 workers", "5x straggler, VGG-16 clock, 256 workers")
TUNE_ON = {
  "heavy": "homogeneous, VGG-16 clock",
  "light": "homogeneous",
  "heavy256": "homogeneous, VGG-16 clock, 256 workers",  # sim256's own tuning (tuning_256.md)
}
TUNED_FILE = {"heavy": "tuning", "light": "tuning_light", "heavy256": "tuning_256"}

MODEL = "mlp"


def _outer(name: str, outer_lr: float, momentum: float | None = None) -> str:
  return f"{name}/outer_lr={outer_lr:g}" + ("" if momentum is None else f"/outer_momentum={momentum:g}")


def tuning_plan(a, grid=LR_GRID, outer_grid=OUTER_GRID, adamw_grid=ADAMW_GRID) -> tuple:
  """What tune runs for `a`: (the variant of its inner search, that search's step sizes, the outer
  search's variants at the chosen one; () for none). AdamW inner steps search adamw_grid. A DiLoCo
  name that leaves the outer step open searches its inner grid at outer lr OUTER_FIRST (Nesterov 0.9),
  then the outer lr on outer_grid: ALGORITHMS' at momentum 0.9 (results/baselines' search), any other
  x OUTER_MOMENTUM_GRID. A name that sets the outer step (LOCAL_SGD) keeps it."""
  base, keys = variant(a)
  inner = adamw_grid if keys.get("optimizer.name") == "adamw" else grid
  if base != "diloco" or {"diloco.outer_lr", "diloco.outer_momentum"} & set(keys):
    return a, inner, ()
  if a in ALGORITHMS:
    return _outer(a, OUTER_FIRST), inner, tuple(_outer(a, o) for o in outer_grid)
  # the inner search's run is the outer grid's (OUTER_FIRST, 0.9) point: one run key, run once
  first = _outer(a, OUTER_FIRST, 0.9)
  return first, inner, tuple(_outer(a, o, mu) for o in outer_grid for mu in OUTER_MOMENTUM_GRID)


def _outer_head(v: str) -> str:
  """An outer search's column: 'outer lr 0.5', or 'outer lr 0.5, momentum 0' where it sets one."""
  keys = variant(v)[1]
  mu = keys.get("diloco.outer_momentum")
  return f"outer lr {keys['diloco.outer_lr']:g}" + ("" if mu is None else f", momentum {mu:g}")


def tune(
  out_dir,
  clock,
  steps,
  target,
  workers,
  grid=LR_GRID,
  outer_grid=OUTER_GRID,
  algorithms=tuple(ALGORITHMS),
  adamw_grid=ADAMW_GRID,
) -> dict:
  """{algorithm: (variant, lr)} for `algorithms` on `clock` (TUNE_ON), written to TUNED_FILE[clock].md/json
  with every grid point's score (median validation time to the target, or never / final val acc); what
  each searches: tuning_plan."""
  scenario = TUNE_ON[clock]
  plan = {a: tuning_plan(a, grid, outer_grid, adamw_grid) for a in algorithms}
  jobs = [
    (scenario, v, lr, s, steps, MODEL, False) for v, g, _ in plan.values() for lr in g for s in TUNE_SEEDS
  ]
  runs = train_runs(out_dir, jobs, workers)

  def score(v, lr):
    return tuning_score([runs[run_key(scenario, v, lr, s, steps, MODEL, False)] for s in TUNE_SEEDS], target)

  points = {a: {lr: score(v, lr) for lr in g} for a, (v, g, _) in plan.items()}
  chosen = {a: (v, min(g, key=lambda lr: points[a][lr])) for a, (v, g, _) in plan.items()}
  outer = {}
  for a in [a for a in algorithms if plan[a][2]]:  # the outer step at the chosen lr
    lr, grid_a = chosen[a][1], plan[a][2]
    jobs = [(scenario, o, lr, s, steps, MODEL, False) for o in grid_a for s in TUNE_SEEDS]
    runs = train_runs(out_dir, jobs, workers)
    outer[a] = {o: score(o, lr) for o in grid_a}
    chosen[a] = (min(grid_a, key=lambda o: outer[a][o]), lr)
  cell = lambda p: f"{'never' if math.isinf(p[0]) else f'{p[0]:.3g}'} / {-p[1]:.3f}"  # noqa: E731
  tables = []  # one per inner grid, then one per outer grid, in the algorithms' order
  for g in dict.fromkeys(plan[a][1] for a in algorithms):
    rows = [
      [LABELS[a]]
      + [cell(points[a][lr]) + (" *" if lr == chosen[a][1] else "") for lr in g]
      + [f"{chosen[a][1]:g}" + (" (grid edge)" if chosen[a][1] in (g[0], g[-1]) else "")]
      for a in algorithms
      if plan[a][1] == g
    ]
    tables.append(Table(["algorithm"] + [f"lr {lr:g}" for lr in g] + ["chosen"], rows))
  heads = {a: tuple(map(_outer_head, plan[a][2])) for a in outer}
  for cols in dict.fromkeys(heads.values()):
    orows = [
      [LABELS[a], f"{chosen[a][1]:g}"]
      + [cell(outer[a][o]) + (" *" if o == chosen[a][0] else "") for o in plan[a][2]]
      for a in outer
      if heads[a] == cols
    ]
    tables.append(Table(["algorithm", "inner lr"] + list(cols), orows))
  name = TUNED_FILE[clock]
  workers = scenario_workers(scenario)
  searched = [a for a in outer if a not in ALGORITHMS]  # outer lr x momentum (tuning_plan)
  momentum = f" (and the outer momentum, for {', '.join(map(LABELS.get, searched))})" if searched else ""
  text = (
    f"{numerics(MODEL).replace('16 workers', f'{workers} workers')}; clock {clock.removesuffix('256')}; "
    f"{steps} steps; each cell: the "
    f"median validation time to {100 * target:.0f}% over seeds {', '.join(map(str, TUNE_SEEDS))} (a run "
    f"counts only if it also ends at or above it) / the mean final validation accuracy, on "
    f"{VALIDATION_EXAMPLES} held-out training examples; * chosen (least time, ties by accuracy). DiLoCo's "
    f"inner grid at outer lr {OUTER_FIRST:g} (Nesterov 0.9), then its outer step size at the chosen inner "
    f"one{momentum}:\n\n" + "\n\n".join(map(str, tables))
  )
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(text + "\n")
  write_json(
    os.path.join(out_dir, f"{name}.json"),
    {
      "clock": clock,
      "grid": list(grid),
      "outer_grid": list(outer_grid),
      **({"adamw_grid": list(adamw_grid)} if any(plan[a][1] == adamw_grid for a in algorithms) else {}),
      **({"outer_momentum_grid": list(OUTER_MOMENTUM_GRID)} if searched else {}),
      "seeds": list(TUNE_SEEDS),
      "target": target,
      "steps": steps,
      "chosen": {a: list(c) for a, c in chosen.items()},
    },
  )
  print(text, flush=True)
  return chosen


def run_study(out_dir, scenarios, seeds, steps, target, workers, chosen, own=True) -> dict:
  """The reported runs of `scenarios` (seeds 0..seeds-1, every algorithm at its tuned variant and step
  size): {scenario: {variant: ledger_tta.summarize's record + "sent" and "name"}}."""
  jobs = [
    (sc, v, lr, s, steps, MODEL, own) for sc in scenarios for v, lr in chosen.values() for s in range(seeds)
  ]
  runs = train_runs(out_dir, jobs, workers)
  out = {}
  for sc in scenarios:
    per = {}
    for a, (v, lr) in chosen.items():
      got = [runs[run_key(sc, v, lr, s, steps, MODEL, own)] for s in range(seeds)]
      per[v] = summarize(got, lr, target)
      per[v]["name"] = LABELS[a]
      per[v]["sent"] = float(np.mean([r["sent"] for r in got]))
    if own:
      ends_of_training(per, runs, steps, MODEL, sc)
    else:  # the tuning-style runs' keys (own=0): ends_of_training reads run_key(..., own=True) keys
      ends_of_training(
        per,
        {
          run_key(sc, v, lr, s, steps, MODEL): runs[run_key(sc, v, lr, s, steps, MODEL, False)]
          for v, lr in chosen.values()
          for s in range(seeds)
        },
        steps,
        MODEL,
        sc,
      )
    out[sc] = per
  return out


def _outer_cell(v: str) -> str:
  """The step-size column's outer part: ', outer 0.5', and ' (momentum 0)' where the name sets one."""
  keys = variant(v)[1]
  if "diloco.outer_lr" not in keys:
    return ""
  mu = keys.get("diloco.outer_momentum")
  return f", outer {keys['diloco.outer_lr']:g}" + ("" if mu is None else f" (momentum {mu:g})")


def _ratio(p, q, key="time") -> verdict.Estimate:
  """q's time over p's, paired by seed (p faster: > 1), misses censored at each run's end."""
  return verdict.paired(p[key], q[key], (p["end"], q["end"]))


def study_table(out: dict, target: float) -> Table:
  rows = []
  for sc, per in out.items():
    ar, smart = per["allreduce"], per["ripples_smart"]
    for v, p in per.items():
      seeds = len(p["time"])
      reached = [t for t in p["time"] if t is not None]
      end_hits = [t for t in p.get("end_time", []) if t is not None]
      rows.append(
        [
          sc,
          p["name"],
          f"{p['lr']:g}" + _outer_cell(v),
          f"{len(reached)}/{seeds}",
          f"{np.mean(reached):.3g}" if reached else "-",
          str(_ratio(p, ar)),
          "-" if p is smart else str(_ratio(smart, p)),
          f"{len(end_hits)}/{seeds}",
          str(_ratio(p, ar, "end_time")) if "end_time" in p else "-",
          f"{100 * np.mean(p['final']):.1f} ± {100 * np.std(p['final'], ddof=1 if seeds > 1 else 0):.1f}",
          f"{np.mean(p['throughput']) / np.mean(ar['throughput']):.2f}x",
          f"{p['sent']:.3g}",
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
      "Smart GG's speedup over it",
      "reached 95% of All-Reduce's final",
      "speedup to it vs All-Reduce",
      "final test accuracy %",
      "throughput vs All-Reduce",
      "models sent per worker-step",
    ],
    rows,
  )


def winners_table(out: dict) -> Table:
  """Per scenario and target: the fastest algorithm (the least geometric mean time over seeds, misses
  at their run's end, of those that reached the target in some seed), then Smart GG's paired ratio
  against the fastest method that is not Smart GG (a variant of it, like Smart GG (fresh), is Smart
  GG: it gets a ratio of its own against the same method), and the reading of each interval. A method
  that never reached the target is ranked last: censored at an early end (a fast clock), it would be
  fastest."""
  first = next(iter(out.values()))
  smarts = [v for v in first if v.split("/")[0] == "ripples_smart"]  # ripples_smart first (ALGORITHMS)
  rows = []
  for sc, per in out.items():
    for key, label in (("time", "fixed target"), ("end_time", "95% of All-Reduce's final")):
      if key not in per["ripples_smart"]:
        continue

      def gmean(p):
        return float(np.exp(np.mean([math.log(t if t is not None else e) for t, e in zip(p[key], p["end"])])))

      def rank(v):
        return (all(t is None for t in per[v][key]), gmean(per[v]))

      best = min(per, key=rank)
      other = min((v for v in per if v not in smarts), key=rank)
      row = [sc, label, per[best]["name"], f"{gmean(per[best]):.3g}", per[other]["name"]]
      for v in smarts:
        e = _ratio(per[v], per[other], key)
        reading = "faster" if e.lo > 1 else "slower" if e.hi < 1 else "no difference shown"
        row += [str(e), reading + (" (censored seeds)" if e.censored else "")]
      rows.append(row)
  header = ["scenario", "target", "fastest (geometric mean time)", "its time (virtual s)", "against"]
  for v in smarts:
    header += [f"{first[v]['name']}'s speedup over it (95% interval)", "reading"]
  return Table(header, rows)


def figure(out: dict, path: str, title: str) -> None:
  """Time to the target by scenario (one panel each) and algorithm: the geometric mean over seeds,
  each seed's time as a dot, misses drawn hollow at their run's end."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(next(iter(out.values())))
  fig, axes = plt.subplots(1, len(out), figsize=(3.2 * len(out), 4.4), sharey=True, squeeze=False)
  for ax, (sc, per) in zip(axes[0], out.items()):
    for i, v in enumerate(names):
      p = per[v]
      vals = [t if t is not None else e for t, e in zip(p["time"], p["end"])]
      ax.bar(i, float(np.exp(np.mean(np.log(vals)))), color=f"C{i % 10}", alpha=0.6)
      hit = [(i, t) for t in p["time"] if t is not None]
      miss = [(i, e) for t, e in zip(p["time"], p["end"]) if t is None]
      if hit:
        ax.plot(*zip(*hit), "k.", markersize=3)
      if miss:
        ax.plot(*zip(*miss), "o", mfc="none", mec="k", markersize=4)
    ax.set_xticks(range(len(names)), [per[v]["name"] for v in names], rotation=75, fontsize=7)
    ax.set_yscale("log")
    ax.set_title(sc.replace(", VGG-16 clock", ""), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
  axes[0][0].set_ylabel("time to target, virtual s (log; hollow: missed, at its end)")
  # Wrapped to the figure's width (~14 characters an inch at 9 pt): a two-panel figure cut it off.
  fig.suptitle(textwrap.fill(title, max(40, int(14 * 3.2 * len(out)))), fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def publish(out_dir: str, name: str, out: dict, target: float, header: str) -> str:
  """name.md (the header, the per-run table, the winners), name.json and name.png."""
  text = (
    f"{header}\n\n{study_table(out, target)}\n\nThe fastest per scenario, and Smart GG against the fastest "
    "method that is not Smart GG:\n\n"
    f"{winners_table(out)}"
  )
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(text + "\n")
  write_json(os.path.join(out_dir, f"{name}.json"), {"target": target, "scenarios": out})
  figure(out, os.path.join(out_dir, f"{name}.png"), header.split(";")[0])
  return text


# --- Real processes ---------------------------------------------------------------------------

RUNTIME_STUDY = ("homogeneous", "5x straggler", "killed and restarted")  # ledger_runtime's names, then ours
KILLED = RUNTIME_STUDY[2]
# Behind a 5x straggler a lockstep algorithm takes 2.5 s a step: its runs stop at 64 steps (a miss is
# censored at its end, never counted as a hit).
LOCKSTEP = ("allreduce", "ps_sync", "diloco")
# The killed scenario on real processes: worker SLOW is SIGKILLed before its local step KILL_STEP (about
# 10 s in, before any run reaches 55%; the simulated study's death is at 10 s too) and the launcher
# restarts it (--max_restarts=1). An elastic algorithm's worker is restarted alone and rejoins while the
# others go on (runtime.elastic; docs/design.md 3.12); the algorithms the runtime cannot run elastic
# (config.NO_ELASTIC: All-Reduce, DiLoCo, both parameter servers) take the restart every process takes,
# torchrun's: the whole job again from the newest checkpoint marker (every KILL_CKPT steps, for every
# algorithm alike; the servers keep no mid-run checkpoint, runtime/ps.py, so theirs is a start over).
# Heartbeats every 0.5 s, a death noticed after 3 s (the default 15 s is half a run to 55%). Times are
# wall time from the run's first start (clock.jsonl: the redone steps and the restart count).
KILL_STEP, KILL_CKPT = 20, 8
RESTART_ALL = ("allreduce", "diloco", "ps_sync", "ps_async")
KILL_KEYS = {
  "runtime.fail_worker": ledger_runtime.SLOW,
  "runtime.fail_step": KILL_STEP,
  "runtime.checkpoint_every": KILL_CKPT,
  "runtime.heartbeat_s": 0.5,
  "runtime.heartbeat_timeout": 3.0,
}


def runtime_keys(sc, base, seed, lr, steps, schedule_steps, step_time, target) -> dict:
  """One real-process run's config keys (ledger_runtime.overrides, and the killed scenario's)."""
  keys = ledger_runtime.overrides(
    "homogeneous" if sc == KILLED else sc, base, seed, lr, steps, schedule_steps, step_time, target
  )
  if sc == KILLED:
    keys.update(KILL_KEYS)
    if base not in RESTART_ALL:
      keys["runtime.elastic"] = True
  elif sc != "homogeneous" and base in LOCKSTEP:
    keys["num_steps"] = min(steps, 64)
  return keys


def runtime_study(
  out_dir,
  seeds,
  steps,
  schedule_steps,
  step_time,
  target,
  chosen,
  workdir,
  killed_seeds=None,
  repredict=False,
) -> dict:
  """Every (seed, scenario, algorithm) run on real processes, seed by seed (a seed's runs close in
  time), each beside the simulator's prediction: runtime_runs.json (resumed from), runtime.md.
  killed_seeds: the killed scenario's seeds (default `seeds`); repredict: the held killed runs are
  predicted again from what they measured (their earlier prediction kept as predicted_earlier)."""
  path = os.path.join(out_dir, "runtime_runs.json")
  held = json.load(open(path)) if os.path.exists(path) else {}
  seeds_of = {sc: seeds for sc in RUNTIME_STUDY}
  seeds_of[KILLED] = seeds if killed_seeds is None else killed_seeds
  for seed in range(max(seeds_of.values())):
    for sc in [sc for sc in RUNTIME_STUDY if seed < seeds_of[sc]]:
      for a, (v, lr) in chosen.items():
        key = f"{sc}|{v}|lr={lr:g}|seed={seed}"
        base, extra = variant(v)
        keys = {**runtime_keys(sc, base, seed, lr, steps, schedule_steps, step_time, target), **extra}
        if key in held:
          if repredict and sc == KILLED:
            r = held[key]
            r.setdefault("predicted_earlier", r["predicted"])
            r["predicted"] = killed_prediction(base, keys, r["fed"], r["kill"])
            print(f"{key}: predicted {r['predicted']} (earlier {r['predicted_earlier']})", flush=True)
            write_json(path, held, indent=None)
          continue
        if sc == KILLED:
          r = killed_and_predicted(workdir, key, base, keys, lr, target)
        else:
          r = ledger_runtime.measure_and_predict(workdir, key, base, keys, sc != "homogeneous", lr, target)
        held[key] = {"algorithm": a, "variant": v, **r}
        write_json(path, held, indent=None)
  text = runtime_text(held, chosen, seeds_of, target, steps, schedule_steps, step_time)
  with open(os.path.join(out_dir, "runtime.md"), "w") as f:
    f.write(text + "\n")
  print(text)
  return held


def killed_and_predicted(workdir: str, key: str, base: str, keys: dict, lr: float, target) -> dict:
  """A killed-and-restarted run on real processes (KILL_KEYS; restarted once by the launcher) and the
  simulator's prediction of it: measure_and_predict's record with wall times from the first start.

  The prediction is fed with the run's measured costs and its measured membership. Elastic: the
  death (the killed worker's last event), its removal (the coordinator's leave: timeline.detect_s;
  AD-PSGD's exchanges with a dead peer fail at once, so 0) and its rejoin (hetero.leave). Restart-all:
  the simulator's run without the death, every time after the resumed marker's run time moved by the
  outage the two starts measured (ledger_tta's restart model, fed: no step lost beyond the marker's)."""
  elastic = bool(keys.get("runtime.elastic"))
  r = ledger_runtime.measured_run(
    os.path.join(workdir, key.replace(" ", "_").replace("|", "-").replace("/", "_")),
    ledger_runtime.run_args(base, keys),
    max_restarts=1,
    elastic=elastic,
  )
  starts, slow = r["starts"], ledger_runtime.SLOW
  wall = lambda t: None if t is None else trace_lib.wall_clock(starts, t)  # noqa: E731
  fed = ledger_runtime.fed_costs(r, set())
  kill = {"starts": starts}
  if elastic:
    when = {
      k: next((t for t, w, k2 in r.get("membership", []) if w == slow and k2 == k), None)
      for k in ("leave", "rejoin")
    }
    kill.update(
      t_kill=trace_lib.death_time(r["traces"], slow), t_leave=when["leave"], t_rejoin=when["rejoin"]
    )
  else:
    marker, down = (
      (starts[-1]["run"], starts[-1]["wall"] - starts[0]["wall"] - starts[-1]["run"])
      if len(starts) > 1
      else (0.0, 0.0)
    )
    kill.update(t_marker=marker, outage=down)
  predicted = killed_prediction(base, keys, fed, kill)
  out = {
    "time_to_target": wall(r["time_to_target"]),
    "end": wall(r["time"]),
    "run_time_to_target": r["time_to_target"],
    "final": r["final_test_accuracy"],
    "throughput": r["window_throughput"],
    "cpu_use": r["cpu_use"],
    "exit_code": r["exit_code"],
    "evals": [[wall(t), a] for t, a in r["evals"]],
    "lr": lr,
    "fed": fed,
    "kill": kill,
    "predicted": predicted,
  }
  print(
    f"{key}: time to {target:g} {out['time_to_target']} (predicted {predicted['time_to_target']}), end "
    f"{out['end']:.1f} s, cpu {out['cpu_use']:.2f}, starts {len(starts)}",
    flush=True,
  )
  return out


def killed_prediction(base: str, keys: dict, fed: dict, kill: dict) -> dict:
  """The simulator's prediction of a killed run from what it measured (`fed`, killed_and_predicted's
  `kill`): held records are predicted again with this when the simulator changes (runtime_study
  with repredict)."""
  if keys.get("runtime.elastic"):
    t_leave = kill["t_leave"]
    detect = 0.0 if base == "adpsgd" or t_leave is None else t_leave - kill["t_kill"]
    rejoin = -1.0 if kill["t_rejoin"] is None else kill["t_rejoin"]
    leave = ((ledger_runtime.SLOW, kill["t_kill"], rejoin),)
    return ledger_runtime.predicted_run(base, keys, fed, {"hetero.leave": leave, "timeline.detect_s": detect})
  marker, down = kill["t_marker"], kill["outage"]
  p = ledger_runtime.predicted_run(base, keys, fed)
  return {k: None if v is None else (v + down if v > marker else v) for k, v in p.items()}


def runtime_text(held, chosen, seeds_of, target, steps, schedule_steps, step_time) -> str:
  """runtime.md: seeds_of is {scenario: seeds} (an int: every scenario's)."""
  if isinstance(seeds_of, int):
    seeds_of = {sc: seeds_of for sc in RUNTIME_STUDY}
  rows = []
  for sc in [sc for sc in RUNTIME_STUDY if seeds_of.get(sc)]:
    seeds = seeds_of[sc]
    rec = {a: [held[f"{sc}|{v}|lr={lr:g}|seed={s}"] for s in range(seeds)] for a, (v, lr) in chosen.items()}
    times = lambda rs, pred=False: (  # noqa: E731
      [(r["predicted"] if pred else r)["time_to_target"] for r in rs],
      [(r["predicted"] if pred else r)["end"] for r in rs],
    )
    ar, smart = times(rec["allreduce"]), times(rec["ripples_smart"])
    for a, rs in rec.items():
      t, e = times(rs)
      pt, pe = times(rs, True)
      both = [(x, y) for x, y in zip(t, pt) if x and y]
      err = [y / x - 1 for x, y in both]
      rows.append(
        [
          sc,
          LABELS[a],
          f"{rs[0]['lr']:g}",
          f"{sum(x is not None for x in t)}/{seeds}",
          f"{np.mean([x for x in t if x]):.1f}" if any(t) else "-",
          str(verdict.paired(t, ar[0], (e, ar[1]))),
          "-" if a == "ripples_smart" else str(verdict.paired(smart[0], t, (smart[1], e))),
          f"{100 * np.mean(err):+.1f}% (max |{100 * np.max(np.abs(err)):.1f}|%)" if err else "-",
          f"{100 * np.mean([r['final'] for r in rs]):.1f}",
          f"{np.mean([r['throughput'] for r in rs]):.1f}",
          f"{np.mean([r['cpu_use'] for r in rs]):.2f}",
        ]
      )
  table = Table(
    [
      "scenario",
      "algorithm",
      "step size",
      "reached",
      f"wall s to {100 * target:.0f}%",
      "speedup vs All-Reduce (95% interval)",
      "Smart GG's speedup over it",
      "simulator's error on time to target",
      "final %",
      "worker-steps/s",
      "CPU use",
    ],
    rows,
  )
  return (
    f"numerics: MNIST-1D MLP, {ledger_runtime.N} worker processes and the coordinator, executor=async, one "
    f"host's 2 cores; steps padded to {step_time:g} s; the first {steps} steps of a {schedule_steps}-step "
    f"schedule (lockstep algorithms behind the straggler: 64); step sizes tuned on the light clock "
    f"(tuning_light.md); wall time to {100 * target:.0f}% test accuracy of the averaged model (evaluated "
    f"every {ledger_runtime.EVAL_EVERY} steps), seeds paired ("
    + ", ".join(f"{sc}: {n}" for sc, n in seeds_of.items() if n)
    + "), misses censored at the run's end; the simulator's prediction fed with each run's measured "
    f"costs. {KILLED}: worker {ledger_runtime.SLOW} SIGKILLed before its local step {KILL_STEP}, restarted "
    f"once by the launcher (alone with runtime.elastic; All-Reduce, DiLoCo and the servers: every "
    f"process, from the newest checkpoint marker, every {KILL_CKPT} steps), "
    f"times wall-clock from the run's first start.\n\n{table}"
  )


def header(n: int, seeds: int, steps: int, target: float, tuned: str = "at 16 workers (tuning.md)") -> str:
  return (
    f"numerics: MNIST-1D MLP (40-256-256-10), simulator, {n} workers, {steps} steps per worker, the "
    f"VGG-16 clock (528e6-byte messages, 56 Gb/s, 0.3 s steps); {seeds} seeds paired; step sizes tuned "
    f"{tuned}; time to "
    f"{100 * target:.0f}% test accuracy of the averaged model and to 95% of All-Reduce's mean final "
    f"accuracy, virtual s; intervals by ripples_jax.verdict (95%, misses censored at the run's end); "
    f"a lockstep algorithm (All-Reduce, sync PS, DiLoCo) with a killed worker restarts every worker "
    f"from the newest checkpoint: its run stops at the death and resumes at the rejoin (no lost step, "
    f"no start cost)"
  )
