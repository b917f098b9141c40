"""Engine overhead: a Ripples round (local step + P-Reduce of parameters, layout as data) against a
conventional data-parallel step (gradient all-reduce) of the same model, batch and mesh."""
import itertools

import jax
import numpy as np
import optax

from ripples_jax import engine
from ripples_jax.benchmark import compile_seconds, markdown_table, time_interleaved
from ripples_jax.collectives import make_worker_mesh
from ripples_jax.models import build_model, num_params
from ripples_jax.schedule.static import allreduce_layouts, hypercube_layouts, static_gg_layouts

CASES = {  # name: (model, input shape, classes)
    "cnn1d/mnist1d": ("cnn1d", (40, 1), 10),
    "cnn2d/cifar-shape": ("cnn2d", (32, 32, 3), 10),
}


def run(cases: list[str], batch_size: int, reps: int) -> str:
  n = jax.device_count()
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
    for label, layouts in [("allreduce", allreduce_layouts(n)), ("ripples_static", static_gg_layouts(n, 4)),
                           ("ripples_hypercube", hypercube_layouts(n))]:
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
      rows.append([case, f"{p / 1e3:.0f}K", label, f"{1e3 * med[label]:.2f}",
                   f"{med[label] / med['dp']:.3f}", f"{compile_s[label]:.2f}"])
  header = ["model", "params", "step", "median ms", "ratio to DP step", "compile s"]
  return (f"{n} {jax.default_backend()} devices, one worker per device, batch {batch_size}/worker, "
          f"median of {reps} interleaved reps\n\n" + markdown_table(header, rows))
