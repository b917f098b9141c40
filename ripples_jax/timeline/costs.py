"""What the clock charges: worker speeds (SpeedModel, slow_at), the network (Network), the runtime's
authority and group set-up (AuthorityCost), AD-PSGD's averages (AdpsgdCost)."""

import dataclasses

import numpy as np

from ripples_jax.collectives import ring_allreduce_time


@dataclasses.dataclass(frozen=True)
class SpeedModel:
  """Per-worker compute time of one step: base x slowdown x jitter.

  The slowdown hits the fixed slow workers, or, with `rotate_every` > 0, a straggler that moves: at
  time t the slow worker is (slow_workers[0] + floor(t / rotate_every)) mod n (`slow_at`, the same
  rule the runtime applies on its wall clock); or every worker with probability `random_p` per step.
  """

  base_time: float
  num_workers: int
  slow_workers: tuple = ()
  slowdown: float = 1.0
  random_p: float = 0.0
  jitter: float = 0.0  # sigma of a lognormal factor (real steps are never exactly equal)
  seed: int = 0
  times: tuple = ()  # per-worker step times replacing base_time x slowdown (measured times)
  rotate_every: float = 0.0

  def streams(self):
    """One independent stream of step-time factors per worker, so a worker's times never depend on
    the order of events; drawn in blocks because the clock asks for one number at a time."""
    return [self._stream(w) for w in range(self.num_workers)]

  def _stream(self, w: int):
    rng = np.random.default_rng([2, self.seed, w])
    while True:
      t = np.ones(1024)
      if self.random_p:
        t *= np.where(rng.random(1024) < self.random_p, self.slowdown, 1.0)
      if self.jitter:
        t *= np.exp(self.jitter * rng.standard_normal(1024))
      yield from t.tolist()

  def draw(self, streams, worker: int, now: float = 0.0) -> float:
    base = self.times[worker] if self.times else self.base_time
    if worker in slow_at(self.slow_workers, self.num_workers, self.rotate_every, now):
      base *= self.slowdown
    return base * next(streams[worker])


def slow_at(slow_workers, num_workers: int, rotate_every: float, t: float) -> tuple:
  """The fixed slow workers at time t (seconds: virtual in the simulator, wall clock in the runtime)."""
  if not slow_workers or not rotate_every:
    return tuple(slow_workers)
  return ((slow_workers[0] + int(t // rotate_every)) % num_workers,)


@dataclasses.dataclass(frozen=True)
class Network:
  """alpha-beta costs (seconds, bytes/s) for a model of `model_bytes` (docs/design.md 3.1).

  `hidden`: seconds of each step's communication that its computation hides (transfers started layer
  by layer behind the backward pass: timeline.overlap x the base step time). Every algorithm's step is
  charged its transfers less at most `hidden`, so no method is waived a cost another pays: an
  All-Reduce, a group's P-Reduce, a synchronous PS step, a gossip round. Asynchronous PS's push may
  start up to `hidden` before its compute ends, but it holds the server's shared link for its whole
  length (_ps_async); its pull precedes the compute and hides nothing. AD-PSGD's pair average already
  runs beside its whole compute (the clock charges only what outlasts the step): `allreduce(2,
  hide=False)`, so hiding is not counted twice."""

  model_bytes: float
  alpha: float = 5e-6
  bandwidth: float = 1.25e9  # per link (10 Gb/s)
  ps_bandwidth: float = 1.25e9  # the parameter server's link
  hidden: float = 0.0
  # Seconds from an asynchronous PS worker's request to the server's taking it, off the link (its
  # delivery: the runtime posts it through the coordination service); fed from runs, else 0.
  ps_latency: float = 0.0

  def _charged(self, t: float) -> float:
    return t - min(t, self.hidden)

  def allreduce(self, k: int, hide: bool = True) -> float:
    t = ring_allreduce_time(k, self.model_bytes, self.alpha, self.bandwidth)
    return self._charged(t) if hide else t

  def ps_transfer(self) -> float:  # a pull or a push of asynchronous PS: the link's time for it
    return self.alpha + self.model_bytes / self.ps_bandwidth

  def ps_sync_step(self, n: int) -> float:
    # Every worker pushes M and pulls M through the server's one link: 2 n M bytes.
    return self._charged(2 * self.alpha + 2 * n * self.model_bytes / self.ps_bandwidth)

  def ring_gossip(self) -> float:
    return self._charged(2 * self.alpha + 2 * self.model_bytes / self.bandwidth)


@dataclasses.dataclass(frozen=True)
class AuthorityCost:
  """What the runtime pays for the Group Generator and for groups, beyond the round trip:
    service     seconds of the authority's work per request; it is one server (requests queue, FIFO),
                so a busy authority delays answers (measured: benchmarks.bench_authority, busy_s /
                requests)
    setup       seconds a group pays the first time it meets a member set (setup_unit=group: its
                members; pair: each pair of them, runtime.preduce=pairs), the P-Reduce program's first
                run (measured: summary.json's group_setup_s / group_compiles)
  Zero (the default) charges nothing, as before."""

  service: float = 0.0
  setup: float = 0.0
  setup_unit: str = "group"


@dataclasses.dataclass(frozen=True)
class AdpsgdCost:
  """What an AD-PSGD pair average costs beyond moving the bytes, each part switchable (the paper's
  AD-PSGD baseline is slow for reasons it does not itemise; these are the candidates):
    serial          a passive worker serves one atomic average at a time (requests queue, FIFO)
    fixed           seconds added to every average (locking, a gossip thread's hand-off, an RPC)
    passive_blocks  the passive worker's computation stops while it serves an average
    hidden          the share of an active worker's average its compute hides: the rest runs before
                    the compute starts (1: beside it, Lian et al.'s order; 0: average, then compute)
  The default is Lian et al.'s AD-PSGD as published: serial atomic averages, nothing else."""

  serial: bool = True
  fixed: float = 0.0
  passive_blocks: bool = False
  hidden: float = 1.0
