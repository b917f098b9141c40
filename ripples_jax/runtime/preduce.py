"""P-Reduce between processes: a jitted collective over the sub-mesh of one group's devices.

Each worker process holds its state as one flat buffer D (the authors' P-Reduce flattens every
variable into one buffer too), replicated over its local devices. Processes outside a group do not
take part, so disjoint groups run at the same time (gloo on CPU, NCCL on GPU). Two ways to average:

- GroupAverager: the group's members build a global (k, D) array over the (k, local devices) mesh of
  their devices and run psum / k over the worker axis: one collective, but one compiled program (and
  on CPU one gloo context, on GPU one NCCL communicator) per distinct member set, in a bounded LRU (the
  authors cache one communicator per member set, capped at ~60). A generator that draws from C(n-1,
  g-1) member sets per worker (Random, Division, Smart GG at n=16: 105) compiles without end.
- PairAverager: each member exchanges its buffer with every other member, one pair at a time (an
  all_gather over the pair's mesh), and averages the k buffers locally in member order. At most n-1
  pair programs (and contexts) per worker, whatever the groups, so set-up is bounded; the price is
  k-1 exchanges of D per member instead of one k-way reduction. The pairs run in one global order
  (sorted (i, j) within the group, groups in the global order of their ids): every member executes a
  subsequence of it, so the smallest pending pair always has both its members there and no cycle of
  waits can form. Every member sums the same k buffers in the same order: their means are equal.

`choose` picks one for a run (runtime.preduce=auto: pairs exactly when the generator's member sets per
worker exceed the cache). docs/design.md 3.9 describes it; WORKSPACE.md section 16 has the measured costs.
"""

import collections
import math
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ripples_jax import algorithms
from ripples_jax.distributed.arrays import LOCAL, WORKER
from ripples_jax.runtime.membership import pair_devices, pair_key


def member_sets_per_worker(config) -> int:
  """How many distinct groups containing one worker the run's generator can form (an upper bound)."""
  n = config.num_workers
  if config.algorithm == "moshpit":  # one group per grid dimension (a dead peer's: elastic, pairs)
    if config.moshpit.get("window", 0.0):  # with a window: any 2 or more of each line
      return sum(2 ** (g - 1) - 1 for g in config.moshpit.grid)
    return len(config.moshpit.grid)
  if algorithms.get(config.algorithm).dynamic:  # groups of 2 .. group_size (Division, Smart GG: fewer)
    return sum(math.comb(n - 1, s - 1) for s in range(2, config.schedule.group_size + 1))
  return n  # All-Reduce: one set; Static GG: one per layout, a few


def choose(config) -> str:
  """'group' or 'pairs' for this run."""
  mode = config.runtime.preduce
  if config.runtime.get("elastic", False):  # every pair connected before the run: a dead one fails at once
    return "pairs"
  if mode != "auto":
    return mode
  return "pairs" if member_sets_per_worker(config) > config.runtime.cache_size else "group"


class _Averager:
  def __init__(self, local_mesh: Mesh, devices_of: dict):
    self.local_mesh = local_mesh
    self.devices_of = devices_of  # worker -> its devices, in local mesh order
    self.compiles = 0  # programs compiled (each first run also sets up its connection)
    self.setup_s = 0.0  # seconds in the first call of each program in the run: compile and connection
    self.ahead_s = 0.0  # seconds compiling and connecting before the run

  def _local(self, out, shape):
    """A collective's replicated output as a local array on this worker's devices."""
    return jax.make_array_from_single_device_arrays(
      shape, NamedSharding(self.local_mesh, P()), [s.data for s in out.addressable_shards]
    )

  def _timed_first(self, fn, x, first: bool):
    if not first:
      return fn(x)
    t0 = time.perf_counter()
    out = fn(x)
    out.block_until_ready()
    self.setup_s += time.perf_counter() - t0
    return out


