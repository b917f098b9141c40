"""The ledger's verdicts (verdicts.md): each claim's estimate on the paper's metric (claim_estimate: time
to accuracy, paired by seed), judged on every published figure by ripples_jax.verdict (verdict_table);
what each verdict rests on (DEPENDS); the same claims at every target and on the clock's variants; the
claims no run compares; with the fixed-time and scale tables (ledger_tables)."""

import json
import os

import numpy as np

from experiments.ledger_claims import CLAIMS, CLOCKS, FIGURES, SOURCES, fmt, numerics
from experiments.ledger_tables import fixed_time, fixed_time_table, scale_table
from experiments.ledger_tta import CLOCK_VARIANTS, END_FRACTION, TARGETS
from ripples_jax import verdict
from ripples_jax.tables import Table

# Claims whose comparison the time-to-accuracy runs make (the paper's metric): claim -> (scenario, algorithm)
TTA_OF_CLAIM = {  # in the paper's setting: the VGG-16 clock
  "homogeneous vs All-Reduce": ("homogeneous, VGG-16 clock", ("ripples_smart", "allreduce")),
  "homogeneous vs All-Reduce (Group Division)": (
    "homogeneous, VGG-16 clock",
    ("ripples_division", "allreduce"),
  ),
  "one worker 5x slower vs All-Reduce": ("5x straggler, VGG-16 clock", ("ripples_smart", "allreduce")),
  "homogeneous vs AD-PSGD": ("homogeneous, VGG-16 clock", ("ripples_smart", "adpsgd")),
  "one worker 5x slower vs AD-PSGD": ("5x straggler, VGG-16 clock", ("ripples_smart", "adpsgd")),
  "homogeneous vs Parameter Server (sync)": ("homogeneous, VGG-16 clock", ("ripples_smart", "ps_sync")),
  "homogeneous vs Parameter Server (async)": ("homogeneous, VGG-16 clock", ("ripples_smart", "ps_async")),
  "one worker 2x slower vs All-Reduce": ("2x straggler, VGG-16 clock", ("ripples_smart", "allreduce")),
  "one worker 2x slower vs Parameter Server": ("2x straggler, VGG-16 clock", ("ripples_smart", "ps_sync")),
}


def claim_estimate(
  tta_out: dict | None, claim: str, suffix: str = "", target: str | None = None, kind: str = "times"
) -> verdict.Estimate | None:
  """The baseline's time to the target over Ripples', paired by seed, misses censored at their run's
  end (ripples_jax.verdict); None where the records do not make the claim's comparison. suffix: on a
  variant of the claim's clock (CLOCK_VARIANTS); target: one of TARGETS instead of --target's, of
  `kind` ("times": the averaged model; "worker_times": the mean of the workers' own models); kind
  "end_time" / "end_worker_time": to END_FRACTION of All-Reduce's final accuracy (ledger_tta)."""
  if not tta_out or claim not in TTA_OF_CLAIM:
    return None
  scenario, (num, den) = TTA_OF_CLAIM[claim]
  t = tta_out["scenarios"].get(scenario + suffix, {})
  if num not in t or den not in t:
    return None
  m, b = t[num], t[den]
  if kind in ("end_time", "end_worker_time"):  # to END_FRACTION of All-Reduce's final accuracy
    if kind not in m or kind not in b:
      return None
    times_m, times_b = m[kind], b[kind]
  elif target is None:
    times_m, times_b = m["time"], b["time"]
  elif target in m.get(kind, {}):
    times_m, times_b = m[kind][target], b[kind][target]
  else:
    return None
  n = min(len(times_m), len(times_b))
  ends = (m.get("end", [None] * n)[:n], b.get("end", [None] * n)[:n])
  return verdict.paired(times_m[:n], times_b[:n], ends)


