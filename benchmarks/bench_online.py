r"""The online Group Generator in wall-clock time: real runs of the runtime, 4 processes, side by side.

  python -m benchmarks.bench_online --out=results/online --json_out=results/online/online.json

Every row is a real run of experiments.train under the local launcher (MLP on MNIST-1D, every step
padded to `step_time` = 0.1 s, a slow step sleeps (s - 1) x more). Throughput is worker steps per
wall-clock second over the window in which every worker is still running (summary.json's
window_throughput); every ratio is against All-Reduce of the same scenario in the same invocation.

Scenarios: homogeneous (every generator); worker 3 2x / 5x slower; a straggler moving every
`rotate_every` s (s=5); random slowdowns (p=0.2, s=5; AD-PSGD concurrent and blocking); AD-PSGD with a
5x slower *passive* worker (the fast workers' wait); Smart GG with and without checkpoint markers.
For each Smart / All-Reduce pair the simulator, fed the runtime's measured base step time, jitter and
request round trip, predicts the ratio; the table gives both and the error.
"""

import json
import os
import shutil

import numpy as np
from absl import app, flags

from benchmarks.timing import Table
from configs import default as default_config
from ripples_jax import algorithms, analysis, sim, timeline
from ripples_jax.distributed.launcher import launch
from ripples_jax.runtime import ps
from ripples_jax.runtime import trace as trace_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("out", "results/online", "Output folder (tables, PNGs, every run's files).")
  flags.DEFINE_string("json_out", "", "Also write every scenario's numbers here.")
  flags.DEFINE_integer("num_processes", 4, "Worker processes.")
  flags.DEFINE_integer("steps", 150, "Steps per worker (All-Reduce with stragglers: `ar_steps`).")
  flags.DEFINE_integer("ar_steps", 40, "All-Reduce's steps when a straggler sets its pace.")
  flags.DEFINE_float("step_time", 0.1, "Seconds every step is padded to.")
  flags.DEFINE_float("rotate_every", 3.0, "The moving straggler's period (s).")
  flags.DEFINE_integer("ckpt_repeats", 3, "Off/on pairs of the checkpoint scenario.")
  flags.DEFINE_list(
    "scenarios", ["homogeneous", "slow2", "slow5", "moving", "random", "passive", "ckpt"], "Scenarios to run."
  )


def run_one(out_dir, name, n, algorithm, steps, step_time, extra=()) -> dict:
  workdir = os.path.join(
    out_dir, name, algorithm + ("" if not extra else "-" + str(abs(hash(tuple(extra))) % 10**6))
  )
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  args = [
    f"--config=configs/default.py:executor=async,num_workers={n},algorithm={algorithm},model=mlp",
    f"--workdir={workdir}",
    f"--config.num_steps={steps}",
    f"--config.runtime.step_time={step_time}",
    f"--config.eval_every={max(1, steps // 5)}",
    "--config.runtime.checkpoint_every=0",
    f"--config.schedule.workers_per_node={max(1, n // 2)}",
    f"--config.schedule.group_size={min(3, n)}",
    *extra,
  ]
  with open(os.path.join(workdir, "launch.log"), "w") as log:
    code = launch(n, args, out=log, grace_s=10, coordinator=True)  # executor=async: and its coordinator
  if code:
    raise RuntimeError(f"{name}/{algorithm} failed with exit code {code}: see {workdir}/launch.log")
  with open(os.path.join(workdir, "summary.json")) as f:
    r = json.load(f)
  r["traces"] = trace_lib.load_traces(workdir)
  if os.path.exists(os.path.join(workdir, ps.SERVER_TRACE)):  # a parameter server's records
    r["server"] = ps.server_records(workdir)
  print(
    f"{name:>12} {algorithm:>16} {' '.join(extra):>40}: {r['window_throughput']:.2f} worker-steps/s",
    flush=True,
  )
  return r


