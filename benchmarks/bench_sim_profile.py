r"""Where the simulator's time goes: one run under jax.profiler, the Python functions and the XLA ops.

  python -m benchmarks.bench_sim_profile --workers=1024 --steps=20 --out=results/sim_profile

The setting of benchmarks.bench_sim_scale (executor=sim, the MLP, Smart GG, one worker 5x slower,
--per_worker MNIST-1D examples a worker), run in this process under two profilers at once: cProfile
(the Python side: the project's functions by inclusive seconds) and `jax.profiler.trace` without its
Python tracer (which slows a run ~20x), whose XLA:CPU threads record every op. Writes into --out:
profile.md (the run's wall seconds; the project's functions; the XLA ops by seconds summed over the
XLA threads, with their busy share of the wall) and trace/ (TensorBoard's profile plugin or Perfetto).
cProfile slows the Python side somewhat: read shares, and time speed with bench_sim_scale.
"""

import collections
import cProfile
import glob
import os
import pstats
import tempfile
import time

from absl import app, flags

from benchmarks.bench_sim_scale import samples_for
from ripples_jax.tables import markdown_table

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = ("ripples_jax/", "experiments/", "configs/")


def define_flags() -> None:
  flags.DEFINE_integer("workers", 1024, "Workers.")
  flags.DEFINE_integer("steps", 20, "Steps per worker.")
  flags.DEFINE_integer("per_worker", 100, "Training examples per worker.")
  flags.DEFINE_string("algorithm", "ripples_smart", "The algorithm.")
  flags.DEFINE_integer("top", 20, "Rows per table.")
  flags.DEFINE_string("out", "results/sim_profile", "Output folder.")


def summarise_trace(path: str) -> dict:
  """{"programs": {hlo module: s}, "xla": {module/op: s}, "xla_threads": count} of one .xplane.pb: the
  ops' own events on the XLA:CPU threads (the executor's enclosing events and the thread pool's markers
  left out, so nothing counts twice), each named by its program (hlo_module) and op."""
  from jax.profiler import ProfileData

  programs, xla, threads = collections.Counter(), collections.Counter(), set()
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for e in line.events:
        if not e.duration_ns or e.name.startswith(("ThreadpoolListener", "end: ", "ThunkExecutor")):
          continue
        module = dict(e.stats).get("hlo_module", "?")
        programs[module] += e.duration_ns / 1e9
        xla[f"{module}/{e.name}"] += e.duration_ns / 1e9
        threads.add(line.name)
  return {"programs": dict(programs), "xla": dict(xla), "xla_threads": len(threads)}


def project_functions(stats: pstats.Stats) -> dict:
  """{file:line(function): inclusive seconds} of the project's own functions (cProfile's cumulative)."""
  out = {}
  for (file, line, fn), (_, _, _, cumulative, _) in stats.stats.items():
    rel = os.path.relpath(file, ROOT)
    if rel.startswith(PROJECT):
      out[f"{rel}:{line}({fn})"] = cumulative
  return out


def profile(n, steps, per_worker, algorithm, out) -> dict:
  """One simulator run under the profiler; the summary of its trace and its wall seconds."""
  import jax

  from configs import default
  from ripples_jax import run as run_lib

  c = default.get_config(f"algorithm={algorithm},executor=sim,num_workers={n},steps={steps},model=mlp")
  c.hetero.slow_workers, c.hetero.slowdown = (3,), 5.0
  c.mnist1d_samples = samples_for(n, per_worker)
  c.log_every, c.eval_every, c.checkpoint_every = max(steps // 10, 1), steps, 0
  trace_dir = os.path.join(out, "trace")
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  prof = cProfile.Profile()
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir, profiler_options=options):
    prof.runcall(run_lib.train_and_evaluate, c, tempfile.mkdtemp(prefix="sim_profile_"))
  wall = time.perf_counter() - t0
  newest = max(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  python = project_functions(pstats.Stats(prof))
  return {"wall_s": wall, "python": python, **summarise_trace(newest)}


def markdown(p: dict, top: int, setting: str) -> str:
  py = sorted(p["python"].items(), key=lambda kv: -kv[1])[:top]
  xla = sorted(p["xla"].items(), key=lambda kv: -kv[1])[:top]
  programs = sorted(p["programs"].items(), key=lambda kv: -kv[1])[:top]
  busy = sum(p["xla"].values())
  return "\n".join(
    [
      f"# Where the simulator's time goes ({setting})\n",
      f"Wall {p['wall_s']:.1f} s under the profilers (cProfile slows the Python side). XLA ops: "
      f"{busy:.1f} s summed over {p['xla_threads']} XLA threads ({busy / p['wall_s']:.2f} of the wall).\n",
      "## Project functions, inclusive seconds (cProfile's cumulative)\n",
      markdown_table(
        ["function", "s", "share of wall"], [[f, f"{s:.2f}", f"{s / p['wall_s']:.2f}"] for f, s in py]
      ),
      "",
      "## XLA programs, seconds summed over the threads\n",
      markdown_table(
        ["program", "s", "share of XLA"], [[m, f"{t:.2f}", f"{t / busy:.2f}"] for m, t in programs]
      ),
      "",
      "## XLA ops (program/op), seconds summed over the threads\n",
      markdown_table(["op", "s", "share of XLA"], [[o, f"{s:.2f}", f"{s / busy:.2f}"] for o, s in xla]),
      "",
    ]
  )


def main(argv):
  del argv
  os.makedirs(FLAGS.out, exist_ok=True)
  p = profile(FLAGS.workers, FLAGS.steps, FLAGS.per_worker, FLAGS.algorithm, FLAGS.out)
  setting = f"{FLAGS.algorithm}, {FLAGS.workers} workers x {FLAGS.steps} steps, MLP, one worker 5x slower"
  md = markdown(p, FLAGS.top, setting)
  with open(os.path.join(FLAGS.out, "profile.md"), "w") as fh:
    fh.write(md)
  print(md)


if __name__ == "__main__":
  define_flags()
  app.run(main)