def verdict_table(ledger_out: dict, tta_out: dict | None, target: float) -> Table:
  """One row per claim: every published figure, ours on the paper's metric (time to accuracy on the
  VGG-16 clock, a 95% interval over paired seeds) and the verdict on each figure (ripples_jax.verdict).
  A claim without its training runs shows the clock's throughput ratio and is not judged."""
  rows = []
  for c, (claim, *_) in zip(ledger_out["claims"], CLAIMS):
    figures = FIGURES[claim]
    e = claim_estimate(tta_out, claim)
    if e is None:
      ours = f"- (throughput {fmt(*c['throughput_heavy'])})"
      judged = {src: "not judged: no time-to-accuracy runs" for src in figures}
    else:
      ours = str(e) + (f" [{RESTS_ON_CLOCK}]" if "AD-PSGD" in claim else "")
      judged = {src: verdict.judge(e, f) for src, f in figures.items()}
    rows.append(
      [claim]
      + [f"{figures[src]:g}x" if src in figures else "-" for src in SOURCES]
      + [ours]
      + [judged.get(src, "-") for src in SOURCES]
    )
  return Table(
    ["claim"]
    + [f"paper: {src}" for src in SOURCES]
    + [f"ours: time to {100 * target:.0f}%, 95% interval"]
    + [f"verdict on {src}" for src in SOURCES],
    rows,
  )


def verdict_label(tta_out: dict | None, target: float) -> str:
  """The line above the verdict table: what the numbers are and how they are judged."""
  records = [p for per in (tta_out or {}).get("scenarios", {}).values() for p in per.values()]
  model = (tta_out or {}).get("model", "mlp")
  seeds = sorted({len(p["time"]) for p in records})
  tuned = (
    "step sizes tuned per algorithm and clock on a validation split (tuning.md)"
    if records and all("lr" in p for p in records)
    else "one step size for every algorithm"
  )
  return (
    f"{numerics(model)}; {CLOCKS['heavy']}; time to {100 * target:.0f}% test accuracy of the averaged model; "
    f"{'/'.join(map(str, seeds)) or 'no'} seeds per algorithm; {tuned}; verdicts: reproduced only when "
    f"the 95% interval lies inside the figure +-{100 * verdict.TOLERANCE:.0f}%, larger / smaller only when "
    f"wholly outside it, else inconclusive; censored seeds support only their direction; at least "
    f"{verdict.MIN_SEEDS} seeds (ripples_jax.verdict)."
  )


# The AD-PSGD rows' label: their verdicts rest on the clock's choice of AD-PSGD's cost (its average
# hidden behind compute, nothing else charged), not on a measured AD-PSGD; adpsgd_sweep.md moves it.
RESTS_ON_CLOCK = "rests on the clock's AD-PSGD cost: adpsgd_sweep.md"

# What a verdict rests on besides Ripples itself (the sensitivity and sync-overhead studies' findings).
DEPENDS = {
  "vs Parameter Server": (
    "the server's link: the ratio moves with its bandwidth and the model's size (sensitivity.md)"
  ),
  "vs AD-PSGD": (
    "AD-PSGD's sync overhead, zero in this clock: Lian et al.'s average runs beside the compute, and "
    "nothing in the clock (locking, a passive worker that stops) charges it more (sync_overhead.md)"
  ),
  "one worker slower vs All-Reduce": (
    "communication: the ratio rises toward the compute-only limit as links get faster or overlap "
    "grows (sensitivity.md)"
  ),
}


