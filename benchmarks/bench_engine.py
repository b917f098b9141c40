r"""Engine overhead: Ripples round vs a conventional data-parallel step, side by side in one process.

  python -m benchmarks.bench_engine        # 8 forced CPU devices, CNN1D and CNN2D, batch 32/worker

A Ripples round (local step + P-Reduce of parameters, layout as data) against a conventional
data-parallel step (gradient all-reduce) of the same model, batch and mesh.
Target: a Ripples static round costs at most 1.15x the data-parallel (gradient all-reduce) step.
"""

import itertools

import jax
import numpy as np
import optax
from absl import app, flags

from benchmarks.timing import Table, compile_seconds, time_interleaved, write_table
from ripples_jax import engine
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.distributed.host import use_cpu_devices
from ripples_jax.models import build_model, num_params
from ripples_jax.schedule.static import allreduce_layouts, hypercube_layouts, static_gg_layouts

FLAGS = flags.FLAGS

CASES = {  # name: (model, input shape, classes)
  "cnn1d/mnist1d": ("cnn1d", (40, 1), 10),
  "cnn2d/cifar-shape": ("cnn2d", (32, 32, 3), 10),
}


def define_flags() -> None:
  flags.DEFINE_integer("cpu_devices", 8, "CPU devices to force on the host.")
  flags.DEFINE_list("cases", ["cnn1d/mnist1d", "cnn2d/cifar-shape"], "Model cases.")
  flags.DEFINE_integer("batch_size", 32, "Per-worker batch.")
  flags.DEFINE_integer("reps", 40, "Timed repetitions per variant.")
  flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def run(cases=("cnn1d/mnist1d", "cnn2d/cifar-shape"), batch_size: int = 32, reps: int = 40) -> Table:
  """One row per (case, step variant): median ms, ratio to the data-parallel step, compile seconds."""
  n = jax.device_count()
  if n < 2:  # P-Reduce between workers needs several; with one device there is nothing to average
    raise SystemExit(
      f"error: bench_engine needs at least 2 devices (one worker per device), found {n} "
      f"{jax.default_backend()} device; on a host, --cpu_devices"
    )
  mesh = make_worker_mesh(n)
  sharding = engine.worker_sharding(mesh)
  opt = optax.sgd(0.01, momentum=0.9)
  rows = []
  for case in cases:
    name, shape, classes = CASES[case]
    model = build_model(name, classes)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(n, batch_size) + shape).astype(np.float32), sharding)
    y = jax.device_put(rng.integers(0, classes, size=(n, batch_size)).astype(np.int32), sharding)
    mask = jax.device_put(np.ones(n, bool), sharding)
    sample = np.zeros((1,) + shape, np.float32)

    def fresh():
      return engine.init_state(model, opt, jax.random.key(0), sample, n, mesh)

    variants, compile_s = {}, {}
    dp = engine.make_grad_allreduce_fn(model, opt, mesh)
    compile_s["dp"] = compile_seconds(dp, fresh(), x, y)
    holder = {"dp": fresh()}

    def call_dp():
      holder["dp"], loss = dp(holder["dp"], x, y)
      return loss

    variants["dp"] = call_dp
    for label, layouts in [
      ("allreduce", allreduce_layouts(n)),
      ("ripples_static", static_gg_layouts(n, 4)),
      ("ripples_hypercube", hypercube_layouts(n)),
    ]:
      fn = engine.make_round_fn(model, opt, mesh, layouts)
      compile_s[label] = compile_seconds(fn, fresh(), x, y, mask, 0)
      holder[label] = fresh()
      cycle = itertools.cycle(range(len(layouts)))

      def call(label=label, fn=fn, cycle=cycle):
        holder[label], loss = fn(holder[label], x, y, mask, next(cycle))
        return loss

      variants[label] = call
    med = time_interleaved(variants, reps=reps, warmup=3)
    p = num_params(jax.tree.map(lambda a: a[0], holder["dp"]["params"]))
    for label in variants:
      rows.append(
        [
          case,
          f"{p / 1e3:.0f}K",
          label,
          f"{1e3 * med[label]:.2f}",
          f"{med[label] / med['dp']:.3f}",
          f"{compile_s[label]:.2f}",
        ]
      )
  header = ["model", "params", "step", "median ms", "ratio to DP step", "compile s"]
  return Table(
    header,
    rows,
    f"{n} {jax.default_backend()} devices, one worker per device, batch "
    f"{batch_size}/worker, median of {reps} interleaved reps",
  )


def main(argv):
  del argv
  use_cpu_devices(FLAGS.cpu_devices)
  write_table(run(FLAGS.cases, FLAGS.batch_size, FLAGS.reps), FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
