r"""P-Reduce step time for every layout the schedules emit, against a full all-reduce of the same bytes.

  python -m benchmarks.bench_collectives            # 8 forced CPU devices, 64K and 1M float32/device

Prints a markdown table: median seconds per call (interleaved reps in one process), the ratio to the
full all-reduce, and compile seconds. 'direct' is one compiled program per layout (p_reduce's cache);
'switched' is the engine's form: one program over all layouts with the layout index as data.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.timing import Table, compile_seconds, time_interleaved, write_table
from ripples_jax import collectives as C
from ripples_jax.distributed.host import use_cpu_devices
from ripples_jax.schedule.static import allreduce_layouts, hypercube_layouts, static_gg_layouts

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer("cpu_devices", 8, "CPU devices to force on the host.")
  flags.DEFINE_list("sizes", ["65536", "1048576"], "float32 elements per device.")
  flags.DEFINE_integer("reps", 40, "Timed repetitions per variant.")
  flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def schedule_layouts(n: int) -> dict[str, C.Layout]:
  """Distinct layouts of the All-Reduce, Static GG (4 per node) and hypercube schedules."""
  out = {"allreduce": allreduce_layouts(n)[0]}
  names = ["gg_inter0", "gg_intra", "gg_inter1"]
  for name, layout in zip(names, static_gg_layouts(n, 4)[:3]):
    out[name] = layout
  for k, layout in enumerate(hypercube_layouts(n)):
    out[f"hypercube{k}"] = layout
  return out


def run(sizes=(65536, 1048576), reps: int = 40) -> Table:
  """One row per (size, layout) on every device jax sees, plus the compile time of the switched program."""
  devices = jax.devices()
  n = len(devices)
  mesh = C.make_worker_mesh(n)
  layouts = schedule_layouts(n)
  distinct = tuple(dict.fromkeys(layouts.values()))
  w = P(C.WORKER_AXIS)

  def shard_jit(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(w, P()), out_specs=w, check_vma=False))

  full = shard_jit(lambda b, i: lax.psum(b, C.WORKER_AXIS) / n)
  switched = shard_jit(lambda b, i: C.switched_grouped_mean_in_shard(b, distinct, i))
  rows = []
  for d in sizes:
    buf = jax.device_put(
      jnp.asarray(np.random.default_rng(0).normal(size=(n, d)), jnp.float32), NamedSharding(mesh, w)
    )
    idx0 = jnp.int32(0)
    fns = {"full": lambda: full(buf, idx0)}
    compile_s = {"full": compile_seconds(full, buf, idx0)}
    for name, layout in layouts.items():
      direct = shard_jit(lambda b, i, layout=layout: C.grouped_mean_in_shard(b, layout))
      compile_s[name] = compile_seconds(direct, buf, idx0)
      fns[name] = lambda direct=direct: direct(buf, idx0)
      idx = jnp.int32(distinct.index(layout))
      fns[name + "/switched"] = lambda idx=idx: switched(buf, idx)
    compile_s["switched"] = compile_seconds(switched, buf, idx0)
    med = time_interleaved(fns, reps=reps)
    for name, layout in layouts.items():
      sizes_str = "/".join(sorted({str(len(g)) for g in layout}, key=int))
      rows.append(
        [
          f"{d // 1024}K",
          name,
          sizes_str,
          f"{1e3 * med['full']:.3f}",
          f"{1e3 * med[name]:.3f}",
          f"{med[name] / med['full']:.2f}",
          f"{1e3 * med[name + '/switched']:.3f}",
          f"{med[name + '/switched'] / med['full']:.2f}",
          f"{compile_s[name]:.3f}",
        ]
      )
    rows.append(
      [f"{d // 1024}K", "(switch over all layouts)", "", "", "", "", "", "", f"{compile_s['switched']:.3f}"]
    )
  header = [
    "f32/device",
    "layout",
    "group sizes",
    "full all-reduce ms",
    "P-Reduce ms",
    "ratio",
    "switched ms",
    "switched ratio",
    "compile s",
  ]
  return Table(header, rows, f"{n} {jax.default_backend()} devices, median of {reps} interleaved reps")


def main(argv):
  del argv
  use_cpu_devices(FLAGS.cpu_devices)
  write_table(run([int(s) for s in FLAGS.sizes], FLAGS.reps), FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
