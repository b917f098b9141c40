"""Analysis of results: PNG figures a person can read (titled axes with units, legends), the throughput
limit with one slow worker, and the spectral gap of each Group Generator against group size."""

import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"compute": "#4C72B0", "wait": "#DD8452", "comm": "#55A868"}


def accuracy_vs_time(
  panels: dict, path: str, title: str, xlabel: str | dict = "virtual time (s)", target: float | None = None
) -> None:
  """panels: {panel title: {label: [(seconds, test accuracy), ...]}}; one subplot per panel, its x label
  `xlabel` (or xlabel[panel title]); `target` (a fraction) is drawn as a dashed line."""
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
  for ax, (name, curves) in zip(axes[0], panels.items()):
    for label, points in curves.items():
      if points:
        t, acc = zip(*points)
        ax.plot(t, [100 * a for a in acc], marker=".", label=label)
    if target is not None:
      ax.axhline(100 * target, color="gray", linestyle="--", linewidth=1, label=f"target {100 * target:.0f}%")
    ax.set_title(name)
    ax.set_xlabel(xlabel[name] if isinstance(xlabel, dict) else xlabel)
    ax.set_ylabel("test accuracy of the averaged model (%)")
    ax.grid(alpha=0.3)
  # One legend when every panel holds the same curves, else one per panel.
  same = len({tuple(curves) for curves in panels.values()}) == 1
  for ax in axes[0][-1:] if same else axes[0]:
    ax.legend(fontsize=8, loc="lower right")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# A chart of more steps than this per worker is unreadable as bars: gantt draws a window of WINDOW_STEPS
# of them and, below, every worker's utilisation over the whole run.
LONG_STEPS = 300
WINDOW_STEPS = 40
UTIL_BINS = 120


def utilisation(intervals, num_workers: int, t_end: float, bins: int = UTIL_BINS) -> dict:
  """{kind: [num_workers, bins] array}: the fraction of each of `bins` equal spans of [0, t_end] each
  worker spent in each kind (timeline.Trace.intervals' (worker, kind, t0, t1))."""
  edges = np.linspace(0.0, t_end, bins + 1)
  out = {k: np.zeros((num_workers, bins)) for k in COLORS}
  width = t_end / bins
  for w, kind, t0, t1 in intervals:
    lo, hi = max(t0, 0.0), min(t1, t_end)
    if hi <= lo or kind not in out:
      continue
    first, last = int(lo // width), min(int(hi // width), bins - 1)
    for b in range(first, last + 1):  # the overlap with each span it touches
      out[kind][w, b] += max(0.0, min(hi, edges[b + 1]) - max(lo, edges[b]))
  return {k: v / width for k, v in out.items()}


def _bars(ax, intervals, num_workers, t_max):
  for kind, color in COLORS.items():
    bars = {}
    for w, k, t0, t1 in intervals:
      if k == kind and (t_max is None or t0 < t_max):
        bars.setdefault(w, []).append((t0, min(t1, t_max or t1) - t0))
    for w, spans in bars.items():
      ax.broken_barh(spans, (w - 0.4, 0.8), color=color, label=kind if w == min(bars) else None)
  ax.set_yticks(range(num_workers))
  ax.set_ylabel("worker")
  ax.invert_yaxis()
  if t_max:
    ax.set_xlim(0, t_max)
  handles, labels = ax.get_legend_handles_labels()
  ax.legend(handles, labels, loc="upper right", fontsize=8, ncol=3)


def gantt_window(intervals) -> float | None:
  """The window a long run's chart shows (seconds from 0 that hold WINDOW_STEPS steps of the worker
  that did most), or None when every worker's steps fit as bars (at most LONG_STEPS)."""
  starts = {}
  for w, kind, t0, _ in intervals:
    if kind == "compute":
      starts.setdefault(w, []).append(t0)
  if not starts or max(len(v) for v in starts.values()) <= LONG_STEPS:
    return None
  busiest = sorted(max(starts.values(), key=len))
  return busiest[WINDOW_STEPS]


def gantt(
  intervals,
  num_workers: int,
  path: str,
  title: str,
  t_max: float | None = None,
  xlabel: str = "virtual time (s)",
) -> int:
  """One row per worker: compute, waiting for a group, communicating (timeline.Trace.intervals).

  A long run (gantt_window; no t_max given) gets two panels: the bars of its first seconds, and each
  worker's share of time computing over the whole run (a heat map, UTIL_BINS spans). Returns the
  number of panels drawn."""
  window = gantt_window(intervals) if t_max is None else None
  if window is None:
    fig, ax = plt.subplots(figsize=(11, 0.32 * num_workers + 1.5))
    _bars(ax, intervals, num_workers, t_max)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    panels = 1
  else:
    t_end = max(t1 for _, _, _, t1 in intervals)
    fig, (ax, heat) = plt.subplots(2, 1, figsize=(11, 2 * (0.32 * num_workers + 1.2) + 0.6))
    _bars(ax, intervals, num_workers, window)
    ax.set_xlabel(f"{xlabel}: the first {window:.3g} s of {t_end:.4g} s")
    ax.set_title(title)
    share = utilisation(intervals, num_workers, t_end)["compute"]
    image = heat.imshow(
      share, aspect="auto", cmap="viridis", vmin=0, vmax=1, extent=(0, t_end, num_workers - 0.5, -0.5)
    )
    heat.set_yticks(range(num_workers))
    heat.set_ylabel("worker")
    heat.set_xlabel(f"{xlabel} (the whole run, {UTIL_BINS} spans)")
    heat.set_title("share of each span spent computing", fontsize=10)
    fig.colorbar(image, ax=heat, fraction=0.03, pad=0.01)
    panels = 2
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return panels


def lines(series: dict, path: str, title: str, xlabel: str, ylabel: str, vlines=()) -> None:
  """series: {label: {x: y}}; one line with markers per label; dotted vertical lines at `vlines`."""
  fig, ax = plt.subplots(figsize=(9.5, 4.2))
  for label, points in series.items():
    if points:
      x = sorted(points)
      ax.plot(x, [points[k] for k in x], marker="o", markersize=3, label=label)
  x_max = max((max(p) for p in series.values() if p), default=0)
  for v in vlines:
    if v <= x_max:
      ax.axvline(v, color="gray", linestyle=":", linewidth=1)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a line
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def dsp_figures(out_dir, curves, datasets, stage_counts, methods, losses, delays, lrs) -> None:
  """accuracy_vs_epoch.png, accuracy_vs_modeled_time.png (one panel per (dataset, K); curves[ds, K, method]:
  [(epoch, modeled time, test accuracy)]) and staleness_lr_sweep.png (losses[delay, lr]: final loss)."""
  panels = [(ds, K) for ds in datasets for K in stage_counts]
  for xi, xlabel, fname in (
    (0, "epoch", "accuracy_vs_epoch.png"),
    (1, "modeled time (s, measured stage times)", "accuracy_vs_modeled_time.png"),
  ):
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (ds, K) in zip(axes[0], panels):
      for m in methods:
        pts = curves[ds, K, m]
        if pts:
          ax.plot([p[xi] for p in pts], [100 * p[2] for p in pts], marker=".", label=m)
      ax.set_title(f"{ds}, K={K}")
      ax.set_xlabel(xlabel)
      ax.set_ylabel("test accuracy (%)")
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, fname), dpi=110)
    plt.close(fig)
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for d in delays:
    ax.plot(lrs, [losses[d, lr] for lr in lrs], marker="o", label=f"delay d={d}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("learning rate")
  ax.set_ylabel("final training loss")
  ax.set_title("DSP, K=4: final loss against staleness and step size")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "staleness_lr_sweep.png"), dpi=110)
  plt.close(fig)


