"""Partial All-Reduce (P-Reduce): averaging parameters within disjoint groups of workers.

A *layout* is a tuple of disjoint, sorted groups of worker ids that covers 0..n-1 (workers outside every
group given by a caller become groups of one, which P-Reduce leaves untouched). Two implementations:

* ``collective``: one worker per device on a mesh axis. Each layout is one ``psum`` with
  ``axis_index_groups`` divided by the device's *own* group size. ``lax.pmean`` with groups is not used on
  purpose: it divides every group by the first group's size, which is silently wrong for unequal groups
  (3,3,2). A step that must switch layouts takes the layout *index* as data and ``lax.switch``es over the
  layouts it was built with, so a new layout costs one compile and a seen one costs nothing.
* ``segment``: any placement (several workers per device, one device). The group id of every worker is
  data: a segment sum over the gathered worker axis, divided by the group sizes. It never recompiles for
  a new layout, at the price of moving every worker's buffer (fine for simulation, slow on a pod).

Both average *parameters* (every variable, flattened into one buffer as the authors' P-Reduce does: one
collective per round instead of one per leaf), never gradients.
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Layout = tuple[tuple[int, ...], ...]
WORKER_AXIS = "worker"
# Compiled P-Reduce programs kept for distinct (mesh, layout) pairs: the analogue of the authors' cache of
# one NCCL communicator per member set (capped near 60 there).
MAX_CACHED_LAYOUTS = 64


def canonical_layout(groups: Sequence[Sequence[int]], n: int) -> Layout:
  """Validates disjoint groups of ids in [0, n) and returns the sorted layout covering all n workers."""
  seen = set()
  out = []
  for g in groups:
    g = tuple(sorted(int(i) for i in g))
    if not g:
      continue
    for i in g:
      if not 0 <= i < n:
        raise ValueError(f"groups: worker id {i} is not allowed: ids must lie in [0, {n})")
      if i in seen:
        raise ValueError(f"groups: worker {i} appears twice; groups must be disjoint")
      seen.add(i)
    out.append(g)
  out.extend((i,) for i in range(n) if i not in seen)
  return tuple(sorted(out))


def group_ids(layout: Layout, n: int) -> np.ndarray:
  """int32[n]: index of each worker's group in `layout`."""
  gid = np.empty(n, np.int32)
  for k, g in enumerate(layout):
    gid[list(g)] = k
  return gid


def group_sizes(layout: Layout, n: int) -> np.ndarray:
  """float32[n]: size of each worker's own group."""
  size = np.empty(n, np.float32)
  for g in layout:
    size[list(g)] = len(g)
  return size


def mixing_matrix(groups: Sequence[Sequence[int]], n: int) -> np.ndarray:
  """W[i, j] = 1/|G| for i, j in the same group G; identity outside groups. Doubly stochastic."""
  w = np.zeros((n, n))
  for g in canonical_layout(groups, n):
    w[np.ix_(g, g)] = 1.0 / len(g)
  return w


def mixing_rate(matrices: Sequence[np.ndarray]) -> float:
  """rho = lambda_2(E[W^T W]) over the given rounds (uniform weights); lower mixes faster."""
  m = np.mean([w.T @ w for w in matrices], axis=0)
  ev = np.sort(np.linalg.eigvalsh((m + m.T) / 2))[::-1]
  return float(ev[1]) if len(ev) > 1 else 0.0


def spectral_gap(matrices: Sequence[np.ndarray]) -> float:
  """1 - lambda_2(E[W^T W]): 0 means no mixing, 1 means one round reaches the exact average."""
  return 1.0 - mixing_rate(matrices)


def ring_allreduce_time(k: int, nbytes: float, alpha: float, bandwidth: float) -> float:
  """Ring all-reduce of `nbytes` over k members: 2(k-1) alpha + 2 (k-1)/k * M / B seconds."""
  if k <= 1:
    return 0.0
  return 2 * (k - 1) * alpha + 2 * (k - 1) / k * nbytes / bandwidth


# ----------------------------------------------------------------------------------------------------
# In-step building blocks. `buf_W` carries this shard's workers on its leading axis.


def grouped_mean_in_shard(buf_1xD, layout: Layout, axis_name: str = WORKER_AXIS):
  """Inside shard_map, one worker per device: replaces the worker's buffer by its group's mean."""
  n = sum(len(g) for g in layout)
  if len(layout) == n:  # all groups of one: nothing moves
    return buf_1xD
  if len(layout) == 1:  # one group of everyone: a plain all-reduce
    return lax.psum(buf_1xD, axis_name) / n
  summed = lax.psum(buf_1xD, axis_name, axis_index_groups=[list(g) for g in layout])
  # Divide by this device's own group size (pmean would use the first group's size for everyone).
  size = jnp.asarray(group_sizes(layout, n))[lax.axis_index(axis_name)]
  return summed / size


