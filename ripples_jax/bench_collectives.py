"""P-Reduce against a full all-reduce of the same bytes, for every layout the schedules emit."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from ripples_jax import collectives as C
from ripples_jax.benchmark import compile_seconds, markdown_table, time_interleaved
from ripples_jax.schedule.static import allreduce_layouts, hypercube_layouts, static_gg_layouts


def schedule_layouts(n: int) -> dict[str, C.Layout]:
  """Distinct layouts of the All-Reduce, Static GG (4 per node) and hypercube schedules."""
  out = {"allreduce": allreduce_layouts(n)[0]}
  names = ["gg_inter0", "gg_intra", "gg_inter1"]
  for name, layout in zip(names, static_gg_layouts(n, 4)[:3]):
    out[name] = layout
  for k, layout in enumerate(hypercube_layouts(n)):
    out[f"hypercube{k}"] = layout
  return out


def run(sizes: list[int], reps: int) -> str:
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
    buf = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=(n, d)), jnp.float32),
                         NamedSharding(mesh, w))
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
      rows.append([f"{d // 1024}K", name, sizes_str, f"{1e3 * med['full']:.3f}",
                   f"{1e3 * med[name]:.3f}", f"{med[name] / med['full']:.2f}",
                   f"{1e3 * med[name + '/switched']:.3f}", f"{med[name + '/switched'] / med['full']:.2f}",
                   f"{compile_s[name]:.3f}"])
    rows.append([f"{d // 1024}K", "(switch over all layouts)", "", "", "", "", "", "",
                 f"{compile_s['switched']:.3f}"])
  header = ["f32/device", "layout", "group sizes", "full all-reduce ms", "P-Reduce ms", "ratio",
            "switched ms", "switched ratio", "compile s"]
  return (f"{n} {jax.default_backend()} devices, median of {reps} interleaved reps\n\n"
          + markdown_table(header, rows))