def predict(n, algorithm, slowdown, slow, step_time, jitter, rtt, alpha, rotate=0.0, random_p=0.0) -> float:
  """The simulator's throughput (worker steps / s) for the runtime's measured step time and jitter,
  request round trip and group time (as the per-message latency `alpha` of a ring all-reduce)."""
  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  config.hetero.slow_workers, config.hetero.slowdown = slow, slowdown
  config.hetero.jitter, config.hetero.random_p, config.hetero.rotate_every = jitter, random_p, rotate
  config.schedule.workers_per_node = max(1, n // 2)
  config.timeline.alpha = alpha
  speed, net = sim.build_clock(config, model_bytes=0.0, base_time=step_time)
  gg = algorithms.make_group_generator(config, np.random.default_rng(0))
  trace = timeline.simulate(
    timeline.ClockSpec(algorithm, speed, net, 4000 * n, time_budget=60.0, gg=gg, rtt=rtt)
  )
  return trace.worker_steps.sum() / trace.end_time


def measured_step(results) -> tuple[float, float]:
  """(median unslowed step time, lognormal sigma of the steps) from the homogeneous All-Reduce run."""
  t = np.array([e["t1"] - e["t0"] for ev in results.values() for e in ev if e["k"] == "step"])
  return float(np.median(t)), float(np.std(np.log(t)))


def fit_alpha(runs) -> float:
  """The ring all-reduce latency that explains the measured group times (trace.ring_latency) over
  several runs: the median over all their groups."""
  return trace_lib.ring_latency(*(r["traces"] for r in runs))


def group_wait(r) -> float:
  """Mean seconds from a group's first member's arrival to its last one's."""
  first, last = {}, {}
  for events in r["traces"].values():
    for e in events:
      if e["k"] == "group":
        first[e["g"]] = min(first.get(e["g"], e["t0"]), e["t0"])
        last[e["g"]] = max(last.get(e["g"], e["t0"]), e["t0"])
  return float(np.mean([last[g] - first[g] for g in first]))


def wait_fraction(r, workers) -> float:
  """Share of their time (to their last step) that `workers` spent waiting, mean."""
  fr = []
  for w in workers:
    end = max(e["t1"] for e in r["traces"][w] if e["k"] == "step")
    fr.append(r["wait_time"][w] / end)
  return float(np.mean(fr))


def waiting_workers(n: int, slow=()) -> list:
  """AD-PSGD's workers that can wait: the active ones (odd ids; a passive worker serves its averages
  from a thread and never waits), less the slow ones."""
  return [w for w in range(1, n, 2) if w not in slow]


def rate_over_time(r, width=0.5):
  steps = np.sort([e["t1"] for ev in r["traces"].values() for e in ev if e["k"] == "step"])
  edges = np.arange(0, steps[-1], width)
  return dict(zip((edges[:-1] + width / 2).tolist(), (np.histogram(steps, edges)[0] / width).tolist()))


def run(
  out_dir="results/online",
  n=4,
  steps=150,
  ar_steps=40,
  step_time=0.1,
  rotate_every=3.0,
  scenarios=("homogeneous", "slow2", "slow5", "moving", "random", "passive", "ckpt"),
  ckpt_repeats=3,
) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  res, rows, out = {}, [], {}
  slow = (n - 1,)

  def go(name, algorithm, extra=(), k=steps):
    res[name, algorithm, tuple(extra)] = run_one(out_dir, name, n, algorithm, k, step_time, extra)
    return res[name, algorithm, tuple(extra)]

  def hetero(s, w=slow):
    return [f"--config.hetero.slow_workers=({w[0]},)", f"--config.hetero.slowdown={s}"]

  if "homogeneous" in scenarios:
    ar = go("homogeneous", "allreduce")
    base, jitter = measured_step({w: ev for w, ev in ar["traces"].items()})
    out["measured_step"] = {"median_s": base, "log_sigma": jitter}
    for a in ("ripples_static", "ripples_random", "ripples_division", "ripples_smart"):
      r = go("homogeneous", a)
      rows.append(["homogeneous", a, r["window_throughput"] / ar["window_throughput"], 1.0, None, r])
      if (
        a == "ripples_random"
      ):  # docs/design.md 3.7: a random group of 3 waits ~2/3 of a step for its partners
        out["random_wait_per_group_steps"] = group_wait(r) / base
  else:
    base, jitter = step_time, 0.0
  rtts = []
  for s in (2, 5):
    if f"slow{s}" not in scenarios:
      continue
    ar = go(f"slow{s}", "allreduce", hetero(s), ar_steps)
    for a in ("ripples_smart", "adpsgd"):
      r = go(f"slow{s}", a, hetero(s))
      rows.append(
        [
          f"worker {slow[0]} {s}x slower",
          a,
          r["window_throughput"] / ar["window_throughput"],
          analysis.limit(n, s),
          (s, slow, 0.0, 0.0),
          r,
        ]
      )
  if "moving" in scenarios:
    mv = [*hetero(5, (0,)), f"--config.hetero.rotate_every={rotate_every}"]
    ar = go("moving", "allreduce", mv, ar_steps)
    r = go("moving", "ripples_smart", mv, 2 * steps)
    rows.append(
      [
        f"moving, s=5 every {rotate_every:g} s",
        "ripples_smart",
        r["window_throughput"] / ar["window_throughput"],
        analysis.limit(n, 5),
        (5, (0,), rotate_every, 0.0),
        r,
      ]
    )
    analysis.lines(
      {"ripples_smart": rate_over_time(r), "allreduce": rate_over_time(ar)},
      os.path.join(out_dir, "moving_straggler.png"),
      f"{n} processes, the 5x straggler moves every {rotate_every:g} s (dotted)",
      "wall-clock time (s)",
      "worker steps / s (0.5 s bins)",
      vlines=np.arange(rotate_every, 120, rotate_every),
    )
  if "random" in scenarios:
    rp = ["--config.hetero.random_p=0.2", "--config.hetero.slowdown=5"]
    ar = go("random", "allreduce", rp, ar_steps)
    for a, extra in (
      ("ripples_smart", ()),
      ("adpsgd", ()),
      ("adpsgd", ("--config.runtime.adpsgd_passive=blocking",)),
    ):
      r = go("random", a, [*rp, *extra])
      rows.append(
        [
          "random p=0.2, s=5",
          a + (" (blocking)" if extra else ""),
          r["window_throughput"] / ar["window_throughput"],
          None,
          None if extra else (5, (), 0.0, 0.2),
          r,
        ]
      )
  if "passive" in scenarios:
    out["passive_5x"] = {}
    for mode in ("concurrent", "blocking"):
      r = go("passive", "adpsgd", [*hetero(5, (0,)), f"--config.runtime.adpsgd_passive={mode}"])
      out["passive_5x"][mode] = {
        "fast_wait_fraction": wait_fraction(r, waiting_workers(n, slow=(0,))),
        "throughput": r["window_throughput"],
      }
  if "ckpt" in scenarios:
    # Off and on alternate, `ckpt_repeats` times each: run-to-run noise here is a few percent.
    every = max(1, int(round(3.0 / step_time)))  # a marker about every 3 s
    offs, ons = [], []
    for i in range(ckpt_repeats):
      offs.append(go(f"ckpt{i}", "ripples_smart")["window_throughput"])
      on = go(
        f"ckpt{i}",
        "ripples_smart",
        [f"--config.runtime.checkpoint_every={every}", "--config.runtime.checkpoint_keep=100"],
      )
      ons.append(on["window_throughput"])
    costs = [1 - b / a for a, b in zip(offs, ons)]
    out["checkpoint"] = {
      "every_steps": every,
      "off": offs,
      "on": ons,
      "cost_per_pair": costs,
      "cost_median": float(np.median(costs)),
      "cost_of_medians": 1 - float(np.median(ons)) / float(np.median(offs)),
      "markers_saved": len(os.listdir(os.path.join(on["workdir"], "ckpt", "0"))),
    }
  for r in [x for x in res.values() if x["request_rtt"]["count"]]:
    rtts.append(r["request_rtt"]["median_ms"] / 1e3)
  rtt = float(np.median(rtts)) if rtts else 0.0
  out["request_rtt_median_s"] = rtt
  homogeneous = [
    v for k, v in res.items() if k[0] == "homogeneous" and k[1] in ("allreduce", "ripples_smart")
  ]
  alpha = fit_alpha(homogeneous or list(res.values()))
  out["fitted_alpha_s"] = alpha
  out["request_rtt"] = {
    f"{k[0]}/{k[1]}": v["request_rtt"] for k, v in res.items() if v["request_rtt"]["count"]
  }
  table_rows = []
  for name, a, ratio, limit, sim_args, r in rows:
    pred = None
    if sim_args is not None:
      s, sl, rot, p = sim_args
      pred = predict(n, a, s, sl, base, jitter, rtt, alpha, rot, p) / predict(
        n, "allreduce", s, sl, base, jitter, rtt, alpha, rot, p
      )
    elif name == "homogeneous":
      pred = predict(n, a, 1.0, (), base, jitter, rtt, alpha) / predict(
        n, "allreduce", 1.0, (), base, jitter, rtt, alpha
      )
    err = None if pred is None else (pred - ratio) / ratio
    out.setdefault("ratios", {})[f"{name}/{a}"] = {
      "measured": ratio,
      "limit": limit,
      "predicted": pred,
      "error": err,
      "requests": r["requests"],
      "wait_fraction": float(np.sum(r["wait_time"]) / (n * r["time"])),
    }
    table_rows.append(
      [
        name,
        a,
        f"{ratio:.2f}x",
        f"{limit:.2f}x" if limit else "-",
        f"{ratio / limit:.2f}" if limit else "-",
        f"{pred:.2f}x" if pred else "-",
        f"{100 * err:+.1f}%" if err is not None else "-",
      ]
    )
  md = Table(
    [
      "scenario",
      "algorithm",
      "measured vs All-Reduce",
      "limit",
      "of limit",
      "simulator predicts",
      "prediction error",
    ],
    table_rows,
  )
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(str(md) + "\n")
  print(md)
  print(json.dumps({k: v for k, v in out.items() if k != "ratios"}, indent=1))
  return out


def main(argv):
  del argv
  out = run(
    FLAGS.out,
    FLAGS.num_processes,
    FLAGS.steps,
    FLAGS.ar_steps,
    FLAGS.step_time,
    FLAGS.rotate_every,
    FLAGS.scenarios,
    FLAGS.ckpt_repeats,
  )
  if FLAGS.json_out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
