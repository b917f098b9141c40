r"""Soak of the main job's executor (spmd, 8 forced CPU devices): runs completed, aborts, throughput.

  python -m benchmarks.bench_soak --parts=repro,throughput,soak --json_out=results/soak/soak.json

Three parts, each a set of fresh processes of the two builds, `fixed` (what the entry points do: at
most two rounds in flight, collective_guard.CollectiveGuard.admit, and XLA:CPU's pools sized 2 x devices
+ cores, host.size_cpu_pool) and `unfixed` (the build before the fix: NPROC set to the core count, XLA's
own default, and, in the repro, rounds dispatched without bound as the training loop did):
- repro: the provocation (docs/design.md 5.2). The engine's round in a tight loop with no host work
  between rounds, --repro_steps rounds per try, XLA's stuck-collective timeouts cut to 3 s / 6 s so a
  deadlock ends a try in seconds; a C++ abort (exit -6) is a deadlock. --repro_tries per build.
- throughput: the README's main job (CNN1D, 4,000 steps), the builds interleaved, --pairs pairs; the
  training time from each run's summary.json, the ratio fixed / unfixed per pair.
In throughput and soak the `unfixed` runs are the code of --unfixed_rev (the commit before the fix,
checked out in a temporary git worktree), started the same way with XLA's default pools.
- soak: the main job on the MLP, --soak_steps steps (checkpoints every 5,000, evaluation every 10,000),
  --soak_runs runs per build with a CPU hog (a busy process pinned to core 0) beside each; exit 75 is
  the stuck-collective guard, -6 (134 through a shell) XLA's abort.
"""

import atexit
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.timing import print_json

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILDS = ("fixed", "unfixed")
MAIN_JOB = ["--config=configs/default.py"]
SOAK_JOB = [
  "--config=configs/default.py:model=mlp",
  "--config.log_every=100",
  "--config.eval_every=10000",
  "--config.checkpoint_every=5000",
]

REPRO = r"""
import sys, time
import jax, numpy as np
from ripples_jax import algorithms, engine, workload
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.distributed.collective_guard import CollectiveGuard
from ripples_jax.distributed.host import use_cpu_devices
from configs import default
use_cpu_devices(8)
c = default.get_config("model=mlp")
s = workload.build(c)
mesh = make_worker_mesh(8)
schedule = algorithms.make_schedule(c)
state = engine.init_state(s.model, s.optimizer, jax.random.key(0), s.data["x_train"][:1], 8, mesh)
round_fn = engine.make_round_fn(s.model, s.optimizer, mesh, schedule.layouts)
put = lambda a: jax.device_put(a, engine.worker_sharding(mesh))
x = put(np.asarray(s.data["x_train"][:256]).reshape(8, 32, -1))
y = put(np.asarray(s.data["y_train"][:256]).reshape(8, 32))
mask = put(np.ones(8, bool))
guard = CollectiveGuard(0, "", str)
fixed = sys.argv[2] == "fixed"
t0 = time.time()
for i in range(int(sys.argv[1])):
  if fixed:
    guard.admit()  # the fixed build's window; the unfixed build dispatches without bound
  state, loss = round_fn(state, x, y, mask, schedule.round(i).layout_idx)
  guard.dispatched(i + 1, loss, "")
  if i % 500 == 0:
    loss.block_until_ready()
    print("step", i, flush=True)
loss.block_until_ready()
print("done", time.time() - t0, flush=True)
"""


def define_flags() -> None:
  flags.DEFINE_list("parts", ["repro", "throughput", "soak"], "repro, throughput, soak.")
  flags.DEFINE_list("builds", list(BUILDS), "fixed, unfixed.")
  flags.DEFINE_integer("repro_tries", 3, "repro: tries per build.")
  flags.DEFINE_integer("repro_steps", 20000, "repro: rounds per try.")
  flags.DEFINE_integer("pairs", 5, "throughput: interleaved pairs of main-job runs.")
  flags.DEFINE_integer("soak_runs", 5, "soak: runs of the fixed build.")
  flags.DEFINE_integer("unfixed_soak_runs", 2, "soak: runs of the unfixed build.")
  flags.DEFINE_integer("soak_steps", 40000, "soak: steps per run.")
  flags.DEFINE_bool("hog", True, "soak: a busy process pinned to core 0 beside each run.")
  flags.DEFINE_string("unfixed_rev", "9fee42e", "The commit before the fix (throughput and soak).")
  flags.DEFINE_string("json_out", "", "Optional path for the results (JSON).")


def env_of(build: str, extra: dict | None = None) -> dict:
  """The environment of a child: `unfixed` pins XLA's pool at one thread per core (its default)."""
  env = {k: v for k, v in os.environ.items() if k != "NPROC"}
  if build == "unfixed":
    env["NPROC"] = str(os.cpu_count() or 1)
  env.update(extra or {})
  return env


def outcome(code: int) -> str:
  return {0: "completed", 75: "stuck guard (75)", -6: "abort (SIGABRT)", 134: "abort (SIGABRT)"}.get(
    code, f"exit {code}"
  )


def repro(build: str, steps: int) -> dict:
  flags_ = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=3 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=6"
  )
  t = time.perf_counter()
  out = subprocess.run(
    [sys.executable, "-c", REPRO, str(steps), build],
    cwd=ROOT,
    env=env_of(build, {"XLA_FLAGS": flags_, "PYTHONPATH": ROOT}),
    capture_output=True,
    text=True,
  )
  reached = [int(l.split()[1]) for l in out.stdout.splitlines() if l.startswith("step ")]
  return {
    "build": build,
    "outcome": outcome(out.returncode),
    "code": out.returncode,
    "last_step_seen": steps if out.returncode == 0 else (reached[-1] if reached else 0),
    "seconds": round(time.perf_counter() - t, 1),
  }


