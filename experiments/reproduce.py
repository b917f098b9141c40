r"""Regenerates the tables and figures of its steps (STEPS: the collectives, the engine, the spectral
gap, the timeline, the simulated Ripples studies, the 4- and 8-process runtime, DSP, checkpoints, the
claims ledger on the VGG-16 clock and the online Group Generator). The later studies (the ledger's
other scenarios, second model and real-process rows, the pipelines, churn, scale) each have their own
command, in their results/ folder's README and provenance.json.

  python -m experiments.reproduce --all              # the numbers (~1 h on 2 cores, estimated)
  python -m experiments.reproduce --quick            # every step at small sizes (under 10 min)
  python -m experiments.reproduce --steps=spectral,runtime
  python -m experiments.reproduce --index_only       # only rewrite results/index.md

Each step (one per result) runs `python -m <entry point> <flags>` in its own process (its own XLA_FLAGS
and memory), in a work folder under --work; the tables (*.md) and figures (*.png) it leaves are copied to
--results/<step>/, beside a provenance.json (the command, the machine, the date, the wall time) and the
entry point's stdout. `--quick` runs the same steps at small sizes (the pipeline end to end in minutes,
not the numbers); the runtime's two variant measurements run with --all only.
"""

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time

from absl import app, flags

from ripples_jax.tables import markdown_table

# name: (entry point, flags of the full run, flags of the quick run). {work} is the step's work folder.
STEPS = {
  "collectives": (
    "benchmarks.bench_collectives",
    ["--reps=60", "--out={work}/table.md"],
    ["--sizes=65536", "--reps=5", "--out={work}/table.md"],
  ),
  "engine": (
    "benchmarks.bench_engine",
    ["--reps=40", "--out={work}/table.md"],
    ["--cases=cnn1d/mnist1d", "--reps=3", "--out={work}/table.md"],
  ),
  "spectral": ("experiments.spectral", ["--out={work}", "--samples=2000"], ["--out={work}", "--samples=100"]),
  "timeline": (
    "benchmarks.bench_timeline",
    ["--out={work}/table.md"],
    ["--workers=16", "--steps=100", "--out={work}/table.md"],
  ),
  "ripples_sim": (
    "experiments.reproduce_ripples",
    ["--out_dir={work}"],
    [
      "--out_dir={work}",
      "--workers=8",
      "--steps=40",
      "--target_accuracy=0.3",
      "--algorithms=allreduce,ripples_static,ripples_smart,adpsgd,ps_sync",
    ],
  ),
  "ripples_sim_vgg": (
    "experiments.reproduce_ripples",
    ["--model_bytes=5.28e8", "--compute_time=0.3", "--bandwidth=7e9", "--out_dir={work}"],
    [
      "--model_bytes=5.28e8",
      "--compute_time=0.3",
      "--bandwidth=7e9",
      "--out_dir={work}",
      "--workers=8",
      "--steps=20",
      "--target_accuracy=0.2",
      "--algorithms=allreduce,ripples_smart,adpsgd,ps_sync",
    ],
  ),
  "runtime": (
    "benchmarks.bench_runtime",
    ["--out={work}"],
    [
      "--out={work}",
      "--steps=30",
      "--step_time=0.05",
      "--slowdowns=1,5",
      "--algorithms=allreduce,ripples_smart,adpsgd",
      "--target=0.2",
    ],
  ),
  # Variants of the runtime measurement (slow worker passive for AD-PSGD; 8 processes): --all only.
  "runtime_slow0": (
    "benchmarks.bench_runtime",
    ["--out={work}", "--slow_worker=0", "--slowdowns=5", "--algorithms=allreduce,ripples_smart,adpsgd"],
    None,
  ),
  "runtime8": (
    "benchmarks.bench_runtime",
    [
      "--out={work}",
      "--num_processes=8",
      "--slowdowns=1,5",
      "--algorithms=allreduce,ripples_smart,adpsgd",
      "--steps=100",
    ],
    None,
  ),
  "dsp": (
    "experiments.reproduce_dsp",
    ["--out_dir={work}"],
    [
      "--out_dir={work}",
      "--epochs=2",
      "--sweep_epochs=1",
      "--datasets=mnist1d",
      "--stages=2",
      "--sweep_delays=0,1",
      "--sweep_lrs=0.02",
    ],
  ),
  "bench_dsp": (
    "benchmarks.bench_dsp",
    ["--out={work}/table.md"],
    ["--cases=cnn1d/mnist1d", "--stages=2", "--reps=3", "--out={work}/table.md"],
  ),
  "checkpoint": (
    "benchmarks.bench_checkpoint",
    ["--reps=2", "--out={work}/table.md"],
    ["--reps=1", "--steps=200", "--out={work}/table.md"],
  ),
  # The claims ledger (throughput on the clock; --all adds the VGG-16 clock's time-to-accuracy runs,
  # step sizes tuned, 5 seeds: ~30 minutes; every scenario: experiments.ledger --tta, hours).
  "ledger": (
    "experiments.ledger",
    ["--out={work}", "--seeds=5", "--workers=2"]
    + [f"--tta_scenario={s}, VGG-16 clock" for s in ("homogeneous", "5x straggler", "2x straggler")],
    ["--out={work}", "--seeds=1", "--steps=100"],
  ),
  # The online Group Generator in the runtime, every scenario: --all only (~17 minutes).
  "online": ("benchmarks.bench_online", ["--out={work}"], None),
}


