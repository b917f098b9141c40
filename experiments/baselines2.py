"""The fair fight (experiments.baselines2_study, results/baselines2): every method of the baselines study
as its paper runs it, tuned on one budget, scored on a model someone holds, on held-out seeds.

What changed from experiments.baselines (results/baselines, superseded):
- **Scored on two deployable models**, side by side: (a) the consensus model at its clock, the one
  All-Reduce that builds it from the workers' models charged at every evaluation (sim.consensus_charge:
  gossip and group methods; 0 where every worker holds it; DiLoCo's global model after its last outer
  step), and (b) the median worker's own model (the worst worker's in the JSON). The workers' mean
  model, uncharged (every earlier study's metric), is kept as a third column for the before/after.
- **One tuning budget**: every method searches lr x momentum on the same grid, EFF_GRID x MOMENTA, the
  grid taken on the effective step lr / (1 - momentum) (so momentum 0 is searched at the step sizes it
  needs), 10 points; a method with a key of its own then searches it at the chosen point (Smart GG's
  group size, the windowed Moshpit's window: 2 points more). DiLoCo as published: AdamW inner steps (its
  momentum is AdamW's b1, 0.9, not searched) on ADAMW_LRS at outer (0.7, Nesterov 0.9), then outer lr x
  outer momentum (OUTER): 11 points. The async PS searches the server's momentum. Every point runs on
  TUNE_SEEDS, none reported, and is scored on the deployable model (a): the median validation time to
  the target at its charged clock.
- **Tuned per kind of scenario**: the homogeneous choice for the homogeneous and the killed scenarios,
  the 5x-straggler choice for every straggler scenario (2x, 5x, moving, random); tuning.md holds both.
- **Baselines as published**: DiLoCo H=16 with AdamW (30 outer steps in STEPS), local SGD (periodic
  averaging: outer lr 1, momentum 0) as a named variant; Moshpit with a matchmaking window (the
  lockstep rounds kept as a named variant); the async PS with Zhang et al.'s lr / staleness; All-Reduce
  over the fast workers beside All-Reduce that waits, in the fixed-straggler scenarios.
- **Held-out seeds** (SEEDS, never run before), and the old headline's protocol (results/baselines'
  tuned step sizes, 300 steps, every step evaluated) rerun on them: the `heldout_old` part.
"""

import dataclasses
import json
import math
import os

import numpy as np

from experiments import baselines
from experiments.ledger_tta import run_key, train_runs, variant
from experiments.study import crossing, final
from ripples_jax import algorithms, verdict
from ripples_jax.runlog import write_json
from ripples_jax.tables import Table

STEPS = 480  # DiLoCo H=16: 30 outer steps
EVERY = 4  # evaluated every 4 steps (every step: 60% of a run's cost)
TARGET = 0.55
EFF_GRID = (1.0, 2.0, 4.0, 8.0, 16.0)  # lr / (1 - momentum): 0.1-1.6 at 0.9, 1-16 at 0
MOMENTA = (0.0, 0.9)
ADAMW_LRS = (0.001, 0.002, 0.004, 0.008, 0.016)
OUTER_FIRST = {"diloco.outer_lr": 0.7, "diloco.outer_momentum": 0.9}  # Douillard et al.'s
OUTER = tuple({"diloco.outer_lr": o, "diloco.outer_momentum": m} for o in (0.5, 0.7, 1.0) for m in MOMENTA)
TUNE_SEEDS = (100, 101)
SEEDS = tuple(range(20, 26))  # held out: no run of any study used them
OLD_SEEDS = tuple(range(20, 28))  # the old protocol's headline on new seeds
TUNE_ON = {"homogeneous": "homogeneous, VGG-16 clock", "straggler": "5x straggler, VGG-16 clock"}
SCENARIOS = baselines.STUDY_16
SCENARIOS_256 = (
  "homogeneous, VGG-16 clock, 256 workers x 100 examples",
  "5x straggler, VGG-16 clock, 256 workers x 100 examples",
)
FIXED_STRAGGLER = ("2x straggler, VGG-16 clock", "5x straggler, VGG-16 clock", SCENARIOS_256[1])


def tuned_by(scenario: str) -> str:
  """Which tuning a scenario's runs take: every straggler scenario the straggler's."""
  return "straggler" if "straggler" in scenario or "random" in scenario else "homogeneous"


@dataclasses.dataclass(frozen=True)
class Method:
  """One method of the study: its variant (ledger_tta.variant's name, the searched keys left out), its
  label, the key its momentum is (None: not searched), its own key's points (searched at the chosen
  lr and momentum; the first is the one stage one runs at), and whether it runs only where a fixed
  straggler can be dropped."""

  variant: str
  label: str
  momentum: str | None = "optimizer.momentum"
  own: tuple = ()
  fixed_straggler_only: bool = False


