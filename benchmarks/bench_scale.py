r"""The runtime at 16 and 32 processes: group set-up, and Ripples against All-Reduce, side by side.

  python -m benchmarks.bench_scale --json_out=results/scale/scale.json

Every row is a real run of experiments.train under the local launcher (MLP on MNIST-1D, every step padded
to --step_time so that the processes leave this machine's cores unsaturated: each row reports its CPU
use, the children's CPU seconds over wall seconds x cores). Parts (--parts):
  setup      Random GG and Smart GG at 16 and 32 processes, homogeneous: P-Reduce programs compiled per
             worker (runtime.preduce=auto picks pairs there: n-1 programs, all compiled before the run),
             and the seconds of their first runs (connection set-up) as a share of the run's time.
  straggler  16 processes, worker 3 5x slower: Smart GG over All-Reduce (the limit is 4.75: All-Reduce
             runs at the slow worker's pace, Smart GG at (15 + 1/5) / 16 of full speed); homogeneous:
             Static GG and Group Division over All-Reduce.
  predict    8 and 16 processes (--predict_sizes), All-Reduce and Smart GG (--predict_algorithms: any
             algorithm the runtime runs, Moshpit's grid rounds included), homogeneous and with worker 3
             5x slower: the simulator's throughput fed with each run's measured costs (predicted)
             against the run's. Parameter servers (ps_sync, ps_async): the server's link is fed its
             measured seconds per transfer and ps_async's requests their measured delivery
             (ps_transfer_s, ps_latency_s: from server.jsonl, runtime/ps.py).
Throughput is summary.json's window_throughput (worker steps per second while every worker runs).
"""

import dataclasses
import os

import numpy as np
from absl import app, flags

from benchmarks.bench_online import run_one
from benchmarks.timing import print_json

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("out", "/tmp/bench_scale", "Every run's folder goes here.")
  flags.DEFINE_string("json_out", "", "Also write the figures here.")
  flags.DEFINE_float("step_time", 0.5, "Seconds every step is padded to.")
  flags.DEFINE_integer("steps", 100, "Steps per worker (All-Reduce with the straggler: ar_steps).")
  flags.DEFINE_integer("ar_steps", 24, "All-Reduce's steps when the straggler sets its pace.")
  flags.DEFINE_list("parts", ["setup", "straggler", "predict"], "Parts to run.")
  flags.DEFINE_list("sizes", ["16", "32"], "Process counts of the setup part.")
  flags.DEFINE_list("predict_sizes", ["8", "16"], "Process counts of the predict part.")
  flags.DEFINE_list("predict_algorithms", ["allreduce", "ripples_smart"], "Algorithms of the predict part.")


def measured(out_dir, name, n, algorithm, steps, step_time, extra=()) -> dict:
  """One run, with its CPU use (children's CPU seconds over wall seconds x cores)."""
  import time

  before, t0 = os.times(), time.monotonic()
  r = run_one(out_dir, name, n, algorithm, steps, step_time, extra)
  after, wall = os.times(), time.monotonic() - t0
  cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
  r["cpu_use"] = cpu / (wall * (os.cpu_count() or 1))
  r["launch_wall_s"] = wall
  return r


def setup_row(r, n) -> dict:
  return {
    "preduce": r.get("preduce"),
    "group_compiles_max": max(r["group_compiles"]),
    "group_setup_share": r["group_setup_share"],
    "group_setup_s_max": max(r["group_setup_s"]),
    "time_s": r["time"],
    "throughput": r["window_throughput"],
    "cpu_use": r["cpu_use"],
    "authority": r.get("authority"),
    "bound": n - 1,
  }