def machine() -> dict:
  return {
    "node": platform.node(),
    "machine": platform.machine(),
    "cpus": os.cpu_count(),
    "python": platform.python_version(),
    "system": platform.platform(),
  }


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
  prov = {
    "step": name,
    "command": f"python -m {module} " + " ".join(args),
    "quick": quick,
    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "seconds": round(seconds, 1),
    "machine": machine(),
  }
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


HEADER = ["folder", "status", "command", "size", "date", "commit", "seconds", "machine", "how it was made"]
KEPT = ("status", "how it was made")  # written by hand into index.md: a rewrite keeps them


def read_index(path: str) -> tuple[str, dict]:
  """(the text above the table, {folder: {column: cell}}) of an index.md; ("", {}) without one."""
  if not os.path.exists(path):
    return "", {}
  lines = open(path).read().splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith("| folder |")), None)
  if start is None:
    return "\n".join(lines).strip(), {}
  head = [c.strip() for c in lines[start].strip("|").split("|")]
  rows = {}
  for line in lines[start + 2 :]:
    if not line.startswith("|"):
      break
    cells = [c.strip() for c in line.strip("|").split(" | ")]
    rows[cells[0]] = dict(zip(head, cells))
  return "\n".join(lines[:start]).strip(), rows


def write_index(results: str) -> str:
  """results/index.md: one row per results/<folder>/ (sorted), its columns from its provenance.json but
  `status` and `how it was made`, which a rewrite keeps from the index.md already there (a new folder:
  current; regenerated by experiments.reproduce, or its provenance's `reconstructed` note), as it keeps
  the text above the table.

  Every folder counts, not only STEPS. Absolute paths under the working directory (the repository
  root) are written relative to it.
  """
  root = os.path.abspath(os.getcwd()) + os.sep
  intro, old = read_index(os.path.join(results, "index.md"))

  def rel(text):
    return text.replace(root, "") if isinstance(text, str) else text

  rows = []
  for folder in sorted(os.listdir(results)):
    if not os.path.isdir(os.path.join(results, folder)):
      continue
    kept = old.get(folder, {})
    path = os.path.join(results, folder, "provenance.json")
    if not os.path.exists(path):
      rows.append([folder, kept.get("status", "-"), "-", "-", "-", "-", "-", "-", "no provenance.json"])
      continue
    with open(path) as f:
      p = json.load(f)
    command = f"`{rel(p['command'])}`" if p.get("command") else "not recorded"
    if p.get("also"):
      command += f" + {len(p['also'])} more (provenance.json)"
    seconds = p.get("seconds")
    seconds = "-" if seconds is None else ("~" if p.get("seconds_approx") else "") + f"{seconds:.0f}"
    m = p.get("machine")
    if m:
      machine = f"{m.get('node', '?')}, {m.get('cpus', '?')} CPUs"
      if m.get("accelerator") not in (None, "none"):
        machine += f", {m['accelerator']}"
    else:
      machine = "-"
    if p.get("reconstructed"):
      note = "reconstructed " + p["reconstructed"] + ("; see provenance.json's note" if p.get("note") else "")
    else:
      note = "regenerated by experiments.reproduce"
    size = "quick" if p.get("quick") else "full"
    rows.append(
      [folder, kept.get("status", "current"), command, size, p.get("date") or "-", p.get("commit") or "-"]
      + [seconds, machine, kept.get("how it was made", note)]
    )
  table = markdown_table(HEADER, rows)
  intro = intro or (
    f"Every folder of {results}/, from its provenance.json, with its status (current, or superseded by "
    "which folder) and how it was made. Rewrite with `python -m experiments.reproduce --index_only`: "
    "it keeps the status and how-made columns."
  )
  with open(os.path.join(results, "index.md"), "w") as f:
    f.write(intro + "\n\n" + table + "\n")
  return table


_ALL = flags.DEFINE_bool("all", False, "Every step at full size.")
_QUICK = flags.DEFINE_bool("quick", False, "Every step at small size.")
_STEPS = flags.DEFINE_list("steps", [], f"Some steps only: {', '.join(STEPS)}.")
_RESULTS = flags.DEFINE_string(
  "results", None, "Tables and figures (default: results, or runs/reproduce_quick/results with --quick)."
)
_WORK = flags.DEFINE_string("work", "runs/reproduce", "Work folder for the runs.")
_INDEX_ONLY = flags.DEFINE_bool(
  "index_only",
  False,
  "Only rewrite <results>/index.md from the provenance.json files already there; run nothing.",
)


def main(argv):
  del argv
  if _INDEX_ONLY.value:
    print(write_index(_RESULTS.value or ("runs/reproduce_quick/results" if _QUICK.value else "results")))
    return
  names = _STEPS.value or list(STEPS)
  unknown = [s for s in names if s not in STEPS]
  if unknown or not (_ALL.value or _QUICK.value or _STEPS.value):
    sys.exit(
      f"error: --steps: {unknown} is not allowed: any of {', '.join(STEPS)}"
      if unknown
      else "error: pass --all, --quick or --steps"
    )
  quick = _QUICK.value
  results = _RESULTS.value or ("runs/reproduce_quick/results" if quick else "results")
  print(run(names, quick, results, _WORK.value + ("_quick" if quick else "")))


if __name__ == "__main__":
  app.run(main)
