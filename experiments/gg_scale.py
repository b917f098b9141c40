r"""Every Group Generator as the workers grow: spectral gap, conflicts and time to accuracy (simulator).

  python -m experiments.gg_scale --workers=64,256,1024 --seeds=0,1,2 --parallel=2 --out_dir=results/gg_scale
  python -m experiments.gg_scale --workers=4096 --seeds=0,1,2 --out_dir=results/gg_scale_4096  # ~14 GiB a run
  python -m experiments.gg_scale --workers=16 --seeds=0 --steps=5 --out_dir=/tmp/gg   # quick

The setting of benchmarks.bench_sim_scale: executor=sim, the MLP, one worker (id 3) 5x slower, MNIST-1D
generated so that every worker has --per_worker training examples, --steps steps a worker, the averaged
model evaluated every --eval_every steps. Each (workers, algorithm, seed) is one run of the simulator in
a process of its own, started with ripples_jax.allocator's tunables (--parallel at once, one core each;
one alone keeps every core; the simulator's work is mostly single-threaded XLA batched matmuls, docs/
design.md 3.9); runs.json holds every run (written after each, a rerun skips what
it holds, so sizes can be added one command at a time) and table.md / table.json / gg_scale.png the
summary over seeds: median [min, max].

- Time to target: the virtual seconds at the first evaluation of the averaged model at or above
  --target (censored at the run's end where a seed misses: m of n reached).
- Conflicts: groups generated while one of their members still had a group pending (the Group
  Buffer's count, Trace.conflicts, summed over members), per 1,000 worker-steps.
- Spectral gap: of the run's own averaging. M = the mean over the run's group averages of W_e (the
  projection that averages group e, identity elsewhere); `gap_per_sweep` = (n / mean group size) x
  (1 - lambda_2(M)): the first-order gap of one sweep in which every worker averages once on average,
  comparable across n (Random GG with groups of g gives (n/g)(g-1)/(n-1) ~ (g-1)/g). All-Reduce is 1.
"""

import concurrent.futures
import json
import multiprocessing
import os
import tempfile

import numpy as np
from absl import app, flags

from ripples_jax import allocator
from ripples_jax.runlog import write_json
from ripples_jax.tables import markdown_table, spread

ALGORITHMS = ("allreduce", "ripples_static", "ripples_random", "ripples_division", "ripples_smart", "moshpit")
FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_list("workers", ["64", "256", "1024"], "Worker counts.")
  flags.DEFINE_list("algorithms", list(ALGORITHMS), "All-Reduce (the reference) and the Group Generators.")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  flags.DEFINE_integer("steps", 100, "Steps per worker.")
  flags.DEFINE_integer("per_worker", 100, "Training examples per worker (MNIST-1D generated to fit).")
  flags.DEFINE_integer("eval_every", 10, "Steps between evaluations of the averaged model.")
  flags.DEFINE_float("target", 0.5, "Target test accuracy of the averaged model.")
  flags.DEFINE_integer("parallel", 1, "Runs at once, each in its own process on one core.")
  flags.DEFINE_string("out_dir", "results/gg_scale", "Output folder.")


def samples_for(n: int, per_worker: int) -> int:
  """MNIST-1D examples for n workers x per_worker training examples (80% trains), at least 5000."""
  return max(5000, -(-n * per_worker * 5 // 4))


def sweep_gap(events, n: int) -> dict:
  """The spectral gap of the run's averaging (module docstring), from the clock's AVG events."""
  import scipy.sparse as sp
  import scipy.sparse.linalg as sla

  from ripples_jax import timeline

  groups = [tuple(e[2]) for e in events if e[1] == timeline.AVG and e[2] is not None and len(e[2]) > 1]
  if not groups:
    return {"groups": 0, "mean_group_size": 0.0, "gap_per_event": 0.0, "gap_per_sweep": 0.0}
  rows, cols, vals = [], [], []
  for g in groups:
    k = len(g)
    idx = np.asarray(g)
    rows.append(np.repeat(idx, k))
    cols.append(np.tile(idx, k))
    vals.append(np.full(k * k, 1.0 / k))
    rows.append(idx)
    cols.append(idx)
    vals.append(np.full(k, -1.0))  # W_e - I: the averaging replaces the identity on the group
  delta = sp.coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))
  m = sp.identity(n, format="csr") + delta.tocsr() / len(groups)
  ones = np.ones(n) / np.sqrt(n)
  # lambda_2 of the symmetric M: the top eigenvalue once the all-ones eigenvector (eigenvalue 1) is
  # deflated away.
  op = sla.LinearOperator((n, n), matvec=lambda v: m @ v - ones * (ones @ v), dtype=np.float64)
  lam2 = float(sla.eigsh(op, k=1, which="LA", return_eigenvectors=False, tol=1e-8)[0]) if n > 2 else 0.0
  # M is doubly stochastic and symmetric, so lambda_2 <= 1; a run whose groups leave the workers
  # disconnected has lambda_2 = 1 up to rounding, and its gap is 0, never -eps.
  lam2 = min(lam2, 1.0)
  size = float(np.mean([len(g) for g in groups]))
  return {
    "groups": len(groups),
    "mean_group_size": size,
    "gap_per_event": 1.0 - lam2,
    "gap_per_sweep": (n / size) * (1.0 - lam2),
  }