def verdicts_text(
  out_dir: str, ledger_out: dict, tta_out: dict | None, target: float, steps: int, beside: dict | None = None
) -> str:
  """verdicts.md: the verdict table at --target, what each verdict rests on, the same claims at every
  target and for the workers' own models, at targets where training ends, beside another model's
  ledger (`beside`: its tta.json), the accuracy after a fixed time, the claims no run compares, and
  Smart GG against All-Reduce by worker count."""
  label = numerics((tta_out or {}).get("model", "mlp"))
  parts = [verdict_label(tta_out, target), str(verdict_table(ledger_out, tta_out, target))]
  if tta_out:
    parts += [
      "Which verdicts hold: each claim at the paper's reading on its first figure, held only where it "
      "holds on both models' numerics (the VGG-16 clock) and on every variant of the clock (the first "
      "model's numerics, step sizes the VGG-16 clock's); else model- or clock-dependent, with the cells "
      "that disagree. Intervals cover seed noise only:",
      str(robust_table(tta_out, beside)),
    ]
  parts.append("What each verdict rests on:\n" + "\n".join(f"- {k}: {v}" for k, v in DEPENDS.items()))
  held = (tta_out or {}).get("scenarios", {})
  if any("times" in p for per in held.values() for p in per.values()):
    parts += [
      f"Every target and both evaluations (the averaged model; the mean of the workers' own models), "
      f"judged on each claim's first figure; {label}; the scenarios' clocks as above:",
      str(targets_table(tta_out)),
    ]
  ends = ends_table(tta_out) if tta_out else None
  if ends:
    parts += [
      f"Targets where training ends; {label}; the claims' scenarios' clocks; verdicts on every figure:",
      str(ends),
    ]
  if tta_out and beside:
    parts += [
      "The same claims with a second model's numerics (each ledger tuned and run on its own; the VGG-16 "
      "clock), judged on each claim's first figure (the verdict's first word):",
      str(beside_table(tta_out, beside)),
    ]
  sweep_path = os.path.join(out_dir, "adpsgd_sweep.json")
  if os.path.exists(sweep_path):
    with open(sweep_path) as f:
      sweep = json.load(f)
    reach = [p for p in sweep["points"] if p.get("implied_tta") and p["implied_tta"] >= 4.3 / 1.1]
    cheapest = min(reach, key=lambda p: (not p["passive_blocks"], -p["hidden"], p["lock_s"]), default=None)
    parts.append(
      "AD-PSGD's cost (adpsgd_sweep.md): every AD-PSGD verdict above rests on the clock's choice that "
      "AD-PSGD's average hides behind its compute and nothing else is charged; "
      + (
        "no swept cost brings the implied ratio to within 10% of 4.3x"
        if cheapest is None
        else f"{len(reach)} of {len(sweep['points'])} swept costs bring the implied ratio to 4.3x "
        f"(arXiv) within 10% or more, e.g. hidden share {cheapest['hidden']:.2g}, a "
        f"{cheapest['lock_s']:g} s lock, the passive side "
        f"{'blocking' if cheapest['passive_blocks'] else 'not blocking'} ({cheapest['implied_tta']:.2f}x)"
      )
      + "."
    )
  table = variants_table(tta_out) if tta_out else None
  if table:
    parts += [
      f"The same claims on variants of the VGG-16 clock (step sizes the VGG-16 clock's); {label}; "
      f"time to {100 * target:.0f}% of the averaged model:",
      str(table),
    ]
  runs_path = os.path.join(out_dir, "runs.json")
  got = None
  if tta_out and os.path.exists(runs_path):
    with open(runs_path) as f:
      got = fixed_time(json.load(f), tta_out, steps)
  if got:
    parts += [
      f"Accuracy after a fixed time (the paper: ResNet-50 on ImageNet after 10 hours, from a summary); "
      f"ours: {label}, {CLOCKS['resnet50']}, test accuracy of the averaged model, "
      f"{len(got['budgets'][0]['accuracy']['allreduce'])} seeds, differences paired by seed (95% interval):",
      str(fixed_time_table(got)),
    ]
  overhead_path = os.path.join(out_dir, "sync_overhead.json")
  overhead = json.load(open(overhead_path)) if os.path.exists(overhead_path) else None
  rows = unpublished_rows(ledger_out, overhead)
  if rows:
    parts.append("Claims no training run compares:\n" + rows)
  parts += [
    f"{label.replace('16 workers', '16-256 workers')}; {CLOCKS['light']}:",
    str(scale_table(ledger_out, tta_out, target)),
  ]
  return "\n\n".join(parts)


def targets_table(tta_out: dict) -> Table:
  """Every claim the runs compare, judged on its first published figure at every target (TARGETS),
  for the averaged model and for the workers' own models: does a verdict hang on the target or on
  which model is evaluated?"""
  rows = []
  for claim, *_ in CLAIMS:
    src, figure = next(iter(FIGURES[claim].items()))
    for kind, model in (("times", "averaged model"), ("worker_times", "workers' mean")):
      cells = []
      for t in TARGETS:
        e = claim_estimate(tta_out, claim, target=f"{t:g}", kind=kind)
        cells.append("-" if e is None else f"{e}: {verdict.judge(e, figure)}")
      if any(c != "-" for c in cells):
        rows.append([claim, f"{figure:g}x ({src})", model] + cells)
  return Table(
    ["claim", "figure", "accuracy of"] + [f"time to {100 * t:.0f}%, 95% interval: verdict" for t in TARGETS],
    rows,
  )