_SIZES = ({"schedule.group_size": 3}, {"schedule.group_size": 2}, {"schedule.group_size": 4})
_WINDOWS = ({"moshpit.window": 0.3}, {"moshpit.window": 0.1}, {"moshpit.window": 1.0})
_ADAMW = "diloco/inner_steps=16/optimizer.name=adamw/optimizer.weight_decay=0.1"
METHODS = {
  "allreduce": Method("allreduce", "All-Reduce"),
  "allreduce_drop": Method(
    "allreduce/drop_slow=True", "All-Reduce, straggler dropped", fixed_straggler_only=True
  ),
  "smart": Method("ripples_smart", "Smart GG", own=_SIZES),
  "smart_fresh": Method("ripples_smart/schedule.smart_fresh=True", "Smart GG (fresh)", own=_SIZES),
  "random": Method("ripples_random", "Random GG"),
  "adpsgd": Method("adpsgd", "AD-PSGD"),
  "diloco": Method(_ADAMW, "DiLoCo H=16, AdamW", momentum=None, own=(OUTER_FIRST,) + OUTER),
  "diloco64": Method(
    _ADAMW.replace("=16/", "=64/"), "DiLoCo H=64, AdamW", momentum=None, own=(OUTER_FIRST,) + OUTER
  ),
  "local_sgd": Method("diloco/inner_steps=16/outer_lr=1/outer_momentum=0", "local SGD H=16"),
  "moshpit": Method("moshpit", "Moshpit, window", own=_WINDOWS),
  "moshpit_lockstep": Method("moshpit", "Moshpit, lockstep"),
  "ps_sync": Method("ps_sync", "sync PS"),
  "ps_async": Method(
    "ps_async/ps.staleness=divide", "async PS, lr / staleness", momentum="ps.server_momentum"
  ),
}
SMARTS = ("smart", "smart_fresh")


def name(base: str, keys: dict) -> str:
  """A variant's name: base's keys, then `keys` (replacing base's own)."""
  alg, have = variant(base)
  merged = {**have, **keys}
  return "/".join([alg] + [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in merged.items()])


def stage_one(m: Method) -> list[tuple[str, float]]:
  """(variant, lr) of a method's first search: lr x momentum on EFF_GRID x MOMENTA (AdamW: ADAMW_LRS),
  at its own key's first point."""
  first = m.own[0] if m.own else {}
  if m.momentum is None:
    return [(name(m.variant, first), lr) for lr in ADAMW_LRS]
  return [
    (name(m.variant, {**first, m.momentum: mu}), round(eff * (1 - mu), 6))
    for mu in MOMENTA
    for eff in EFF_GRID
  ]


def past_edge(first: list[tuple[str, float]], chosen: tuple[str, float]) -> list[tuple[str, float]]:
  """The grid-edge rule, the same for every method: a choice at its row's largest (smallest) step size
  (its row: the first search's points of the chosen variant) extends the row by two points past that
  edge, each 2x the last (half), searched before its own key's points; [] for a choice inside."""
  v, lr = chosen
  row = sorted(x for w, x in first if w == v)
  if len(row) < 2 or lr not in (row[0], row[-1]):
    return []
  f = 2.0 if lr == row[-1] else 0.5
  return [(v, round(lr * f, 6)), (v, round(lr * f * f, 6))]


def stage_two(m: Method, chosen: tuple[str, float]) -> list[tuple[str, float]]:
  """Its own key's other points at the chosen (variant, lr)."""
  v, lr = chosen
  return [(name(v, keys), lr) for keys in m.own[1:]]


@dataclasses.dataclass(frozen=True)
class Part:
  """A simulated part of the study: its scenarios, its runs' length and evaluation interval, and
  whether it tunes step sizes of its own (False: it takes the main part's choices from tuning.json)."""

  name: str
  scenarios: tuple
  steps: int = STEPS
  every: int = EVERY
  tunes: bool = True
  leave_out: tuple = ()  # (scenario, method) pairs not run (each named where the part is defined)


MAIN = Part("study", SCENARIOS)
# 256 workers, each holding 100 training examples: the main part's choices (tuned at 16 workers; a
# tuning at 256 would cost the budget's ~45 points x 2 seeds x 2 core-minutes), evaluated every 8.
# AD-PSGD is left out of the 5x straggler at 256: one of its runs there costs ~20 core-minutes (every
# pairwise exchange a dispatch of its own), 6x an All-Reduce run; it runs in the homogeneous scenario.
AT256 = Part("at256", SCENARIOS_256, every=8, tunes=False, leave_out=((SCENARIOS_256[1], "adpsgd"),))
# DiLoCo H=64 at 30 outer steps: 1,920 steps (the cosine schedule's horizon with them), homogeneous;
# every method of it tuned at that length on the same budget.
LONG = Part("long", ("homogeneous, VGG-16 clock",), steps=1920, every=16)
PARTS = {p.name: p for p in (MAIN, AT256, LONG)}
METHODS_256 = ("allreduce", "allreduce_drop", "smart", "adpsgd", "moshpit", "diloco")
SEEDS_256 = (20, 21, 22)
METHODS_LONG = ("allreduce", "diloco64")  # H=16 makes its 30 outer steps in the main part


