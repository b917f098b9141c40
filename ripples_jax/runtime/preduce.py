"""P-Reduce between processes: a jitted collective over the sub-mesh of one group's devices.

Each worker process holds its state as one flat buffer D (the authors' P-Reduce flattens every
variable into one buffer too), replicated over its local devices. A group's members build a global
(k, D) array over the (k, local devices) mesh of their devices and run psum / k over the worker axis;
processes outside the group do not take part, so disjoint groups run at the same time (gloo on CPU,
NCCL on GPU). One compiled program per distinct member set, in a bounded LRU (the authors cache one
communicator per member set, capped at ~60).
"""

import collections

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ripples_jax.distributed.arrays import LOCAL, WORKER


class GroupAverager:
  """average(members, flat_D) -> the members' mean of flat_D; call it on every member, in one order."""

  def __init__(self, local_mesh: Mesh, devices_of: dict, cache_size: int = 64):
    self.local_mesh = local_mesh
    self.devices_of = devices_of  # worker -> its devices, in local mesh order
    self.cache_size = cache_size
    self.cache = collections.OrderedDict()
    self.compiles = 0

  def _program(self, members: tuple):
    key = members  # the buffer size is the worker's state size, fixed for the run
    if key in self.cache:
      self.cache.move_to_end(key)
      return self.cache[key]
    mesh = Mesh(np.array([self.devices_of[m] for m in members]), (WORKER, LOCAL))
    k = len(members)

    def mean(x_1xD):
      return (jax.lax.psum(x_1xD, WORKER) / k)[0]

    # check_vma=False: the output is replicated over both axes after the psum (every device holds the
    # same mean), which the varying-axes check cannot see through the reshape.
    fn = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(WORKER), out_specs=P(), check_vma=False))
    in_sharding = NamedSharding(mesh, P(WORKER))
    self.cache[key] = (fn, in_sharding)
    self.compiles += 1
    if len(self.cache) > self.cache_size:
      self.cache.popitem(last=False)
    return self.cache[key]

  def average(self, members: tuple, flat_D: jax.Array) -> jax.Array:
    size = flat_D.shape[0]
    fn, sharding = self._program(tuple(members))
    pieces = [s.data[None] for s in flat_D.addressable_shards]  # (1, D) on each local device
    x_kxD = jax.make_array_from_single_device_arrays((len(members), size), sharding, pieces)
    out_D = fn(x_kxD)
    # Back to a local array, replicated over this worker's devices only.
    return jax.make_array_from_single_device_arrays(
      (size,), NamedSharding(self.local_mesh, P()), [s.data for s in out_D.addressable_shards]
    )