def switched_grouped_mean_in_shard(
  buf_1xD, layouts: Sequence[Layout], layout_idx, axis_name: str = WORKER_AXIS
):
  """Like grouped_mean_in_shard, with the layout chosen by the traced index `layout_idx`."""
  if len(layouts) == 1:
    return grouped_mean_in_shard(buf_1xD, layouts[0], axis_name)
  branches = [functools.partial(grouped_mean_in_shard, layout=l, axis_name=axis_name) for l in layouts]
  return lax.switch(layout_idx, branches, buf_1xD)


def segment_mean(buf_NxD, gid_N):
  """Group means over the full worker axis with group ids as data: sum per group / group size."""
  n = buf_NxD.shape[0]
  sums = jax.ops.segment_sum(buf_NxD, gid_N, num_segments=n)
  counts = jax.ops.segment_sum(jnp.ones((n,), buf_NxD.dtype), gid_N, num_segments=n)
  return (sums / counts[:, None])[gid_N]


def segment_mean_in_shard(buf_KxD, gid_N, axis_name: str = WORKER_AXIS):
  """Inside shard_map with K workers per device: gather all workers, average groups, keep own rows."""
  k = buf_KxD.shape[0]
  all_NxD = lax.all_gather(buf_KxD, axis_name, tiled=True)
  mean_NxD = segment_mean(all_NxD, gid_N)
  start = lax.axis_index(axis_name) * k
  return lax.dynamic_slice_in_dim(mean_NxD, start, k, axis=0)


def ravel_workers(tree):
  """Flattens a pytree whose leaves have a leading worker axis into a (W, D) buffer, and back."""
  leaves = jax.tree.leaves(tree)
  w = leaves[0].shape[0]
  _, unravel_one = ravel_pytree(jax.tree.map(lambda a: a[0], tree))
  buf_WxD = jnp.concatenate([a.reshape(w, -1) for a in leaves], axis=1) if leaves else None
  unravel = jax.vmap(unravel_one)
  return buf_WxD, unravel


# ----------------------------------------------------------------------------------------------------
# Public helper.


def make_worker_mesh(num_workers: int, devices=None) -> Mesh:
  """A 1-D mesh with axis 'worker': one device per worker, or num_workers/num_devices workers per device."""
  devices = list(jax.devices() if devices is None else devices)
  if num_workers <= len(devices):
    devices = devices[:num_workers]
  elif num_workers % len(devices):
    raise ValueError(
      f"num_workers: {num_workers} is not allowed: it must be <= the {len(devices)} "
      f"devices or a multiple of {len(devices)}"
    )
  return Mesh(np.array(devices), (WORKER_AXIS,))


@functools.lru_cache(maxsize=MAX_CACHED_LAYOUTS)
def _collective_fn(mesh: Mesh, layout: Layout):
  def body(buf_1xD):
    return grouped_mean_in_shard(buf_1xD, layout)

  # check_vma=False: shard_map rejects axis_index_groups otherwise.
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P(WORKER_AXIS), out_specs=P(WORKER_AXIS), check_vma=False)
  )


@jax.jit
def _segment_fn(buf_NxD, gid_N):
  return segment_mean(buf_NxD, gid_N)


def p_reduce(x, groups: Sequence[Sequence[int]], mesh: Mesh | None = None, impl: str = "auto"):
  """Replaces each worker's value by the mean over its group.

  Args:
    x: array or pytree; every leaf has a leading worker axis of size n.
    groups: disjoint lists of worker ids; workers not listed are left untouched.
    mesh: a 1-D worker mesh. With one device per worker the `collective` path runs a grouped psum over
      it (one cached compile per distinct layout); otherwise the `segment` path runs (layout as data).
    impl: "auto", "collective" or "segment".
  """
  leaves = jax.tree.leaves(x)
  n = leaves[0].shape[0]
  layout = canonical_layout(groups, n)
  buf_NxD, unravel = ravel_workers(x)
  if impl == "auto":
    impl = "collective" if mesh is not None and mesh.size == n else "segment"
  if impl == "collective":
    if mesh is None or mesh.size != n:
      raise ValueError("p_reduce: impl='collective' needs a mesh with one device per worker")
    buf_NxD = jax.device_put(buf_NxD, NamedSharding(mesh, P(WORKER_AXIS)))
    out = _collective_fn(mesh, layout)(buf_NxD)
  elif impl == "segment":
    out = _segment_fn(buf_NxD, jnp.asarray(group_ids(layout, n)))
  else:
    raise ValueError(f"impl: {impl!r} is not allowed: one of auto, collective, segment")
  return unravel(out)