class GroupAverager(_Averager):
  """average(members, flat_D) -> the members' mean of flat_D; call it on every member, in one order."""

  def __init__(self, local_mesh: Mesh, devices_of: dict, cache_size: int = 64):
    super().__init__(local_mesh, devices_of)
    self.cache_size = cache_size
    self.cache = collections.OrderedDict()

  def _program(self, members: tuple):
    key = members  # the buffer size is the worker's state size, fixed for the run
    if key in self.cache:
      self.cache.move_to_end(key)
      return self.cache[key], False
    mesh = Mesh(np.array([self.devices_of[m] for m in members]), (WORKER, LOCAL))
    k = len(members)

    def mean(x_1xD):
      return (jax.lax.psum(x_1xD, WORKER) / k)[0]

    # check_vma=False: the output is replicated over both axes after the psum (every device holds the
    # same mean), which the varying-axes check cannot see through the reshape.
    fn = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(WORKER), out_specs=P(), check_vma=False))
    self.cache[key] = (fn, NamedSharding(mesh, P(WORKER)))
    self.compiles += 1
    if len(self.cache) > self.cache_size:
      self.cache.popitem(last=False)
    return self.cache[key], True

  def connect(self, members: tuple, flat_D: jax.Array) -> float:
    """Runs the group's program once, before the run, on every member (each must call it): its compile
    and connection set-up leave the run, as PairAverager.connect_all's do. A group that meets with a
    member far behind needs it: gloo's rendezvous at a context's first use waits 30 s for the others
    (its store timeout, docs/design.md 3.8), and DiLoCo's first outer step meets a 5x straggler
    H x 4 slow steps late (H=16 at 0.5 s a step: 32 s). Later calls wait on the collective timeout.
    Returns the seconds it took."""
    t0, setup = time.perf_counter(), self.setup_s
    self.average(members, flat_D).block_until_ready()
    self.setup_s = setup  # paid before the run: ahead, not in the run's first call
    self.ahead_s += time.perf_counter() - t0
    return time.perf_counter() - t0

  def average(self, members: tuple, flat_D: jax.Array) -> jax.Array:
    size = flat_D.shape[0]
    (fn, sharding), first = self._program(tuple(members))
    pieces = [s.data[None] for s in flat_D.addressable_shards]  # (1, D) on each local device
    x_kxD = jax.make_array_from_single_device_arrays((len(members), size), sharding, pieces)
    return self._local(self._timed_first(fn, x_kxD, first), (size,))


def failure_cause(error: Exception) -> str:
  """A failed exchange's cause, as summary.json counts it: "timeout" (the collective timeout ran out:
  the partner never came, stalled or slower than the timeout), "connection" (gloo saw the partner's
  connection close: it died), else the error's type. A pair skipped because its connection failed
  before is "broken_before"; a pair of lives that did not meet before a connection's first use (the
  handshake, membership.handshake) is "left" (the other life was removed) or "unmet" (no proof of the
  other within the collective timeout: no connection was tried)."""
  if isinstance(error, Unmet):
    return "unmet" if str(error) == "timeout" else str(error)
  text = str(error).lower()
  if "timed out" in text or "timeout" in text or "deadline" in text:
    return "timeout"
  if "connection" in text or "closed by peer" in text or "reset by peer" in text:
    return "connection"
  return type(error).__name__


class Unmet(Exception):
  """A pair of lives that did not meet before connecting (membership.handshake): "left" or "timeout"."""