def tune_job(scenario: str, v: str, lr: float, seed: int, part: Part | None = None) -> tuple:
  part = part or MAIN
  return (scenario, v, lr, seed, part.steps, "mlp", False, part.every)


def report_job(scenario: str, v: str, lr: float, seed: int, part: Part | None = None) -> tuple:
  part = part or MAIN
  return (scenario, v, lr, seed, part.steps, "mlp", True, part.every)


def score(runs: list, target: float) -> tuple[float, float]:
  """A grid point's score on the deployable model (least best): the median validation time to the
  target at its charged clock over its tuning runs (a run counts only if it also ends there; inf for a
  miss), then minus the mean final validation accuracy."""
  hit = [crossing(r["curve"], target, "cval", "ctime") if final(r, "cval") >= target else None for r in runs]
  return (
    float(np.median([h[0] if h else math.inf for h in hit])),
    -float(np.mean([final(r, "cval") for r in runs])),
  )


def methods_of(scenario: str, methods) -> list[str]:
  return [k for k in methods if not METHODS[k].fixed_straggler_only or scenario in FIXED_STRAGGLER]


def tune(
  out_dir: str, kind: str, methods, workers: int, target: float = TARGET, part: Part | None = None
) -> dict:
  """{method: (variant, lr)} tuned on TUNE_ON[kind] at `part`'s run length; every point's score in
  tuning.json. Three stages: the budget's first search, two points past a choice at its grid's edge,
  a method's own key at the choice."""
  sc = TUNE_ON[kind]
  ms = methods_of(sc, methods)
  job = lambda v, lr, s: tune_job(sc, v, lr, s, part)  # noqa: E731
  runs: dict = {}
  scored = lambda v, lr: score([runs[run_key(*job(v, lr, s))] for s in TUNE_SEEDS], target)  # noqa: E731
  points: dict = {k: {} for k in ms}
  chosen: dict = {}

  def search(stage: dict):
    runs.update(
      train_runs(
        out_dir, [job(v, lr, s) for pts in stage.values() for v, lr in pts for s in TUNE_SEEDS], workers
      )
    )
    for k, pts in stage.items():
      points[k].update({f"{v}|lr={lr:g}": scored(v, lr) for v, lr in pts})
      chosen[k] = min(([chosen[k]] if k in chosen else []) + pts, key=lambda p: scored(*p))

  first = {k: stage_one(METHODS[k]) for k in ms}
  search(first)
  search({k: past_edge(first[k], chosen[k]) for k in ms})
  search({k: stage_two(METHODS[k], chosen[k]) for k in ms})
  return {"scenario": sc, "chosen": chosen, "points": points}


def run_report(out_dir: str, choices: dict, methods, seeds, workers: int, part: Part | None = None) -> dict:
  """The reported runs: every scenario of `part` x method (its kind's choice) x seed."""
  part = part or MAIN
  jobs = [
    report_job(sc, *choices[tuned_by(sc)]["chosen"][k], s, part)
    for sc in part.scenarios
    for k in methods_of(sc, methods)
    if (sc, k) not in part.leave_out
    for s in seeds
  ]
  return train_runs(out_dir, jobs, workers)


# --- Reading the runs ----------------------------------------------------------------------------

METRICS = {  # name: (accuracy column, clock column, what it is)
  "deployable": ("consensus", "ctime", "the consensus model, its All-Reduce charged"),
  "own": ("median", "time", "the median worker's own model"),
  "mean": ("test", "time", "the workers' mean model, uncharged (every earlier study's)"),
}


def summarize(runs: list, target: float) -> dict:
  """Per metric: each seed's time to the target (None: missed), the run's end on that clock, its final
  accuracy; and the worst worker's final accuracy."""
  out = {}
  for m, (acc, clock, _) in METRICS.items():
    hits = [crossing(r["curve"], target, acc, clock) for r in runs]
    out[m] = {
      "time": [h[0] if h else None for h in hits],
      "end": [r["curve"][clock][-1] if r["curve"][clock] else r["end"] for r in runs],
      "final": [final(r, acc) for r in runs],
    }
  out["worst_final"] = [final(r, "worst") for r in runs]
  out["throughput"] = [r["throughput"] for r in runs]
  out["sent"] = float(np.mean([r.get("sent", math.nan) for r in runs]))
  return out