def limit(n: int, s: float) -> float:
  """Best throughput relative to All-Reduce when one of n workers is s x slower: (s (n - 1) + 1) / n."""
  return (s * (n - 1) + 1) / n


# -- spectral gap against group size and Group Generator (docs/design.md 3.2) --------------------------------


def symmetric_gap(matrices) -> float:
  """Spectral gap of E[W^T W] for a generator whose distribution is invariant under relabelling the
  workers (Random GG, Group Division): then E[W^T W] = a I + b 1 1^T exactly, so lambda_2 = a, read
  from the Monte Carlo mean's diagonal and off-diagonal averages (the top eigenvalue of a noisy sample
  mean would be biased upward)."""
  m = np.mean([w.T @ w for w in matrices], axis=0)
  n = len(m)
  diag, off = np.trace(m) / n, (m.sum() - np.trace(m)) / (n * (n - 1))
  return float(1.0 - (diag - off))


def spectral_table(n: int = 16, samples: int = 2000, seed: int = 0):
  """{generator: {group size: spectral gap 1 - lambda_2(E[W^T W])}}: Monte Carlo for the random
  generators, exact over one period for the periodic ones."""
  from ripples_jax import collectives  # here: the figures alone need no jax
  from ripples_jax.schedule.static import hypercube_layouts, static_gg_layouts

  rng = np.random.default_rng(seed)
  sizes = (2, 3, 4, 8)
  out = {
    "random GG (one group per round)": {},
    "group division (a partition per round)": {},
    "static GG (node layout, g workers per node)": {},
    "hypercube (radix g)": {},
  }
  for g in sizes:
    out["random GG (one group per round)"][g] = symmetric_gap(
      [collectives.mixing_matrix([rng.choice(n, g, replace=False)], n) for _ in range(samples)]
    )
    out["group division (a partition per round)"][g] = symmetric_gap(
      [collectives.mixing_matrix(np.split(rng.permutation(n), range(g, n, g)), n) for _ in range(samples)]
    )
    static = static_gg_layouts(n, g)
    out["static GG (node layout, g workers per node)"][g] = collectives.spectral_gap(
      [collectives.mixing_matrix(layout, n) for layout in static]
    )
    if g in (2, 4):  # n = 16 is a power of 2 and of 4
      out["hypercube (radix g)"][g] = collectives.spectral_gap(
        [collectives.mixing_matrix(layout, n) for layout in hypercube_layouts(n, g)]
      )
  return out


