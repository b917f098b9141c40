"""Point-to-point transfers between neighbouring pipeline stages, each stage in its own process.

Link j joins stage j (below) and stage j + 1 (above). A transfer is a jitted `shard_map` `ppermute`
over the two-device mesh [device of stage j, device of stage j + 1] (jax 0.10.2 has no supported
device-to-device send between processes other than a collective; gloo on CPU, NCCL on GPU). Both
processes call the same transfer with the same shape: the sender's piece is its payload, the
receiver's piece is ignored (zeros of the shape), and the receiver gets the payload back.

  up(x)    activations from j to j + 1     (stage j passes its output, stage j + 1 gets it)
  down(x)  error gradients from j + 1 to j
  swap(x)  both at once, for links whose forward and backward delays are both >= 1 (DSP): the
           activation of a block's output and the gradient of the same tensor have one shape

Ordering, the only thing that keeps the chain free of deadlock (a collective blocks until both ends
arrive; gloo has no timeout once connected): on every link both ends issue the same sequence of
transfers. Slack (LinkThread): each link's transfers run on a thread of their own, in the order the
stage posts them, so a stage's compute goes on while a transfer waits for the neighbour; the stage
blocks only on the result it needs (a tick t + d input, for link delay d, is the transfer of tick t).
Two threads never run transfers over one link at once (the eval and micro-batch links share its device
pair: they run only once the thread is drained). The watchdog (distributed/watchdog.py) names a stage that
died.
"""

import concurrent.futures
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "link"
_PERMS = {"up": [(0, 1)], "down": [(1, 0)], "swap": [(0, 1), (1, 0)]}


def stage_device(k: int):
  """The first device of process k: stage k's device (one stage per process)."""
  return [d for d in jax.devices() if d.process_index == k][0]


class Link:
  """Transfers over link j; call them from stage j and from stage j + 1 in one order."""

  def __init__(self, j: int, me: int, shape, dtype, base: int = 0):
    if me not in (j, j + 1):
      raise ValueError(f"stage {me} is not on link {j}")
    self.j, self.side = j, me - j  # side 0: the stage below, 1: the stage above
    self.shape, self.dtype = tuple(shape), jnp.dtype(dtype)
    # base: the process of stage 0 (a hybrid replica's pipeline starts at process 1 + r * K)
    self.mesh = Mesh(np.array([stage_device(base + j), stage_device(base + j + 1)]), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self.device = stage_device(base + me)
    self.zeros = jax.device_put(jnp.zeros(self.shape, self.dtype), self.device)
    self._fns = {}

  def _fn(self, kind: str):
    if kind not in self._fns:
      perm = _PERMS[kind]
      # One program per kind; the receiver of a one-way transfer gets the payload, the sender zeros.
      self._fns[kind] = jax.jit(
        jax.shard_map(
          lambda x: jax.lax.ppermute(x, AXIS, perm), mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS)
        )
      )
    return self._fns[kind]

  def _run(self, kind: str, mine):
    x = self.zeros if mine is None else mine
    if x.shape != self.shape:
      raise ValueError(f"link {self.j}: payload shape {x.shape}, the link carries {self.shape}")
    piece = jax.device_put(x, self.device)[None]
    global_2x = jax.make_array_from_single_device_arrays((2,) + self.shape, self.sharding, [piece])
    out = self._fn(kind)(global_2x)
    return out.addressable_shards[0].data[0]

  def up(self, x=None):
    """Stage j sends x; stage j + 1 (x=None) gets it back."""
    return self._run("up", x if self.side == 0 else None)

  def down(self, x=None):
    """Stage j + 1 sends x; stage j (x=None) gets it back."""
    return self._run("down", x if self.side == 1 else None)

  def swap(self, x):
    """Each end sends x and gets the other end's."""
    return self._run("swap", x)


class LinkThread:
  """A link's transfers on a thread of their own, in the order posted (both ends post one sequence).

  post(kind, x) -> a Future of what that transfer returns (Link.up/down/swap's value); drain() waits
  for every posted transfer. `busy` holds each transfer's seconds on this thread (its wait for the
  neighbour included)."""

  def __init__(self, link: Link):
    self.link, self.busy = link, []
    self._q = queue.Queue()
    self._pending = []
    self._thread = threading.Thread(target=self._serve, name=f"ripples-link-{link.j}", daemon=True)
    self._thread.start()

  def post(self, kind: str, x=None) -> concurrent.futures.Future:
    done = concurrent.futures.Future()
    self._pending = [f for f in self._pending if not f.done()] + [done]
    self._q.put((kind, x, done))
    return done

  def drain(self) -> None:
    for f in self._pending:
      f.result()
    self._pending = []

  def close(self) -> None:
    self._q.put(None)

  def _serve(self) -> None:
    while (item := self._q.get()) is not None:
      kind, x, done = item
      t0 = time.perf_counter()
      try:
        out = jax.block_until_ready(getattr(self.link, kind)(x))
      except Exception as e:  # noqa: BLE001  the neighbour is gone: raised where the result is needed
        done.set_exception(e)
        continue
      self.busy.append(time.perf_counter() - t0)
      done.set_result(out)
