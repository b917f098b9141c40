"""Regenerates every table and figure of WORKSPACE.md: one step per result, each a real entry point.

Each step runs `python -m <entry point> <flags>` in its own process (its own XLA_FLAGS and memory), in
a work folder; the tables (*.md) and figures (*.png) it leaves are copied to RESULTS/<step>/, beside a
provenance.json (the command, the machine, the date, the wall time) and the entry point's stdout.
`quick` runs the same steps at small sizes (the pipeline end to end in minutes, not the numbers); the
runtime's two variant measurements run with --all only.
"""
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np

from ripples_jax import collectives
from ripples_jax.benchmark import markdown_table

# name: (entry point, flags of the full run, flags of the quick run). {work} is the step's work folder.
STEPS = {
    "collectives": ("experiments.bench_collectives", ["--reps=60", "--out={work}/table.md"],
                    ["--sizes=65536", "--reps=5", "--out={work}/table.md"]),
    "engine": ("experiments.bench_engine", ["--reps=40", "--out={work}/table.md"],
               ["--cases=cnn1d/mnist1d", "--reps=3", "--out={work}/table.md"]),
    "spectral": ("experiments.spectral", ["--out={work}", "--samples=2000"],
                 ["--out={work}", "--samples=100"]),
    "timeline": ("experiments.bench_timeline", ["--out={work}/table.md"],
                 ["--workers=16", "--steps=100", "--out={work}/table.md"]),
    "ripples_sim": ("experiments.reproduce_ripples", ["--out_dir={work}"],
                    ["--out_dir={work}", "--workers=8", "--steps=40", "--target_accuracy=0.3",
                     "--algorithms=allreduce,ripples_static,ripples_smart,adpsgd,ps_sync"]),
    "ripples_sim_vgg": ("experiments.reproduce_ripples",
                        ["--model_bytes=5.28e8", "--compute_time=0.3", "--bandwidth=7e9", "--out_dir={work}"],
                        ["--model_bytes=5.28e8", "--compute_time=0.3", "--bandwidth=7e9", "--out_dir={work}",
                         "--workers=8", "--steps=20", "--target_accuracy=0.2",
                         "--algorithms=allreduce,ripples_smart,adpsgd,ps_sync"]),
    "runtime": ("experiments.bench_runtime", ["--out={work}"],
                ["--out={work}", "--steps=30", "--step_time=0.05", "--slowdowns=1,5",
                 "--algorithms=allreduce,ripples_smart,adpsgd", "--target=0.2"]),
    # Variants of the runtime measurement (slow worker passive for AD-PSGD; 8 processes): --all only.
    "runtime_slow0": ("experiments.bench_runtime",
                      ["--out={work}", "--slow_worker=0", "--slowdowns=5",
                       "--algorithms=allreduce,ripples_smart,adpsgd"], None),
    "runtime8": ("experiments.bench_runtime",
                 ["--out={work}", "--num_processes=8", "--slowdowns=1,5",
                  "--algorithms=allreduce,ripples_smart,adpsgd", "--steps=100"], None),
    "dsp": ("experiments.reproduce_dsp", ["--out_dir={work}"],
            ["--out_dir={work}", "--epochs=2", "--sweep_epochs=1", "--datasets=mnist1d", "--stages=2",
             "--sweep_delays=0,1", "--sweep_lrs=0.02"]),
    "bench_dsp": ("experiments.bench_dsp", ["--out={work}/table.md"],
                  ["--cases=cnn1d/mnist1d", "--stages=2", "--reps=3", "--out={work}/table.md"]),
    "checkpoint": ("experiments.bench_checkpoint", ["--reps=2", "--out={work}/table.md"],
                   ["--reps=1", "--steps=200", "--out={work}/table.md"]),
}


def machine() -> dict:
  return {"node": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
          "python": platform.python_version(), "system": platform.platform()}