def spectral_gap_figure(table: dict, path: str, n: int) -> None:
  """The spectral_table as one line per generator against group size."""
  lines(
    table,
    path,
    f"Spectral gap of one round's averaging, {n} workers (higher mixes faster)",
    "group size g",
    "spectral gap 1 - lambda_2(E[W^T W])",
  )


# -- how a run's groups mix, window by window (experiments/group_mix.py) -----------------------------


def group_windows(groups, windows, num_workers: int) -> list[dict]:
  """groups: [(t, members)], a run's averages in order (its trace's AVG events); windows: [(lo, hi)]
  in the same seconds. Per window: the groups that start in [lo, hi), how many distinct member sets
  they are, the most repeated set and its count, and the connected components of the graph they draw
  over the workers (1: every model can reach every other within the window; a worker in no group is
  a component of its own). A generator that locks into a fixed partition shows few distinct sets and
  as many components as the partition has groups."""
  from collections import Counter

  out = []
  for lo, hi in windows:
    sets = [tuple(sorted(int(m) for m in g)) for t, g in groups if lo <= t < hi]
    parent = list(range(num_workers))

    def root(x):
      while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
      return x

    for members in sets:
      for m in members[1:]:
        parent[root(m)] = root(members[0])
    top, top_n = Counter(sets).most_common(1)[0] if sets else ((), 0)
    out.append(
      {
        "window": (lo, hi),
        "groups": len(sets),
        "distinct": len(set(sets)),
        "top": top,
        "top_count": top_n,
        "components": len({root(w) for w in range(num_workers)}),
      }
    )
  return out


# -- comparing runs (experiments/compare.py) --------------------------------------------------------


def read_run(workdir: str, target: float | None = None) -> dict:
  """A run's summary.json and its accuracy curve [(time, test accuracy)] from metrics.jsonl; time to
  `target` (default: the config's target_accuracy) is the first evaluation at or above it, None when
  no evaluation reached it. Raises FileNotFoundError naming the missing file."""
  import json

  paths = {name: os.path.join(workdir, name) for name in ("summary.json", "metrics.jsonl", "config.json")}
  for name in ("summary.json", "metrics.jsonl"):
    if not os.path.exists(paths[name]):
      raise FileNotFoundError(f"{paths[name]}: no such file (a finished run's folder holds it)")
  with open(paths["summary.json"]) as f:
    summary = json.load(f)
  curve = []
  with open(paths["metrics.jsonl"]) as f:
    for line in f:
      r = json.loads(line)
      if r.get("test_accuracy") is not None:
        curve.append((r["time"], r["test_accuracy"]))
  if target is None and os.path.exists(paths["config.json"]):
    with open(paths["config.json"]) as f:
      target = json.load(f).get("target_accuracy") or None
  reached = [i for i, (_, acc) in enumerate(curve) if target is not None and acc >= target]
  name = summary.get("algorithm") or summary.get("method")
  return {
    "name": name,
    "workdir": workdir,
    "summary": summary,
    "curve": curve,
    "target": target,
    "time_to_target": curve[reached[0]][0] if reached else None,
    # Reached at the first evaluation: the crossing is somewhere before it, not at it.
    "crossed": bool(reached) and reached[0] > 0,
  }


def compare_table(runs: list[dict]) -> str:
  """One row per run: name, workers, steps, final accuracy, time (wall s or virtual s), evaluations,
  time to target."""
  from ripples_jax.tables import markdown_table

  rows = []
  for r in runs:
    s = r["summary"]
    unit = "virtual s" if s.get("executor") == "sim" else "s"
    ttt = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.2f} {unit}"
    if r["time_to_target"] is not None and not r["crossed"]:
      ttt = f"<= {ttt} (at the first evaluation)"
    target = "-" if r["target"] is None else f"{100 * r['target']:.0f}%"
    rows.append(
      [
        r["name"],
        s.get("num_workers", s.get("num_stages")),
        s.get("num_steps", s.get("num_batches")),
        f"{100 * s['final_test_accuracy']:.2f}%",
        f"{s['time']:.2f} {unit}",
        len(r["curve"]),
        target,
        ttt,
      ]
    )
  head = ["run", "workers", "steps", "test accuracy", "time", "evaluations", "target", "time to target"]
  return markdown_table(head, rows)


def compare_plot(runs: list[dict], path: str) -> None:
  """Accuracy against time (virtual or wall seconds) of every run, one panel per time unit."""
  panels = {}
  for r in runs:
    unit = "virtual time (s)" if r["summary"].get("executor") == "sim" else "wall time (s)"
    label = f"{r['name']} ({os.path.basename(os.path.normpath(r['workdir']))})"
    panels.setdefault(unit, {})[label] = r["curve"]
  targets = {r["target"] for r in runs}
  target = targets.pop() if len(targets) == 1 else None
  accuracy_vs_time(
    panels, path, "accuracy against time", xlabel={unit: unit for unit in panels}, target=target
  )