def _pin(cores) -> None:
  import multiprocessing.util

  core = cores.get()
  os.sched_setaffinity(0, core)
  # Each run is a process of its own (max_tasks_per_child=1): the core goes back when this one exits.
  multiprocessing.util.Finalize(None, cores.put, args=(core,), exitpriority=10)
  from ripples_jax.distributed.host import quiet_library_logs

  quiet_library_logs()


def run_one(n, algorithm, seed, steps, per_worker, eval_every, target, workdir) -> dict:
  """One simulator run (in a pool process); its figures."""
  from configs import default
  from ripples_jax import run as run_lib
  from ripples_jax import sim

  c = default.get_config(f"algorithm={algorithm},executor=sim,num_workers={n},steps={steps},model=mlp")
  c.hetero.slow_workers, c.hetero.slowdown = (3,), 5.0
  c.mnist1d_samples = samples_for(n, per_worker)
  c.eval_every = c.log_every = eval_every
  c.checkpoint_every = 0
  c.target_accuracy, c.seed = target, seed
  run_lib.validate(c)
  summary, trace = sim.simulate_and_train(c, workdir)
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  curve = [[r["time"], r["test_accuracy"]] for r in records if r.get("test_accuracy") is not None]
  worker_steps = int(np.sum(trace.worker_steps))
  gap = (
    {"gap_per_sweep": 1.0, "gap_per_event": 1.0} if algorithm == "allreduce" else sweep_gap(trace.events, n)
  )
  return {
    "time_to_target": summary["time_to_target"],
    "end_time": float(trace.end_time),
    "final_test_accuracy": curve[-1][1],
    "curve": curve,
    "conflicts_per_1000_steps": 1000.0 * float(np.sum(trace.conflicts)) / max(worker_steps, 1),
    "worker_steps": worker_steps,
    **gap,
  }


def summarise(runs: dict, workers, algorithms, seeds) -> dict:
  """Per (n, algorithm): every figure's spread over the seeds; time to target censored at the end."""
  out = {}
  for n in workers:
    for a in algorithms:
      rs = [runs[f"n{n}_{a}_seed{s}"] for s in seeds]
      tt = [r["time_to_target"] if r["time_to_target"] is not None else r["end_time"] for r in rs]
      ar = [runs[f"n{n}_allreduce_seed{s}"] for s in seeds] if "allreduce" in algorithms else None
      e = {
        "reached": sum(r["time_to_target"] is not None for r in rs),
        "of": len(rs),
        "time_to_target": spread(tt),
        "final_test_accuracy": spread([r["final_test_accuracy"] for r in rs]),
        "conflicts_per_1000_steps": spread([r["conflicts_per_1000_steps"] for r in rs]),
        "gap_per_sweep": spread([r["gap_per_sweep"] for r in rs]),
      }
      if ar and all(r["time_to_target"] is not None for r in ar):
        e["speedup_vs_allreduce"] = spread([b["time_to_target"] / t for b, t in zip(ar, tt)])
      out[f"n{n}_{a}"] = e
  return out


def markdown(summary, workers, algorithms, seeds, setting) -> str:
  f = lambda s, fmt: f"{fmt(s['median'])} [{fmt(s['min'])}, {fmt(s['max'])}]"
  rows = []
  for n in workers:
    for a in algorithms:
      e = summary[f"n{n}_{a}"]
      sp = e.get("speedup_vs_allreduce")
      rows.append(
        [
          n,
          a,
          f"{e['reached']}/{e['of']}",
          f(e["time_to_target"], lambda x: f"{x:.2f}"),
          "-" if sp is None else f(sp, lambda x: f"{x:.2f}x"),
          f(e["final_test_accuracy"], lambda x: f"{100 * x:.1f}"),
          f(e["conflicts_per_1000_steps"], lambda x: f"{x:.1f}"),
          f(e["gap_per_sweep"], lambda x: f"{x:.3f}"),
        ]
      )
  cols = ["workers", "algorithm", "reached", "time to target (virtual s)", "speedup vs All-Reduce"]
  cols += ["final test acc %", "conflicts / 1000 steps", "gap per sweep"]
  head = f"# Group Generators at scale ({setting})\n\nSeeds {list(seeds)}; median [min, max] over them.\n"
  return head + "\n" + markdown_table(cols, rows) + "\n"