def ratio(p: dict, q: dict, metric: str) -> verdict.Estimate:
  """q's time over p's on `metric`, paired by seed (p faster: > 1), misses censored at each run's end."""
  a, b = p[metric], q[metric]
  return verdict.paired(a["time"], b["time"], (a["end"], b["end"]))


def collect(runs: dict, choices: dict, methods, seeds, target: float, part: Part | None = None) -> dict:
  """{scenario: {method: summarize's record + variant, lr, label}} of `part`'s scenarios."""
  part = part or MAIN
  out = {}
  for sc in part.scenarios:
    per = {}
    for k in methods_of(sc, methods):
      v, lr = choices[tuned_by(sc)]["chosen"][k]
      got = [runs.get(run_key(*report_job(sc, v, lr, s, part))) for s in seeds]
      if any(g is None for g in got):
        continue  # not run yet: a scenario is read over the methods whose every seed ran
      per[k] = {"variant": v, "lr": lr, "label": METHODS[k].label, **summarize(got, target)}
    if "allreduce" in per:
      out[sc] = per
  return out


def baseline_of(per: dict, metric: str) -> str:
  """The baseline a straggler headline is stated against: the better (least geometric mean time) of
  All-Reduce and All-Reduce over the fast workers."""
  cands = [k for k in ("allreduce", "allreduce_drop") if k in per]
  return min(cands, key=lambda k: gmean(per[k][metric]))


def gmean(rec: dict) -> float:
  return float(
    np.exp(np.mean([math.log(t if t is not None else e) for t, e in zip(rec["time"], rec["end"])]))
  )


def fastest(per: dict, metric: str, exclude=()) -> str:
  """The fastest method (least geometric mean time, misses at their end; one that never reached ranks
  last)."""
  pool = [k for k in per if k not in exclude]
  return min(pool, key=lambda k: (all(t is None for t in per[k][metric]["time"]), gmean(per[k][metric])))


def _cell(e: verdict.Estimate) -> str:
  return str(e)


def _reading(e: verdict.Estimate) -> str:
  r = "faster" if e.lo > 1 else "slower" if e.hi < 1 else "no difference shown"
  return r + (" (censored seeds)" if e.censored else "")


def _chosen_cell(rec: dict) -> str:
  """The tuned point: lr, and every searched key's value."""
  keys = variant(rec["variant"])[1]
  shown = {
    "optimizer.momentum": "momentum",
    "ps.server_momentum": "server momentum",
    "schedule.group_size": "group",
    "moshpit.window": "window s",
    "diloco.outer_lr": "outer lr",
    "diloco.outer_momentum": "outer momentum",
  }
  return ", ".join([f"lr {rec['lr']:g}"] + [f"{shown[k]} {v:g}" for k, v in keys.items() if k in shown])


def study_table(out: dict) -> Table:
  rows = []
  for sc, per in out.items():
    for p in per.values():
      row = [sc, p["label"], _chosen_cell(p)]
      for m in ("deployable", "own"):
        base = baseline_of(per, m)
        hit = [t for t in p[m]["time"] if t is not None]
        row += [
          f"{len(hit)}/{len(p[m]['time'])}",
          f"{np.mean(hit):.3g}" if hit else "-",
          str(ratio(p, per[base], m)) + ("" if base == "allreduce" else " (vs dropped)"),
        ]
      row += [
        f"{100 * np.mean(p['deployable']['final']):.1f}",
        f"{100 * np.mean(p['own']['final']):.1f}",
        f"{100 * np.mean(p['worst_final']):.1f}",
        f"{np.mean(p['throughput']) / np.mean(per['allreduce']['throughput']):.2f}x",
      ]
      rows.append(row)
  head = ["scenario", "method", "tuned"]
  for m in ("deployable", "own"):
    head += [f"{m}: reached", f"{m}: mean time (virtual s)", f"{m}: speedup vs All-Reduce (95% interval)"]
  head += [
    "final % (consensus)",
    "final % (median worker)",
    "final % (worst worker)",
    "throughput vs All-Reduce",
  ]
  return Table(head, rows)


def winners_table(out: dict) -> Table:
  """Per scenario and metric: the fastest method, the fastest that is not Smart GG, each Smart GG's
  ratio against it and against the straggler baseline (the better of All-Reduce and All-Reduce over
  the fast workers), and whether the two metrics name one winner."""
  rows = []
  for sc, per in out.items():
    best = {m: fastest(per, m) for m in ("deployable", "own")}
    agree = "yes" if best["deployable"] == best["own"] else "no: the metrics disagree"
    for m in ("deployable", "own"):
      other = fastest(per, m, exclude=SMARTS)
      base = baseline_of(per, m)
      row = [sc, m, per[best[m]]["label"], f"{gmean(per[best[m]][m]):.3g}", agree, per[other]["label"]]
      for s in [s for s in SMARTS if s in per]:
        e = ratio(per[s], per[other], m)
        b = ratio(per[s], per[base], m)
        row += [f"{e} {_reading(e)}", f"{b} {_reading(b)}"]
      rows.append(row)
  head = [
    "scenario",
    "metric",
    "fastest",
    "its time (virtual s)",
    "one winner on both metrics",
    "fastest not Smart GG",
  ]
  for s in SMARTS:
    head += [f"{METHODS[s].label} over it", f"{METHODS[s].label} over the better All-Reduce"]
  return Table(head, rows)