def run_step(name: str, quick: bool, results: str, work_root: str) -> dict:
  module, full, small = STEPS[name]
  work = os.path.abspath(os.path.join(work_root, name))
  shutil.rmtree(work, ignore_errors=True)
  os.makedirs(work)
  args = [a.format(work=work) for a in (small if quick else full)]
  cmd = [sys.executable, "-m", module, *args]
  t = time.time()
  out = subprocess.run(cmd, capture_output=True, text=True)
  seconds = time.time() - t
  dest = os.path.join(results, name)
  os.makedirs(dest, exist_ok=True)
  with open(os.path.join(dest, "stdout.txt"), "w") as f:
    f.write(out.stdout)
  if out.returncode:
    with open(os.path.join(dest, "stderr.txt"), "w") as f:
      f.write(out.stderr)
    raise RuntimeError(f"{name}: `{' '.join(cmd)}` failed ({out.returncode}); see {dest}/stderr.txt")
  for path in glob.glob(os.path.join(work, "*.md")) + glob.glob(os.path.join(work, "*.png")):
    shutil.copy(path, dest)
  prov = {"step": name, "command": f"python -m {module} " + " ".join(args), "quick": quick,
          "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": round(seconds, 1), "machine": machine()}
  with open(os.path.join(dest, "provenance.json"), "w") as f:
    json.dump(prov, f, indent=2)
  return prov


def run(names, quick: bool, results: str, work_root: str) -> str:
  for name in names:
    if quick and STEPS[name][2] is None:
      print(f"[reproduce] {name}: --all only", flush=True)
      continue
    print(f"[reproduce] {name} ...", flush=True)
    p = run_step(name, quick, results, work_root)
    print(f"[reproduce] {name}: {p['seconds']:.0f} s", flush=True)
  return write_index(results)


def write_index(results: str) -> str:
  """results/index.md from every step's provenance.json (steps run at different times included)."""
  rows = []
  for name in STEPS:
    path = os.path.join(results, name, "provenance.json")
    if os.path.exists(path):
      with open(path) as f:
        p = json.load(f)
      rows.append([name, f"`{p['command']}`", "quick" if p["quick"] else "full", p["date"],
                   f"{p['seconds']:.0f}", f"{p['machine']['node']}, {p['machine']['cpus']} CPUs"])
  table = markdown_table(["step", "command", "size", "date", "seconds", "machine"], rows)
  with open(os.path.join(results, "index.md"), "w") as f:
    f.write("Every result regenerated by `python -m experiments.reproduce` (one row per step, from its "
            "provenance.json).\n\n" + table + "\n")
  return table


# -- spectral gap against group size and Group Generator (DESIGN 3.2) --------------------------------


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
  from ripples_jax.schedule.static import hypercube_layouts, static_gg_layouts
  rng = np.random.default_rng(seed)
  sizes = (2, 3, 4, 8)
  out = {"random GG (one group per round)": {}, "group division (a partition per round)": {},
         "static GG (node layout, g workers per node)": {}, "hypercube (radix g)": {}}
  for g in sizes:
    out["random GG (one group per round)"][g] = symmetric_gap(
        [collectives.mixing_matrix([rng.choice(n, g, replace=False)], n) for _ in range(samples)])
    out["group division (a partition per round)"][g] = symmetric_gap(
        [collectives.mixing_matrix(np.split(rng.permutation(n), range(g, n, g)), n) for _ in range(samples)])
    static = static_gg_layouts(n, g)
    out["static GG (node layout, g workers per node)"][g] = collectives.spectral_gap(
        [collectives.mixing_matrix(layout, n) for layout in static])
    if g in (2, 4):  # n = 16 is a power of 2 and of 4
      out["hypercube (radix g)"][g] = collectives.spectral_gap(
          [collectives.mixing_matrix(layout, n) for layout in hypercube_layouts(n, g)])
  return out


def spectral_figure(out_dir: str, n: int = 16, samples: int = 2000) -> str:
  from ripples_jax import plots
  table = spectral_table(n, samples)
  plots.lines(table, os.path.join(out_dir, "spectral_gap.png"),
              f"Spectral gap of one round's averaging, {n} workers (higher mixes faster)",
              "group size g", "spectral gap 1 - lambda_2(E[W^T W])")
  sizes = sorted({g for row in table.values() for g in row})
  rows = [[name] + [f"{row[g]:.3f}" if g in row else "-" for g in sizes] for name, row in table.items()]
  md = markdown_table(["generator"] + [f"g={g}" for g in sizes], rows)
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(md + "\n")
  return md