def fed_simulation(
  r, n: int, algorithm: str, slowdown: float = 1.0, slow=(), leave=(), total=None, detect=0.0, inner_steps=1
):
  """The simulator fed with what a run measured: its unslowed step time and jitter, request round trip,
  the authority's service time per request (busy seconds / requests; its queueing is the simulator's),
  and the group time as a ring latency (bench_online.fit_alpha). Set-up is not charged: the pairs are
  compiled and connected before the run (its group_setup_s is 0). leave: (worker, t_leave, t_rejoin)
  membership events (docs/design.md 3.10), noticed `detect` seconds after the death. Returns (its
  timeline.Trace, what it was fed)."""
  from benchmarks.bench_online import fit_alpha
  from configs import default as default_config
  from ripples_jax import algorithms, sim, timeline

  slow_ids = set(slow)
  t = np.array(
    [
      e["t1"] - e["t0"]
      for w, ev in r["traces"].items()
      for e in ev
      if e["k"] == "step" and int(w) not in slow_ids
    ]
  )
  base, jitter = float(np.median(t)), float(np.std(np.log(t)))
  rtt = (r.get("request_rtt") or {}).get("median_ms") or 0.0
  authority = r.get("authority") or {}
  service = authority.get("busy_s", 0.0) / authority["requests"] if authority.get("requests") else 0.0
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.hetero.slow_workers, config.hetero.slowdown, config.hetero.jitter = tuple(slow), slowdown, jitter
  config.schedule.workers_per_node = max(1, n // 2)
  config.timeline.alpha = fit_alpha([r])
  model_bytes, ps_transfer = 0.0, None
  if algorithm in ("ps_sync", "ps_async"):  # the server's link: its measured seconds per transfer
    ps_transfer = ps_transfer_s(r["server"], algorithm)
    config.timeline.alpha, config.timeline.ps_bandwidth, model_bytes = 0.0, 1.0 / ps_transfer, 1.0
  speed, net = sim.build_clock(config, model_bytes=model_bytes, base_time=base)
  latency = ps_latency_s(r) if algorithm == "ps_async" else 0.0
  net = dataclasses.replace(net, ps_latency=latency)
  gg = algorithms.make_group_generator(config, np.random.default_rng(0))
  cost = timeline.AuthorityCost(service=service)
  trace = timeline.simulate(
    timeline.ClockSpec(
      algorithm,
      speed,
      net,
      total or 4000 * n,
      time_budget=120.0,
      gg=gg,
      rtt=rtt / 1e3,
      server=cost,
      leave=tuple(leave),
      detect=detect,
      inner_steps=inner_steps,  # DiLoCo's H (the run's diloco.inner_steps)
    )
  )
  fed = {
    "base_s": base,
    "jitter": jitter,
    "rtt_ms": rtt,
    "service_ms": 1e3 * service,
    "alpha_s": config.timeline.alpha,
    **({"ps_transfer_s": ps_transfer, "ps_latency_s": latency} if ps_transfer is not None else {}),
  }
  return trace, fed


def ps_transfer_s(server: list, algorithm: str) -> float:
  """A parameter server's seconds per transfer on its link, from server.jsonl: ps_async, half of a
  request's service (push, apply, pull: the server is busy for all of it, and the clock's FIFO link
  books a push and a pull per request); ps_sync, one pull (the pushes include each worker's lateness)."""
  if algorithm == "ps_async":
    return float(np.median([(e["t1"] - e["t0"]) / 2 for e in server if e["k"] == "apply"]))
  return float(np.median([e["pull_s"] for e in server if e["k"] == "round"]))


def ps_latency_s(r) -> float:
  """ps_async: a request's delivery, the median over requests of the worker's exchange (its trace's
  group: post, delivery, the server's queue and service, return) less the server's time from the
  request's arrival to its pull's end (server.jsonl: t1 - got). Both are differences on one process's
  clock each: the processes' clocks differ by the start barrier's release skew (milliseconds)."""
  took = {
    (int(w), e["g"]): e["t1"] - e["t0"] for w, ev in r["traces"].items() for e in ev if e["k"] == "group"
  }
  return float(
    np.median(
      [
        took[(e["w"], f"ps/{e['w']}/{e['s']}")] - (e["t1"] - e["got"])
        for e in r["server"]
        if e["k"] == "apply"
      ]
    )
  )


def predicted(r, n: int, algorithm: str, slowdown: float = 1.0, slow=(), inner_steps=1) -> dict:
  """The simulator's throughput for a run, fed with what that run measured (fed_simulation)."""
  trace, fed = fed_simulation(r, n, algorithm, slowdown, slow, inner_steps=inner_steps)
  throughput = trace.worker_steps.sum() / trace.end_time
  # The window (while every worker runs) ends at the first worker's last step; DiLoCo's fast workers
  # reach theirs a round before the run ends (they wait in the last All-Reduce), so for it the measured
  # figure is the whole run's, as the simulator's end_time includes that last outer step.
  measured = r["throughput"] if algorithm == "diloco" else r["window_throughput"]
  return {
    "measured": measured,
    "predicted": float(throughput),
    "error": float(throughput / measured - 1),
    "fed": fed,
  }


def run(
  out_dir,
  parts,
  sizes,
  step_time,
  steps,
  ar_steps,
  predict_sizes=(8, 16),
  predict_algorithms=("allreduce", "ripples_smart"),
) -> dict:
  out = {"step_time": step_time, "steps": steps, "cores": os.cpu_count()}
  if "setup" in parts:
    out["setup"] = {}
    for n in sizes:
      for algorithm in ("ripples_random", "ripples_smart"):
        r = measured(out_dir, f"setup{n}", n, algorithm, steps, step_time)
        out["setup"][f"{n}/{algorithm}"] = setup_row(r, n)
  if "straggler" in parts:
    n, rows = 16, {}
    slow = ["--config.hetero.slow_workers=(3,)", "--config.hetero.slowdown=5"]
    ar5 = measured(out_dir, "slow5", n, "allreduce", ar_steps, step_time, slow)
    smart5 = measured(out_dir, "slow5", n, "ripples_smart", steps, step_time, slow)
    limit = (n - 1 + 1 / 5) / n * 5  # Smart GG's rate (15 full + 1 at 1/5) over All-Reduce's (16 at 1/5)
    rows["slow5/ripples_smart"] = {
      "ratio": smart5["window_throughput"] / ar5["window_throughput"],
      "limit": limit,
      "cpu_use": [ar5["cpu_use"], smart5["cpu_use"]],
    }
    rows["slow5/ripples_smart"]["of_limit"] = rows["slow5/ripples_smart"]["ratio"] / limit
    ar = measured(out_dir, "homogeneous", n, "allreduce", steps, step_time)
    for algorithm in ("ripples_static", "ripples_division"):
      r = measured(out_dir, "homogeneous", n, algorithm, steps, step_time)
      rows[f"homogeneous/{algorithm}"] = {
        "ratio": r["window_throughput"] / ar["window_throughput"],
        "cpu_use": [ar["cpu_use"], r["cpu_use"]],
        "group_compiles_max": max(r["group_compiles"]),
      }
    out["straggler"] = rows
  if "predict" in parts:
    rows, slow = {}, ["--config.hetero.slow_workers=(3,)", "--config.hetero.slowdown=5"]
    paced = ("allreduce", "diloco", "ps_sync")  # the straggler sets their pace: ar_steps
    cases = [("homogeneous", a, (), steps, 1.0) for a in predict_algorithms]
    cases += [("slow5", a, slow, ar_steps if a in paced else steps, 5.0) for a in predict_algorithms]
    H = 8  # DiLoCo's inner steps in these runs
    for n in predict_sizes:
      for name, algorithm, extra, k, s in cases:
        h = [f"--config.diloco.inner_steps={H}"] if algorithm == "diloco" else []
        r = measured(out_dir, f"predict{n}-{name}", n, algorithm, k, step_time, [*extra, *h])
        p = predicted(r, n, algorithm, s, (3,) if s > 1 else (), inner_steps=H if h else 1)
        rows[f"{n}/{name}/{algorithm}"] = {**p, "cpu_use": r["cpu_use"]}
    out["predict"] = rows
  return out


def main(argv):
  del argv
  result = run(
    FLAGS.out,
    FLAGS.parts,
    [int(s) for s in FLAGS.sizes],
    FLAGS.step_time,
    FLAGS.steps,
    FLAGS.ar_steps,
    [int(s) for s in FLAGS.predict_sizes],
    FLAGS.predict_algorithms,
  )
  print_json(result, FLAGS.json_out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