def tuning_text(choices: dict) -> str:
  """tuning.md: per kind, every method's points (variant | lr: median charged validation time / final
  validation accuracy), the chosen one starred."""
  parts = []
  for kind, got in choices.items():
    rows = []
    for k, pts in got["points"].items():
      chosen = "{}|lr={:g}".format(*got["chosen"][k])
      cells = []
      for p, (t, acc) in pts.items():
        v, lr = p.split("|lr=")
        keys = {a.split(".")[-1]: b for a, b in variant(v)[1].items() if a != "diloco.inner_steps"}
        keys.pop("name", None), keys.pop("weight_decay", None), keys.pop("staleness", None)
        keys.pop("smart_fresh", None), keys.pop("drop_slow", None)
        score = "never" if math.isinf(t) else f"{t:.3g}"
        txt = f"lr {lr} {' '.join(f'{a} {b}' for a, b in keys.items())}: {score} / {-acc:.3f}"
        cells.append(("**" + txt + "**") if p == chosen else txt)
      rows.append([METHODS[k].label, len(pts), "; ".join(cells)])
    parts.append(
      f"### Tuned on {got['scenario']} ({kind})\n\n"
      + str(
        Table(
          [
            "method",
            "points",
            "points: median charged validation time to 55% / final validation accuracy (chosen in bold)",
          ],
          rows,
        )
      )
    )
  return "\n\n".join(parts)


def publish(out_dir: str, choices: dict, out: dict, seeds, target: float, part: Part | None = None) -> str:
  """<part>.md (the runs and the winners per metric), <part>.json (per run, every metric's times and
  finals); a part that tunes: tuning.md/json (the main part), tuning_<part>.md/json."""
  from experiments.ledger_tta import scenario_workers

  part = part or MAIN
  n = scenario_workers(part.scenarios[0])
  data = "" if part is not AT256 else " (33,000 generated examples: 101 a worker's)"
  tuned = "" if part.tunes else "; step sizes: the main part's choices (tuned at 16 workers)"
  head = (
    f"numerics: MNIST-1D MLP (40-256-256-10){data}, simulator, {n} workers, {part.steps} steps per worker, "
    f"evaluated every {part.every}, the VGG-16 clock (528e6-byte messages, 56 Gb/s, 0.3 s steps){tuned}; "
    f"held-out seeds {', '.join(map(str, seeds))} paired; time to {100 * target:.0f}% test accuracy on two "
    "deployable models: deployable = the consensus model at its clock, the one All-Reduce that builds it "
    "charged at every evaluation (DiLoCo: its global model; 0 where every worker holds it), own = the "
    "median worker's own model; intervals by ripples_jax.verdict (95%, misses censored at the run's end); "
    "in the fixed-straggler scenarios every speedup is against the better of All-Reduce and All-Reduce "
    f"over the {n - 1} fast workers ('vs dropped' where that one)"
  )
  text = f"{head}\n\n{study_table(out)}\n\nWinners per scenario and metric:\n\n{winners_table(out)}"
  with open(os.path.join(out_dir, f"{part.name}.md"), "w") as f:
    f.write(text + "\n")
  write_json(
    os.path.join(out_dir, f"{part.name}.json"), {"target": target, "seeds": list(seeds), "scenarios": out}
  )
  if not part.tunes:
    return text
  tail = "" if part is MAIN else f"_{part.name}"
  with open(os.path.join(out_dir, f"tuning{tail}.md"), "w") as f:
    f.write(tuning_text(choices) + "\n")
  write_json(
    os.path.join(out_dir, f"tuning{tail}.json"),
    {
      "budget": {"eff_grid": EFF_GRID, "momenta": MOMENTA, "adamw_lrs": ADAMW_LRS, "outer": OUTER},
      "steps": part.steps,
      "tune_seeds": TUNE_SEEDS,
      **{kind: {"scenario": g["scenario"], "chosen": g["chosen"]} for kind, g in choices.items()},
    },
  )
  return text