def variants_table(tta_out: dict) -> Table | None:
  """Every claim on the paper's metric at each variant of the VGG-16 clock (CLOCK_VARIANTS), judged on
  its first figure: where a verdict flips with overlap or the message's size. None without them."""
  rows = []
  for claim, *_ in CLAIMS:
    src, figure = next(iter(FIGURES[claim].items()))
    cells = []
    for suffix in CLOCK_VARIANTS.values():
      e = claim_estimate(tta_out, claim, suffix)
      cells.append("-" if e is None else f"{e}: {verdict.judge(e, figure)}")
    rows.append([claim, f"{figure:g}x ({src})"] + cells)
  if all(c == "-" for r in rows for c in r[3:]):
    return None
  return Table(["claim", "figure"] + [f"{v}: 95% interval: verdict" for v in CLOCK_VARIANTS], rows)


def unpublished_rows(ledger_out: dict, overhead: dict | None) -> str:
  """The claims no training run compares: the per-iteration sync overhead (published 5.10x, from a
  summary) and the conflict counts (no published number)."""
  lines = []
  if overhead:
    for setting, per in overhead.items():
      smart, ad = np.mean(per["ripples_smart"]), np.mean(per["adpsgd"])
      r = ad / smart
      side = (
        "smaller"
        if r < 5.10 / (1 + verdict.TOLERANCE)
        else "larger"
        if r > 5.10 * (1 + verdict.TOLERANCE)
        else "reproduced"
      )
      lines.append(
        f"- sync overhead per worker-step, {CLOCKS[setting]}: Smart GG {1e3 * smart:.2f} ms, AD-PSGD "
        f"{1e3 * ad:.2f} ms: AD-PSGD's over Smart GG's {r:.2f}x against the paper's 5.10x (body, from a "
        f"summary): {side} (the means over seeds, the figure +-{100 * verdict.TOLERANCE:.0f}%). "
        "AD-PSGD's average runs beside its compute (Lian et al.), so the clock charges it only what "
        "outlasts the step; the AD-PSGD verdicts above rest on this."
      )
  if ledger_out.get("conflicts"):
    lines.append(
      "- conflicts per 1,000 worker-steps (a worker's group met a pending one), homogeneous, light clock: "
      + ", ".join(f"{k} {v:.1f}" for k, v in ledger_out["conflicts"].items())
      + " (the paper publishes no count)."
    )
  return "\n".join(lines)


def ends_table(tta_out: dict) -> Table | None:
  """Every claim the runs compare at targets where training ends, beside the paper's reading (--target):
  time to END_FRACTION of All-Reduce's final accuracy, for the averaged model and the workers' own,
  judged on every published figure; and the accuracy at the scenario's budget (its shortest run, per
  seed: no run censored), Ripples minus the baseline in points, paired (a 95% interval). None without
  the records (tta.json from before they were kept)."""
  rows = []
  for claim, *_ in CLAIMS:
    if claim not in TTA_OF_CLAIM:
      continue
    scenario, (num, den) = TTA_OF_CLAIM[claim]
    per = tta_out["scenarios"].get(scenario, {})
    if num not in per or den not in per or "end_time" not in per[num]:
      continue
    cells = []
    for kind in (None, "end_time", "end_worker_time"):
      e = claim_estimate(tta_out, claim, kind=kind) if kind else claim_estimate(tta_out, claim)
      if e is None:
        cells.append("-")
        continue
      judged = "; ".join(f"{src} {verdict.judge(e, f)}" for src, f in FIGURES[claim].items())
      cells.append(f"{e}: {judged}")
    for key in ("budget_acc", "budget_worker_acc"):
      if key not in per[num]:
        cells.append("-")
        continue
      d = [100 * (x - y) for x, y in zip(per[num][key], per[den][key])]
      mean, lo, hi = verdict.t_interval(d)
      side = "interval holds 0" if lo <= 0 <= hi else ("Ripples ahead" if lo > 0 else "Ripples behind")
      cells.append(f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}] ({side})")
    m = per[den]
    targets = f"{100 * m['end_target']:.1f}% / {100 * m.get('end_worker_target', float('nan')):.1f}%"
    rows.append([claim, targets, f"{np.mean(m['budget']):.4g}"] + cells)
  if not rows:
    return None
  pct = f"{100 * END_FRACTION:.0f}%"
  return Table(
    [
      "claim",
      f"{pct} of All-Reduce's final (averaged / workers' own)",
      "budget, virtual s (mean)",
      "time to the paper's reading (--target): verdicts",
      f"time to {pct} of All-Reduce's final, averaged model: verdicts",
      f"time to {pct} of All-Reduce's final, workers' own: verdicts",
      "accuracy at the budget, averaged model: Ripples - baseline, points",
      "accuracy at the budget, workers' own: Ripples - baseline, points",
    ],
    rows,
  )