class PairAverager(_Averager):
  """average(members, flat_D) from pairwise exchanges: at most n-1 programs per worker (module doc)."""

  def __init__(self, local_mesh: Mesh, devices_of: dict, me: int, per_life: bool = False):
    super().__init__(local_mesh, devices_of)
    self.me = me
    # per_life (elastic): devices_of[w] lists all of w's process's devices and a life i of w runs on its
    # i-th (membership.life_device); a pair's key is its members' lives. Otherwise a worker is all its
    # devices and the key is always (0, 0).
    self.per_life = per_life
    self.cache = {}  # ((i, j), i < j; key) -> (program, input sharding)
    self._ran = set()  # programs run at least once (their connection is set up)
    self._means = {}  # k -> the jitted local mean of k buffers
    self.precompile_s = 0.0
    self.broken = set()  # (pair, key) connections that failed for good (elastic): never tried again
    # (pair, key) -> its connection's generation (elastic): 0, then 1 after a failure (slow is not dead)
    self.gens = {}
    self.causes = {}  # the last elastic call's failed members -> failure_cause(...)
    # (pair, key, gen) -> None or the cause: a connection not made before the run agrees first that
    # both lives are there (elastic: membership.handshake, set by the worker); None: connect directly.
    self.handshake = None

  def _program(self, pair: tuple, like=None, key: tuple = (0, 0), gen: int = 0):
    """The pair's program; compiled ahead for `like` (a ShapeDtypeStruct of one buffer) if given.
    `key` (elastic): its connection key, the pair's lives (membership.pair_key), each on its own device
    (membership.pair_devices): a restarted process connects on a device its earlier lives never used.
    `gen` 1: the same devices in the other order (rows reversed), a device list, hence a connection,
    that no other pair of lives uses: the pair's one fresh connection after a failure."""
    if (pair, key, gen) in self.cache:
      fn_sharding = self.cache[(pair, key, gen)]
      return fn_sharding, fn_sharding[0] not in self._ran
    rows = pair_devices(pair, key, self.devices_of) if self.per_life else [self.devices_of[m] for m in pair]
    mesh = Mesh(np.array(rows[::-1] if gen else rows), (WORKER, LOCAL))
    gather = lambda x_1xD: jax.lax.all_gather(x_1xD, WORKER, axis=0, tiled=True)  # (2, D) on both
    fn = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P(WORKER), out_specs=P(), check_vma=False))
    sharding = NamedSharding(mesh, P(WORKER))
    if like is not None:  # compiling needs no peer: only the first run connects (gloo, NCCL)
      fn = fn.lower(jax.ShapeDtypeStruct((2, *like.shape), like.dtype, sharding=sharding)).compile()
    self.cache[(pair, key, gen)] = (fn, sharding)
    self.compiles += 1
    return self.cache[(pair, key, gen)], True

  def connect_all(self, flat_D: jax.Array) -> float:
    """Runs every pair program once, before the run, so that no group pays a pair's connection set-up
    (gloo's context, NCCL's communicator) inside the run. Every process must call it: the pairs go in
    the n-1 rounds of a round-robin tournament (round_robin), each round a set of disjoint pairs, so
    every worker meets its partners in one global order and no cycle of waits can form. Returns the
    seconds it took."""
    t0 = time.perf_counter()
    size, me = flat_D.shape[0], self.me
    pieces = [s.data[None] for s in flat_D.addressable_shards]
    for pairs in round_robin(len(self.devices_of)):
      pair = next((p for p in pairs if me in p), None)
      if pair is None:  # an odd count: this worker sits this round out
        continue
      (fn, sharding), _ = self._program(pair)
      x_2xD = jax.make_array_from_single_device_arrays((2, size), sharding, pieces)
      fn(x_2xD).block_until_ready()
      self._ran.add(fn)
    self.ahead_s += time.perf_counter() - t0
    return time.perf_counter() - t0

  def precompile(self, like) -> float:
    """Compiles the n-1 pair programs this worker can need, before the run (off its critical path);
    returns the seconds it took. Their first runs still set up each pair's connection."""
    t0 = time.perf_counter()
    for other in self.devices_of:
      if other != self.me:
        self._program(tuple(sorted((self.me, other))), like)
    self.ahead_s += time.perf_counter() - t0
    return time.perf_counter() - t0

  def average_elastic(self, members, flat_D, joiners=(), incs=None, on_exchange=None, attempt=None):
    """average() under elastic membership (runtime/membership.py): (the result, the members whose
    exchange failed). Every pair of this worker's is tried in the global order, even after a failure,
    so no live partner waits for an exchange that never comes; a failed exchange (its partner died:
    gloo raises at once on a connection set up before) leaves this worker's model as it was. A failed
    connection is never used again (gloo keeps it failed on both sides, docs/design.md 3.8): the
    pair's next exchange goes over its one fresh connection (generation 1, met through the handshake
    first: slow is not dead), unless the partner's life is known gone; after a second failure the pair
    of lives is broken, and groups with it fail here at no cost; a rejoined life of that worker is
    another key (its lives' devices). A meeting that timed out ("unmet": the partner did not come to
    the handshake within the collective timeout, a stalled life) touched no connection: the pair stays
    on its generation and meets afresh at its next group. Joiners (a rejoined worker's first group)
    have weight 0: every member takes the others' mean.
    on_exchange(): called after each exchange (fault injection inside a P-Reduce); attempt: the group's
    name on both sides (its gid, an exchange id), the handshake's round."""
    size, ordered = flat_D.shape[0], sorted(members)
    pieces = [s.data[None] for s in flat_D.addressable_shards]
    buffers, failed = {self.me: flat_D}, []
    self.causes = {}  # this call's failed members -> failure_cause(...), for the trace and summary.json
    for other in (m for m in ordered if m != self.me):
      pair = tuple(sorted((self.me, other)))
      key = (0, 0) if incs is None else pair_key(pair, incs)
      if (pair, key) in self.broken:
        failed.append(other)
        self.causes[other] = "broken_before"
        continue
      gen = self.gens.get((pair, key), 0)
      try:
        buffers[other] = self._exchange(pair, key, gen, pieces, size, attempt)
      except Exception as e:  # noqa: BLE001  jax's runtime error: the collective failed in this pair only
        failed.append(other)
        self.causes[other] = failure_cause(e)
        # A failure's two sides may see different causes (the side that timed out closes the
        # connection, so the slow side sees it closed), so the rule cannot hang on the cause: every
        # failure but a partner known gone moves the pair to its fresh connection, met through the
        # handshake, where a dead partner is told apart ("left", after its removal) from a slow one.
        if self.causes[other] == "unmet":  # no connection was tried: the next group meets afresh
          pass
        elif gen == 0 and self.causes[other] != "left" and self.per_life:
          self.gens[(pair, key)] = 1
        else:
          self.broken.add((pair, key))
        logging.warning(
          "worker %d: the exchange with worker %d failed (%s): %s",
          self.me,
          other,
          type(e).__name__,
          str(e).splitlines()[0][:160],
        )
      if on_exchange is not None:
        on_exchange()
    if failed:
      return flat_D, failed
    weighted = [m for m in ordered if m not in joiners] or ordered
    return self._mean(len(weighted))(*(buffers[m] for m in weighted)), []

  def _exchange(self, pair: tuple, key: tuple, gen: int, pieces, size: int, attempt=None):
    """The other member's buffer, over the pair's connection `gen`; a connection not run before
    meets first (handshake: elastic). Raises what the collective raised, or Unmet."""
    (fn, sharding), first = self._program(pair, key=key, gen=gen)
    unmet = self.handshake(pair, key, gen, attempt) if first and self.handshake is not None else None
    if unmet:  # the other life left, or never came: no connection attempt (gloo would wait 30 s)
      raise Unmet(unmet)
    x_2xD = jax.make_array_from_single_device_arrays((2, size), sharding, pieces)
    both = self._local(self._timed_first(fn, x_2xD, first), (2, size))
    both.block_until_ready()
    self._ran.add(fn)
    other = pair[1] if pair[0] == self.me else pair[0]
    order = pair[::-1] if gen else pair
    return both[order.index(other)]

  def _mean(self, k: int):
    if k not in self._means:  # a left-to-right sum in member order: the same on every member
      self._means[k] = jax.jit(lambda *xs: sum(xs[1:], xs[0]) / k)
    return self._means[k]

  def average(self, members: tuple, flat_D: jax.Array) -> jax.Array:
    size, ordered = flat_D.shape[0], sorted(members)
    pieces = [s.data[None] for s in flat_D.addressable_shards]
    buffers = {self.me: flat_D}
    for a in range(len(ordered)):  # the group's pairs in sorted order; this worker's only
      for b in range(a + 1, len(ordered)):
        pair = (ordered[a], ordered[b])
        if self.me not in pair:
          continue
        (fn, sharding), first = self._program(pair)
        x_2xD = jax.make_array_from_single_device_arrays((2, size), sharding, pieces)
        both = self._local(self._timed_first(fn, x_2xD, first), (2, size))
        self._ran.add(fn)
        other = pair[1] if pair[0] == self.me else pair[0]
        buffers[other] = both[pair.index(other)]
    return self._mean(len(ordered))(*(buffers[m] for m in ordered))


def round_robin(n: int) -> list:
  """The circle method: n-1 rounds (n rounds for odd n) of disjoint pairs (i, j), i < j, in which every
  pair of range(n) meets exactly once."""
  m = n + n % 2  # odd n: a phantom worker m-1, whose partner sits the round out
  rounds = []
  for r in range(m - 1):
    pairs = [(r, m - 1)] + [((r + k) % (m - 1), (r - k) % (m - 1)) for k in range(1, m // 2)]
    rounds.append([tuple(sorted(p)) for p in pairs if max(p) < n])
  return rounds


def make_averager(config, local_mesh: Mesh, devices_of: dict, me: int):
  if choose(config) == "pairs":
    return PairAverager(local_mesh, devices_of, me, per_life=bool(config.runtime.get("elastic", False)))
  return GroupAverager(local_mesh, devices_of, config.runtime.cache_size)