def sim_part(out_dir: str, part: Part, methods, seeds, workers: int, target: float = TARGET) -> str:
  """One simulated part of the study, end to end: its tuning (or the main part's choices, tuning.json),
  its reported runs, <part>.md/json."""
  if part.tunes:
    kinds = sorted({tuned_by(sc) for sc in part.scenarios})
    choices = {kind: tune(out_dir, kind, methods, workers, target, part) for kind in kinds}
  else:
    got = json.load(open(os.path.join(out_dir, "tuning.json")))
    choices = {kind: {"chosen": {k: tuple(c) for k, c in got[kind]["chosen"].items()}} for kind in TUNE_ON}
  runs = run_report(out_dir, choices, methods, seeds, workers, part)
  return publish(out_dir, choices, collect(runs, choices, methods, seeds, target, part), seeds, target, part)


# --- The old protocol on new seeds ---------------------------------------------------------------

OLD = ("allreduce", "ripples_smart", "ripples_smart/schedule.smart_fresh=True")


def heldout_old(out_dir: str, old_dir: str, workers: int, seeds=OLD_SEEDS, target: float = TARGET) -> str:
  """results/baselines' headline (its tuned step sizes, 300 steps, every step evaluated, the same
  scenarios) on seeds it never ran: Smart GG and Smart GG (fresh) against All-Reduce on the averaged
  model (its metric) and on both deployable ones, beside its stored figure on seeds 0-4
  (heldout_old.md/json)."""
  chosen = json.load(open(os.path.join(old_dir, "tuning.json")))["chosen"]
  old = json.load(open(os.path.join(old_dir, "study16.json")))["scenarios"]
  jobs = [(sc, *chosen[a], s, 300, "mlp", True) for sc in SCENARIOS for a in OLD for s in seeds]
  runs = train_runs(out_dir, jobs, workers)
  rows, record = [], {}
  for sc in SCENARIOS:
    got = {
      a: summarize([runs[run_key(sc, *chosen[a], s, 300, "mlp", True)] for s in seeds], target) for a in OLD
    }
    record[sc] = got
    for a in OLD[1:]:
      was = baselines._ratio(old[sc][a], old[sc]["allreduce"])
      was_own = baselines._ratio(old[sc][a], old[sc]["allreduce"], "worker_time")
      now = {m: ratio(got[a], got["allreduce"], m) for m in METRICS}
      rows.append(
        [
          sc,
          baselines.LABELS[a],
          str(was),
          str(now["mean"]),
          _reading(now["mean"]),
          str(was_own),
          str(now["own"]),
          str(now["deployable"]),
        ]
      )
  table = Table(
    [
      "scenario",
      "method",
      "old: mean model, seeds 0-4 (results/baselines)",
      f"mean model, seeds {seeds[0]}-{seeds[-1]}",
      "reading",
      "old: workers' mean own accuracy, seeds 0-4",
      f"median worker's own, seeds {seeds[0]}-{seeds[-1]}",
      f"consensus charged, seeds {seeds[0]}-{seeds[-1]}",
    ],
    rows,
  )
  text = (
    "results/baselines' protocol (its tuned step sizes, 300 steps, every step evaluated) on seeds it never "
    f"ran: speedup over All-Reduce in time to {100 * target:.0f}% (95% interval, paired by seed).\n\n{table}"
  )
  with open(os.path.join(out_dir, "heldout_old.md"), "w") as f:
    f.write(text + "\n")
  write_json(os.path.join(out_dir, "heldout_old.json"), {"seeds": list(seeds), "scenarios": record})
  return text


# --- Real processes ------------------------------------------------------------------------------
# ledger_runtime's setting: 16 worker processes and the coordinator on this host, steps padded to 0.5 s,
# the first 80 steps of the 300-step schedule, the MLP's own (light) messages. Step sizes: results/
# baselines' light-clock tuning (tuning_light.json: lr at momentum 0.9), the one deviation from this
# study's budget here (a real-process run costs a minute; the budget's 10 points x 2 seeds each would
# be 40 minutes a method). All-Reduce over the fast workers: 15 processes, its lr All-Reduce's.

RUNTIME_SCENARIOS = ("homogeneous", "5x straggler")
RUNTIME_METHODS = ("allreduce", "allreduce_drop", "smart", "adpsgd", "moshpit")
RUNTIME_WINDOW = 0.5  # the windowed Moshpit's window on real processes: one padded step
RUNTIME_SEEDS = (20, 21, 22)
RUNTIME_STEPS, RUNTIME_SCHEDULE, RUNTIME_STEP_TIME = 80, 300, 0.5