def unfixed_tree(rev: str) -> str:
  """A temporary git worktree of `rev` (removed at exit)."""
  path = tempfile.mkdtemp(prefix="soak_unfixed_tree_")
  add = ["git", "-C", ROOT, "worktree", "add", "--detach", path, rev]
  subprocess.run(add, check=True, capture_output=True)
  atexit.register(
    lambda: subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], capture_output=True)
  )
  return path


TREES = {"fixed": ROOT}


def train(build: str, args: list, hog: bool = False) -> dict:
  """One run of experiments.train in a fresh folder: outcome, steps recorded, training seconds."""
  workdir = tempfile.mkdtemp(prefix=f"soak_{build}_")
  hogger = None
  if hog:
    hogger = subprocess.Popen(
      [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
  t = time.perf_counter()
  try:
    out = subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *args],
      cwd=TREES[build],
      env=env_of(build),
      capture_output=True,
      text=True,
    )
    wall = time.perf_counter() - t
    steps = 0
    metrics = os.path.join(workdir, "metrics.jsonl")
    curve = []
    if os.path.exists(metrics):
      lines = [json.loads(l) for l in open(metrics).read().splitlines() if l.strip().endswith("}")]
      steps = lines[-1]["step"] if lines else 0
      curve = [(r["step"], r.get("train_loss"), r.get("test_accuracy")) for r in lines]
    summary_path = os.path.join(workdir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    line = [l for l in out.stderr.splitlines() if l.startswith("error:")]
    return {
      "build": build,
      "outcome": outcome(out.returncode),
      "code": out.returncode,
      "steps": steps,
      "train_s": summary.get("time"),
      "wall_s": round(wall, 1),
      "accuracy": summary.get("final_test_accuracy"),
      "error_line": line[0] if line else "",
      "curve_sha": hashlib.sha256(json.dumps(curve).encode()).hexdigest()[:16],  # losses, bit for bit
    }
  finally:
    if hogger is not None:
      hogger.kill()
      hogger.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def summarise(rows: list, key: str) -> dict:
  out = {}
  for build in sorted({r["build"] for r in rows}):
    mine = [r for r in rows if r["build"] == build]
    out[build] = {
      "runs": len(mine),
      "completed": sum(r["code"] == 0 for r in mine),
      "aborts": sum(r["code"] in (-6, 134) for r in mine),
      "stuck_guard": sum(r["code"] == 75 for r in mine),
      key: [r.get(key) for r in mine],
    }
  return out


def main(argv):
  del argv
  result = {"argv": sys.argv[1:], "cores": os.cpu_count()}
  builds = FLAGS.builds
  if "unfixed" in builds and {"throughput", "soak"} & set(FLAGS.parts):
    TREES["unfixed"] = unfixed_tree(FLAGS.unfixed_rev)
    result["unfixed_rev"] = FLAGS.unfixed_rev
  if "repro" in FLAGS.parts:
    rows = [repro(b, FLAGS.repro_steps) for _ in range(FLAGS.repro_tries) for b in builds]
    result["repro"] = {"rows": rows, "summary": summarise(rows, "last_step_seen")}
    print_part("repro", rows, ("build", "outcome", "last_step_seen", "seconds"))
  if "throughput" in FLAGS.parts:
    rows = [train(b, MAIN_JOB) for _ in range(FLAGS.pairs) for b in builds]
    ratios = []
    for i in range(0, len(rows) - 1, 2):
      a, b = rows[i], rows[i + 1]
      if a["train_s"] and b["train_s"] and a["build"] != b["build"]:
        fixed, unfixed = (a, b) if a["build"] == "fixed" else (b, a)
        ratios.append(round(fixed["train_s"] / unfixed["train_s"], 4))
    result["throughput"] = {
      "rows": rows,
      "time_ratio_fixed_over_unfixed": ratios,
      "median_ratio": statistics.median(ratios) if ratios else None,
    }
    print_part("throughput", rows, ("build", "outcome", "steps", "train_s", "accuracy"))
    print(f"training time fixed / unfixed, per pair: {ratios}; median {result['throughput']['median_ratio']}")
    shas = {r["curve_sha"] for r in rows if r["code"] == 0}
    result["throughput"]["losses_bit_identical"] = len(shas) == 1
    print(f"every run's logged losses and accuracies bit for bit the same: {len(shas) == 1}")
  if "soak" in FLAGS.parts:
    order = ["fixed"] * FLAGS.soak_runs if "fixed" in builds else []
    if "unfixed" in builds:  # interleaved while both last
      for k in range(FLAGS.unfixed_soak_runs):
        order.insert(min(2 * k + 1, len(order)), "unfixed")
    job = SOAK_JOB + [f"--config.num_steps={FLAGS.soak_steps}"]
    rows = []
    for b in order:
      rows.append(train(b, job, hog=FLAGS.hog))
      print_part("soak (so far)", rows[-1:], ("build", "outcome", "steps", "wall_s", "error_line"))
    result["soak"] = {"rows": rows, "summary": summarise(rows, "steps")}
    print_part("soak", rows, ("build", "outcome", "steps", "train_s", "wall_s"))
    for build, s in result["soak"]["summary"].items():
      print(
        f"{build}: {s['completed']} of {s['runs']} completed, {s['aborts']} aborts, "
        f"{s['stuck_guard']} guard exits"
      )
  print_json(result, FLAGS.json_out)


def print_part(name: str, rows: list, keys: tuple) -> None:
  print(f"\n{name}")
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(str(r.get(k)) for k in keys), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