def plot(summary, workers, algorithms, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  keys = [
    ("time_to_target", "time to target (virtual s)"),
    ("conflicts_per_1000_steps", "conflicts / 1000 steps"),
  ]
  keys.append(("gap_per_sweep", "spectral gap per sweep"))
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for ax, (key, label) in zip(axes, keys):
    for a in algorithms:
      med = [summary[f"n{n}_{a}"][key]["median"] for n in workers]
      lo = [summary[f"n{n}_{a}"][key]["min"] for n in workers]
      hi = [summary[f"n{n}_{a}"][key]["max"] for n in workers]
      ax.errorbar(
        workers, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], marker="o", capsize=3, label=a
      )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_all(workers, algorithms, seeds, steps, per_worker, eval_every, target, parallel, out_dir) -> dict:
  """Every run not yet in out_dir/runs.json, `parallel` at once; returns runs.json's dict."""
  from ripples_jax.data import mnist1d

  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "runs.json")
  runs = json.load(open(path)) if os.path.exists(path) else {}
  for n in workers:  # generated once here, not by two runs at once
    mnist1d.load_mnist1d(None, num_samples=samples_for(n, per_worker))
  tmp = tempfile.mkdtemp(prefix="gg_scale_")
  todo = [(n, a, s) for n in workers for s in seeds for a in algorithms if f"n{n}_{a}_seed{s}" not in runs]
  # Spawned children start a fresh python: they take the allocator's tunables (docs/design.md 5.1),
  # which make a 4,096-worker run 1.7-2.5x faster; the numbers they compute do not depend on them.
  os.environ.update(allocator.env())
  ctx = multiprocessing.get_context("spawn")
  cores = ctx.Queue()
  usable = sorted(os.sched_getaffinity(0))
  for i in range(parallel):  # one core each; one run alone keeps every core (XLA uses two threads)
    cores.put({usable[i % len(usable)]} if parallel > 1 else set(usable))
  # One process per run: under the tunables a process keeps its heap, so a second 4,096-worker run in
  # the same process would start from the first one's peak.
  with concurrent.futures.ProcessPoolExecutor(
    parallel, mp_context=ctx, initializer=_pin, initargs=(cores,), max_tasks_per_child=1
  ) as ex:
    futures = {
      ex.submit(
        run_one, n, a, s, steps, per_worker, eval_every, target, os.path.join(tmp, f"n{n}_{a}_{s}")
      ): (n, a, s)
      for n, a, s in todo
    }
    for fut in concurrent.futures.as_completed(futures):
      n, a, s = futures[fut]
      r = fut.result()
      runs[f"n{n}_{a}_seed{s}"] = {"n": n, "algorithm": a, "seed": s, "steps": steps, "target": target, **r}
      write_json(path, runs)
      print(
        f"n{n} {a} seed {s}: to {target:g} at {r['time_to_target']} virtual s, final "
        f"{100 * r['final_test_accuracy']:.1f}%, conflicts/1000 {r['conflicts_per_1000_steps']:.1f}, "
        f"gap/sweep {r['gap_per_sweep']:.3f}",
        flush=True,
      )
  return runs


def main(argv):
  del argv
  workers, seeds = [int(n) for n in FLAGS.workers], [int(s) for s in FLAGS.seeds]
  algorithms = list(FLAGS.algorithms)
  runs = run_all(
    workers,
    algorithms,
    seeds,
    FLAGS.steps,
    FLAGS.per_worker,
    FLAGS.eval_every,
    FLAGS.target,
    FLAGS.parallel,
    FLAGS.out_dir,
  )
  # The tables cover every worker count runs.json holds whole (all algorithms and seeds asked for).
  held = sorted({r["n"] for r in runs.values()})
  held = [n for n in held if all(f"n{n}_{a}_seed{s}" in runs for a in algorithms for s in seeds)]
  setting = (
    f"simulator, MLP, one worker 5x slower, {FLAGS.per_worker} MNIST-1D examples a worker, {FLAGS.steps} "
    f"steps a worker, target {100 * FLAGS.target:g}% test accuracy of the averaged model"
  )
  summary = summarise(runs, held, algorithms, seeds)
  md = markdown(summary, held, algorithms, seeds, setting)
  with open(os.path.join(FLAGS.out_dir, "table.md"), "w") as fh:
    fh.write(md)
  write_json(
    os.path.join(FLAGS.out_dir, "table.json"), {"setting": setting, "seeds": seeds, "results": summary}
  )
  plot(summary, held, algorithms, os.path.join(FLAGS.out_dir, "gg_scale.png"))
  print(md)


if __name__ == "__main__":
  define_flags()
  app.run(main)