def runtime_keys(
  scenario: str, k: str, seed: int, lr: float, target: float = TARGET
) -> tuple[str, dict, int]:
  """(algorithm, config keys, worker processes) of one real-process run: ledger_runtime's keys; the
  measured consensus All-Reduce where the deployable model is built and the run is not elastic;
  All-Reduce over the fast workers without the straggler, on N - 1 processes."""
  from experiments import ledger_runtime

  base = variant(METHODS[k].variant)[0]
  keys = ledger_runtime.overrides(
    scenario, base, seed, lr, RUNTIME_STEPS, RUNTIME_SCHEDULE, RUNTIME_STEP_TIME, target
  )
  n = ledger_runtime.N
  if k == "allreduce_drop" and "hetero.slow_workers" in keys:
    del keys["hetero.slow_workers"], keys["hetero.slowdown"]
    keys["num_steps"], n = RUNTIME_STEPS, n - 1
  if k == "moshpit":
    keys["moshpit.window"] = RUNTIME_WINDOW
  if algorithms.get(base).consensus == algorithms.BUILT and not keys.get("runtime.elastic"):
    keys["runtime.consensus_allreduce"] = True
  return base, keys, n


def runtime_study(
  out_dir: str, old_dir: str, workdir: str, seeds=RUNTIME_SEEDS, target: float = TARGET
) -> dict:
  """Every (seed, scenario, method) on real processes, seed by seed (runtime_runs.json, resumed from),
  then runtime.md."""
  from experiments import ledger_runtime

  light = json.load(open(os.path.join(old_dir, "tuning_light.json")))["chosen"]
  lr_of = {
    "allreduce": light["allreduce"][1],
    "smart": light["ripples_smart"][1],
    "adpsgd": light["adpsgd"][1],
  }
  lr_of["allreduce_drop"], lr_of["moshpit"] = lr_of["allreduce"], light["moshpit"][1]
  path = os.path.join(out_dir, "runtime_runs.json")
  held = json.load(open(path)) if os.path.exists(path) else {}
  for seed in seeds:
    for sc in RUNTIME_SCENARIOS:
      for k in [k for k in RUNTIME_METHODS if k != "allreduce_drop" or sc != "homogeneous"]:
        key = f"{sc}|{k}|lr={lr_of[k]:g}|seed={seed}"
        if key in held:
          continue
        base, keys, n = runtime_keys(sc, k, seed, lr_of[k], target)
        slow = "hetero.slow_workers" in keys
        held[key] = ledger_runtime.measure_and_predict(workdir, key, base, keys, slow, lr_of[k], target, n)
        write_json(path, held, indent=None)
  text = runtime_text(held, lr_of, seeds, target)
  with open(os.path.join(out_dir, "runtime.md"), "w") as f:
    f.write(text + "\n")
  return held


def runtime_record(r: dict, charge: float | None, target: float, held: bool = False) -> dict:
  """One real-process run on the three metrics: time to the target (None: missed) and the end, on the
  deployable model's clock (charged), the median worker's and the mean model's. held: every worker
  holds the run's model (All-Reduce): its own model is the mean (an evaluation marker falls between a
  worker's step and its All-Reduce, so its snapshot there is a model no worker keeps)."""

  def first(points, shift=0.0):
    return next((t + shift for t, a in points if a >= target), None)

  charge = r.get("consensus_charge") if r.get("consensus_charge") is not None else charge
  return {
    "deployable": {"time": first(r["evals"], charge or 0.0), "end": r["end"] + (charge or 0.0)},
    "own": {"time": first(r["evals"] if held else r["own"]), "end": r["end"]},
    "mean": {"time": r["time_to_target"], "end": r["end"]},
    "charge": charge,
  }


