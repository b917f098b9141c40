"""Dynamic Group Generators and the Group Buffer (DESIGN 3.2). Host-side, deterministic under a seed.

The Group Buffer is one global, ordered list of groups. Every worker executes the groups that contain
it in that global order, and a group runs when all its members have reached it, so no cyclic wait (and
no deadlock of a real collective backend) can occur. A Group Generator appends groups to the buffer
when a worker that is ready has nothing left to execute.
"""
import dataclasses
import random
from typing import Callable, Sequence

import numpy as np

from ripples_jax.collectives import Layout


@dataclasses.dataclass
class Group:
  gid: int                   # position in the global buffer
  members: tuple[int, ...]
  created: float
  request: int               # the GG request that made it (groups of one request form one batch)
  arrived: set = dataclasses.field(default_factory=set)


class GroupBuffer:
  """The global ordered list of groups with per-worker queues (the groups a worker still has to run)."""

  def __init__(self, num_workers: int):
    self.n = num_workers
    self.groups: list[Group] = []
    self.queues: list[list[Group]] = [[] for _ in range(num_workers)]
    self.conflicts = np.zeros(num_workers, np.int64)  # groups created while the worker had one pending
    self.requests = 0
    self.npending = np.zeros(num_workers, np.int64)  # len(queues[w]) as one array, for vectorised GGs

  def append(self, members: Sequence[int], now: float) -> Group | None:
    members = tuple(sorted(int(m) for m in members))
    if len(members) < 2:
      return None  # a group of one is a no-op
    g = Group(len(self.groups), members, now, self.requests)
    self.groups.append(g)
    for m in members:
      if self.queues[m]:
        self.conflicts[m] += 1
      self.queues[m].append(g)
      self.npending[m] += 1
    return g

  def pop(self, g: Group) -> None:
    """The group ran: remove it from the head of every member's queue."""
    for m in g.members:
      assert self.queues[m][0] is g  # global order: a member's head is always the group that ran
      self.queues[m].pop(0)
      self.npending[m] -= 1

  def pending(self, worker: int) -> bool:
    return bool(self.queues[worker])


@dataclasses.dataclass
class GGView:
  """What a generator may look at when asked for groups (all of it is host-side clock state)."""
  now: float
  buffer: GroupBuffer
  started_at: np.ndarray                  # when each worker started its current compute
  estimates: np.ndarray                   # the agreed estimate of each worker's step time
  iteration: Callable[[int], int]         # iterations the worker has completed


def static_gg(layouts: Sequence[Layout]):
  """Static GG in the asynchronous clock: a worker's k-th sync is its group in layouts[k % period].

  Layout k is appended whole (all its groups) the first time any worker reaches iteration k, so the
  buffer order is the layout order and groups of one layout never conflict.
  """
  made = [0]

  def request(worker: int, view: GGView) -> None:
    k = view.iteration(worker) - 1  # the sync after the worker's k-th step (0-based)
    while made[0] <= k:
      for g in layouts[made[0] % len(layouts)]:
        view.buffer.append(g, view.now)
      made[0] += 1

  return request


def random_gg(num_workers: int, group_size: int, rng: np.random.Generator):
  """Random GG: the ready worker plus group_size-1 others drawn uniformly; conflicts serialise."""
  py_rng = random.Random(int(rng.integers(2**63)))  # one draw per request: python's sampler is cheaper

  def request(worker: int, view: GGView) -> None:
    picked = py_rng.sample(range(num_workers - 1), min(group_size - 1, num_workers - 1))
    view.buffer.append([worker] + [j + (j >= worker) for j in picked], view.now)

  return request


def division_gg(num_workers: int, group_size: int, rng: np.random.Generator):
  """Group Division: a random partition of all workers into groups; one division never conflicts."""

  def request(worker: int, view: GGView) -> None:
    perm = rng.permutation(num_workers)
    for s in range(0, num_workers, group_size):
      view.buffer.append(perm[s:s + group_size].tolist(), view.now)

  return request


def smart_gg(num_workers: int, group_size: int, tolerance: float = 0.5, max_gap: int = 4):
  """Smart GG (heterogeneity-aware, our design since the paper's detail is not public).

  When worker i is ready with nothing to run, it is grouped with the group_size-1 workers that have no
  pending group and are expected to be ready soonest, counting only those expected within
  `tolerance` x i's own estimated step time: workers that will be ready together sync together and a
  slow worker is pulled in only when it is about to finish, i.e. in proportion to its speed. No pending
  worker is picked, so smart groups never conflict. If nobody is close, i skips this sync, but at most
  `max_gap` times in a row: then it takes the soonest workers whatever their distance, which bounds
  how far any worker drifts from the rest.
  """
  skipped = np.zeros(num_workers, np.int64)

  k = group_size - 1

  def request(worker: int, view: GGView) -> None:
    # Vectorised over workers: this runs once per step of every worker, with n up to hundreds.
    ready = view.started_at + view.estimates  # when each worker is expected to be ready
    ready[view.buffer.npending > 0] = np.inf  # never pick a worker with a pending group
    ready[worker] = np.inf
    soonest = np.argpartition(ready, k)[:k] if k < num_workers else np.arange(num_workers)
    soonest = soonest[np.argsort(ready[soonest], kind="stable")]
    soonest = soonest[np.isfinite(ready[soonest])]
    near = soonest[ready[soonest] <= view.now + tolerance * view.estimates[worker]]
    if not len(near) and skipped[worker] < max_gap:
      skipped[worker] += 1
      return
    if not len(near):
      near = soonest
    skipped[worker] = 0
    view.buffer.append([worker, *near.tolist()], view.now)

  return request