def _word(e: verdict.Estimate, figure: float) -> str:
  """A verdict's first word: reproduced, larger, smaller or inconclusive."""
  return verdict.judge(e, figure).split(";")[0].split(" (")[0]


def robust_table(tta_out: dict, other: dict | None) -> Table:
  """Each claim's verdict at the paper's reading on its first figure, held only where it holds on both
  models (tta_out's and other's numerics, the VGG-16 clock) and on every variant of the clock
  (CLOCK_VARIANTS, tta_out's model): else "model-dependent" and/or "clock-dependent", naming the cells
  that disagree. A cell the records do not hold is left out of the reading (and shown as -)."""
  name = lambda t: t.get("model", "mlp")  # noqa: E731
  rows = []
  for claim in [c for c, *_ in CLAIMS if c in TTA_OF_CLAIM]:
    src, figure = next(iter(FIGURES[claim].items()))
    cells = {f"{name(tta_out)}, VGG-16 clock": claim_estimate(tta_out, claim)}
    if other:
      cells[f"{name(other)}, VGG-16 clock"] = claim_estimate(other, claim)
    for v, suffix in list(CLOCK_VARIANTS.items())[1:]:
      cells[f"{name(tta_out)}, {v}"] = claim_estimate(tta_out, claim, suffix)
    words = {k: _word(e, figure) for k, e in cells.items() if e is not None}
    base = f"{name(tta_out)}, VGG-16 clock"
    if base not in words:
      continue
    models = {k: w for k, w in words.items() if k.endswith("VGG-16 clock")}
    clocks = {k: w for k, w in words.items() if k.startswith(f"{name(tta_out)},")}
    reading = []
    if len(set(models.values())) > 1:
      reading.append(
        "model-dependent (" + ", ".join(f"{k.split(',')[0]} {w}" for k, w in models.items()) + ")"
      )
    if len(set(clocks.values())) > 1:
      reading.append(
        "clock-dependent (" + ", ".join(f"{k.split(', ')[1]} {w}" for k, w in clocks.items()) + ")"
      )
    held = "; ".join(reading) or f"holds: {words[base]}"
    rows.append(
      [claim, f"{figure:g}x ({src})"]
      + ["-" if e is None else f"{e}: {words[k]}" for k, e in cells.items()]
      + [held]
    )
  heads = [f"{name(tta_out)}, VGG-16 clock"] + ([f"{name(other)}, VGG-16 clock"] if other else [])
  heads += [f"{name(tta_out)}, {v}" for v in list(CLOCK_VARIANTS)[1:]]
  return Table(["claim", "figure"] + heads + ["verdict"], rows)


def beside_table(tta_out: dict, other: dict) -> Table:
  """The verdicts of two ledgers (two models' numerics on the same clocks) claim by claim, at the
  paper's reading and at END_FRACTION of All-Reduce's final, on each claim's first figure: where the
  two models disagree."""
  name = lambda t: t.get("model", "mlp")  # noqa: E731
  rows = []
  for claim, *_ in CLAIMS:
    src, figure = next(iter(FIGURES[claim].items()))
    for kind, label in ((None, "paper's reading"), ("end_time", f"{100 * END_FRACTION:.0f}% of AR's final")):
      got = []
      for t in (tta_out, other):
        e = claim_estimate(t, claim, kind=kind) if kind else claim_estimate(t, claim)
        got.append(None if e is None else (str(e), verdict.judge(e, figure).split(";")[0].split(" (")[0]))
      if None in got:
        continue
      rows.append(
        [claim, f"{figure:g}x ({src})", label, *(f"{g[0]}: {g[1]}" for g in got)]
        + ["agree" if got[0][1] == got[1][1] else "DISAGREE"]
      )
  return Table(["claim", "figure", "target", name(tta_out), name(other), "verdicts"], rows)