def runtime_text(held: dict, lr_of: dict, seeds, target: float) -> str:
  """runtime.md: per scenario and method, each metric's speedup over the better All-Reduce. AD-PSGD's
  run is elastic (its tickets), where the consensus All-Reduce is not timed in the run: it is charged
  the same seed and scenario's Smart GG measured one (the same model over the same 16 processes)."""
  rows = []
  for sc in RUNTIME_SCENARIOS:
    ks = [k for k in RUNTIME_METHODS if k != "allreduce_drop" or sc != "homogeneous"]
    got = {k: [held.get(f"{sc}|{k}|lr={lr_of[k]:g}|seed={s}") for s in seeds] for k in ks}
    if any(r is None for rs in got.values() for r in rs):
      continue
    smart_charge = [r.get("consensus_charge") for r in got["smart"]]
    holds = {k: algorithms.get(variant(METHODS[k].variant)[0]).consensus == algorithms.HELD for k in ks}
    rec = {
      k: [runtime_record(r, c, target, holds[k]) for r, c in zip(rs, smart_charge)] for k, rs in got.items()
    }
    per = {
      k: {m: {f: [x[m][f] for x in rs] for f in ("time", "end")} for m in METRICS} for k, rs in rec.items()
    }
    for k in ks:
      row = [sc, METHODS[k].label, f"{lr_of[k]:g}"]
      for m in ("deployable", "own", "mean"):
        base = baseline_of(per, m)
        hit = [t for t in per[k][m]["time"] if t is not None]
        row += [f"{np.mean(hit):.1f}" if hit else "-", str(ratio(per[k], per[base], m))]
      charges = [x["charge"] for x in rec[k]]
      row.append("-" if None in charges else f"{1e3 * np.mean(charges):.1f}")
      row.append(f"{100 * np.mean([r['final'] for r in got[k]]):.1f}")
      both = [(r["time_to_target"], r["predicted"]["time_to_target"]) for r in got[k]]
      err = [p / m - 1 for m, p in both if m and p]
      row.append(
        f"{100 * np.mean(err):+.1f}% (max |{100 * np.max(np.abs(err)):.1f}|%, {len(err)} runs)"
        if err
        else "-"
      )
      rows.append(row)
  head = ["scenario", "method", "lr"]
  for m in ("deployable", "own", "mean"):
    head += [f"{m}: wall s to {100 * target:.0f}%", f"{m}: speedup vs the better All-Reduce"]
  head += [
    "consensus All-Reduce charged, ms",
    "final % (mean model)",
    "simulator's error, time to target (mean)",
  ]
  return (
    f"Real processes: MNIST-1D MLP, 16 worker processes (All-Reduce over the fast workers: 15) and the "
    f"coordinator on one host's 2 cores, steps padded to {RUNTIME_STEP_TIME:g} s, the first "
    f"{RUNTIME_STEPS} steps of a {RUNTIME_SCHEDULE}-step schedule; seeds {', '.join(map(str, seeds))}; "
    "step sizes results/baselines' light-clock tuning; deployable = the consensus model, its All-Reduce "
    "as the workers timed it after their last step (AD-PSGD: Smart GG's of the same seed); own = the "
    "median worker's own model; mean = the workers' mean, uncharged. 95% intervals paired by seed, "
    f"misses censored at the run's end.\n\n{Table(head, rows)}"
  )


# --- Before and after ------------------------------------------------------------------------------


def before_after(out_dir: str, old_dir: str) -> str:
  """before_after.md: per scenario, Smart GG and Smart GG (fresh) against All-Reduce as results/
  baselines reported it (the mean model, seeds 0-4), its protocol on held-out seeds (heldout_old.json:
  the mean model, the consensus charged, the median worker), and this study (study.json: tuned on one
  budget, against the better All-Reduce); and each scenario's fastest method, before and after, per
  metric."""
  old = json.load(open(os.path.join(old_dir, "study16.json")))["scenarios"]
  held = json.load(open(os.path.join(out_dir, "heldout_old.json")))
  new = json.load(open(os.path.join(out_dir, "study.json")))
  hs, ns = held["seeds"], new["seeds"]
  rows, wins = [], []
  for sc in SCENARIOS:
    for a, k in zip(OLD[1:], SMARTS):
      cells = [sc, baselines.LABELS[a], str(baselines._ratio(old[sc][a], old[sc]["allreduce"]))]
      h = held["scenarios"][sc]
      cells += [str(ratio(h[a], h["allreduce"], m)) for m in ("mean", "deployable", "own")]
      per = new["scenarios"].get(sc, {})
      if k in per:
        cells += [
          str(ratio(per[k], per[baseline_of(per, m)], m))
          + ("" if baseline_of(per, m) == "allreduce" else " (vs dropped)")
          for m in ("deployable", "own")
        ]
      else:
        cells += ["not run", "not run"]
      rows.append(cells)
    per = new["scenarios"].get(sc, {})
    before = min(old[sc], key=lambda v: (all(t is None for t in old[sc][v]["time"]), gmean(old[sc][v])))
    after = {m: per[fastest(per, m)]["label"] if per else "not run" for m in ("deployable", "own")}
    wins.append([sc, old[sc][before]["name"], after["deployable"], after["own"]])
  span = lambda s: f"seeds {s[0]}-{s[-1]}"  # noqa: E731
  table = Table(
    [
      "scenario",
      "method",
      "results/baselines: mean model, seeds 0-4",
      f"same protocol, {span(hs)}: mean model",
      f"same protocol, {span(hs)}: consensus charged",
      f"same protocol, {span(hs)}: median worker",
      f"this study, {span(ns)}: consensus charged",
      f"this study, {span(ns)}: median worker",
    ],
    rows,
  )
  text = (
    "Smart GG's speedup over All-Reduce in time to 55% (95% interval, paired by seed), before and after: "
    "results/baselines' figure, its protocol (its step sizes, 300 steps) on held-out seeds on three "
    "models, and this study (one tuning budget, tuned per kind of scenario, against the better of "
    f"All-Reduce and All-Reduce over the fast workers):\n\n{table}\n\nThe fastest method per scenario, "
    f"before (results/baselines: the mean model) and after (this study, per metric):\n\n"
    + str(Table(["scenario", "before: mean model", "after: consensus charged", "after: median worker"], wins))
  )
  with open(os.path.join(out_dir, "before_after.md"), "w") as f:
    f.write(text + "\n")
  return text
