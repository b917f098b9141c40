"""A process's own state as its row of a global (processes, ...) array, and back.

Orbax refuses host-local arrays in a multi-process job; a process checkpointing alone (RunLog
per_process) writes its state as its row of a (workers, ...) array whose other rows live in other
processes and are not written. Making that array moves no data (no communication): it wraps this
process's own device buffers.
"""

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

WORKER, LOCAL = "worker", "local"  # the mesh axes: one row per process, its local devices


def to_global(local, mesh: Mesh) -> jax.Array:
  """A worker's local array (replicated on its devices) as its row of a (workers, ...) global array."""
  pieces = [s.data[None] for s in local.addressable_shards]
  return jax.make_array_from_single_device_arrays(
    (mesh.shape[WORKER],) + local.shape, NamedSharding(mesh, P(WORKER)), pieces
  )


def to_local(global_array, local_sharding: NamedSharding) -> jax.Array:
  """This worker's row of a global (workers, ...) array, replicated on its devices."""
  shards = global_array.addressable_shards
  return jax.make_array_from_single_device_arrays(
    global_array.shape[1:], local_sharding, [s.data[0] for s in shards]
  )
