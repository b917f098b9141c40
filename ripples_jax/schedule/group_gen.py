"""Dynamic Group Generators and the Group Buffer (docs/design.md 3.2, 3.7). Host-side, deterministic under
a seed.

The Group Buffer is one global, ordered list of groups. Every worker executes the groups that contain
it in that global order, one per local step, and a group runs when all its members have reached it, so
no cyclic wait (and no deadlock of a real collective backend) can occur. A Group Generator appends
groups to the buffer when a worker that is ready has nothing left to execute (schedule/online.py is the
protocol around it). A generator is `request(worker, view)`; one with hidden state also has
`state()`/`load(state)` (JSON), so a resumed authority continues it.
"""

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ripples_jax.collectives import Layout


@dataclasses.dataclass
class Group:
  gid: int  # position in the global buffer
  members: tuple[int, ...]
  created: float
  request: int  # the GG request that made it (groups of one request form one batch)
  arrived: set = dataclasses.field(default_factory=set)


class GroupBuffer:
  """The global ordered list of groups with per-worker queues (the groups a worker still has to run)."""

  def __init__(self, num_workers: int):
    self.n = num_workers
    self.groups: list[Group] = []  # the groups since `first` (forget() drops the dispatched ones)
    self.first = 0  # the gid of groups[0]
    self.queues: list[list[Group]] = [[] for _ in range(num_workers)]
    self.conflicts = np.zeros(num_workers, np.int64)  # groups created while the worker had one pending
    self.requests = 0
    self.npending = np.zeros(num_workers, np.int64)  # len(queues[w]) as one array, for vectorised GGs

  def append(self, members: Sequence[int], now: float) -> Group | None:
    members = tuple(sorted(int(m) for m in members))
    if len(members) < 2:
      return None  # a group of one is a no-op
    g = Group(self.first + len(self.groups), members, now, self.requests)
    self.groups.append(g)
    for m in members:
      if self.queues[m]:
        self.conflicts[m] += 1
      self.queues[m].append(g)
      self.npending[m] += 1
    return g

  def done(self, worker: int, gid: int) -> None:
    """The worker has executed its groups up to buffer position `gid`: they are no longer pending."""
    q = self.queues[worker]
    while q and q[0].gid <= gid:
      q.pop(0)
      self.npending[worker] -= 1

  def pending(self, worker: int) -> bool:
    return bool(self.queues[worker])

  @property
  def count(self) -> int:
    """Groups ever appended."""
    return self.first + len(self.groups)

  def forget(self) -> None:
    """Drops the global list (a long-running service's memory); the per-worker pending queues stay."""
    self.first += len(self.groups)
    self.groups = []

  def state(self) -> dict:
    """The pending queues and counters as JSON: a cut where groups may be pending (the hybrid's)."""
    return {
      "count": self.count,
      "requests": self.requests,
      "conflicts": self.conflicts.tolist(),
      "queues": [[[g.gid, list(g.members), g.request] for g in q] for q in self.queues],
    }

  def load(self, state: dict) -> None:
    """Continues from `state`: its pending groups (one object per gid, shared by its members' queues),
    the next gid after them."""
    groups = {}
    self.first, self.groups, self.requests = state["count"], [], state["requests"]
    self.conflicts[:] = state["conflicts"]
    for w, q in enumerate(state["queues"]):
      self.queues[w] = [groups.setdefault(gid, Group(gid, tuple(m), 0.0, req)) for gid, m, req in q]
      self.npending[w] = len(q)


@dataclasses.dataclass
class GGView:
  """What a generator may look at when asked for groups (all of it is host-side clock state)."""

  now: float
  buffer: GroupBuffer
  started_at: np.ndarray  # when each worker started its current compute
  estimates: np.ndarray  # the agreed estimate of each worker's step time
  iteration: Callable[[int], int]  # iterations the worker has completed
  # Who is live (the simulator's hetero.leave, docs/design.md 3.10); None: everyone, always. A dead
  # worker is in no group generated after it left.
  alive: np.ndarray | None = None


class Fixed:
  """A fixed schedule (All-Reduce, Static GG): no authority; online.fixed_entry says each worker's
  group after its k-th step."""

  def __init__(self, layouts: Sequence[Layout]):
    self.layouts = tuple(layouts)


class _Generator:
  """A generator with a numpy Generator as its hidden state (saved and loaded as JSON). Its groups do
  not depend on when a request is handled, so a worker may send its request ahead (`ask_ahead`)."""

  ask_ahead = True

  def __init__(self, rng: np.random.Generator):
    self.rng = rng

  def state(self):
    return self.rng.bit_generator.state

  def load(self, state) -> None:
    self.rng.bit_generator.state = state


class random_gg(_Generator):
  """Random GG: the ready worker plus group_size-1 others drawn uniformly; conflicts serialise."""

  def __init__(self, num_workers: int, group_size: int, rng: np.random.Generator):
    super().__init__(np.random.default_rng(int(rng.integers(2**63))))
    self.n, self.k = num_workers, min(group_size - 1, num_workers - 1)

  def __call__(self, worker: int, view: GGView) -> None:
    if view.alive is None:
      picked = self.rng.choice(self.n - 1, self.k, replace=False)
      view.buffer.append([worker] + [int(j) + (j >= worker) for j in picked], view.now)
      return
    # Among the live others (everyone live: the same draws as above).
    others = np.flatnonzero(view.alive)
    others = others[others != worker]
    picked = others[self.rng.choice(len(others), min(self.k, len(others)), replace=False)]
    view.buffer.append([worker, *picked.tolist()], view.now)


class moshpit_gg:
  """Moshpit SGD's averaging (Ryabinin et al., 2021) in lockstep rounds (moshpit.window 0; the published
  matchmaking is moshpit_window_gg) as a generator: a request appends one whole round of groups, round
  r being `layouts[r mod d]` (schedule.static.grid_layouts: the workers that share every grid coordinate
  but the r mod d-th), with hetero.leave the live ones among each (a dead peer's group averages without
  it; a group of one is none). Every worker's j-th group is from round j, as every round covers every
  live worker; with nobody dead, d consecutive rounds average exactly. Its hidden state is the round
  counter."""

  ask_ahead = True  # its rounds do not depend on when they are made

  def __init__(self, layouts: Sequence[Layout]):
    self.layouts, self.round = tuple(layouts), 0

  def state(self):
    return self.round

  def load(self, state) -> None:
    self.round = int(state)

  def __call__(self, worker: int, view: GGView) -> None:
    layout = self.layouts[self.round % len(self.layouts)]
    self.round += 1
    for group in layout:
      members = group if view.alive is None else [m for m in group if view.alive[m]]
      view.buffer.append(members, view.now)  # a group of one is dropped there


class moshpit_window_gg:
  """Moshpit SGD as published (hivemind's averager, Ryabinin et al., 2021): each group is matched among
  the peers that are ready within a time window (hivemind's averaging_expiration); a slow peer is not
  waited for, it averages when it next finds peers ready with it.

  Each worker has its own next grid dimension k (`dims`, from 0), not a global round. When worker i
  asks (ready at view.now), its line is its group of layouts[k] (schedule.static.grid_layouts: the
  workers that share every grid coordinate but the k-th); its group is i and those of the line that are
  live, free (no pending group) and expected ready (started_at + estimates, as Smart GG reads them) by
  view.now + window. The rest of the line is not waited for. Every member then moves to dimension
  k + 1 mod d whatever its own was: a member drawn in from another dimension has averaged along k.

  Alone in its window, i gets no group (NONE: it steps again) and moves to its next dimension: its line
  has moved on without it. (hivemind's peer retries its own key; here a fast worker whose line along
  one dimension is a straggler alone, a (2, 4) grid's pairs, averages along the others meanwhile
  instead of ending up waiting for it.) At most `max_gap` such skips in a row: the next request takes
  the soonest peers of any of its lines whatever the window: the line whose soonest free live peer is
  expected first (ties: from its own dimension on), with that line's free peers expected within
  `window` of that one (nobody free on any line: its own line's live peers, whose pending groups run
  first; the Group Buffer's order keeps that deadlock-free). So a worker with a live peer averages at
  least once every max_gap + 1 of its requests. A dimension whose line has no live peer (hetero.leave)
  is passed over; no live peer on any line: NONE.

  Invariants: every group is a subset (2 or more) of one grid line and holds its asker; a member other
  than the asker was free and expected ready by view.now + window, but in a forced group (the asker's
  (max_gap + 1)-th request in a row). It reads nothing but the view (deterministic under the
  simulator's clock); its hidden state is `dims` and `skipped` (JSON)."""

  ask_ahead = False  # its groups are about who is ready when: asked when the worker is ready, as Smart GG
  partial_lines = True  # its groups are subsets of the lines of `layouts` (hybrid.sim.member_sets)

  def __init__(self, layouts: Sequence[Layout], window: float, max_gap: int = 4):
    self.layouts, self.window, self.max_gap = tuple(layouts), float(window), int(max_gap)
    n = sum(len(g) for g in self.layouts[0])
    # lines[k][w]: worker w's line along dimension k, ascending
    self.lines = [[()] * n for _ in self.layouts]
    for k, layout in enumerate(self.layouts):
      for group in layout:
        for m in group:
          self.lines[k][m] = tuple(sorted(group))
    self.dims = np.zeros(n, np.int64)
    self.skipped = np.zeros(n, np.int64)

  def state(self):
    return {"dims": self.dims.tolist(), "skipped": self.skipped.tolist()}

  def load(self, state) -> None:
    self.dims[:], self.skipped[:] = state["dims"], state["skipped"]

  def __call__(self, worker: int, view: GGView) -> None:
    d = len(self.layouts)
    live = np.ones(len(self.dims), bool) if view.alive is None else np.asarray(view.alive, bool)
    free = live & (view.buffer.npending == 0)
    ready = view.started_at + view.estimates  # when each worker is expected to be ready
    lines = []  # (dimension, live peers) from its own dimension on, those with a live peer
    for j in range(d):
      k = (int(self.dims[worker]) + j) % d
      peers = np.array([m for m in self.lines[k][worker] if m != worker and live[m]], np.int64)
      if len(peers):
        lines.append((k, peers))
    if not lines:
      return
    k, peers = lines[0]
    near = peers[free[peers] & (ready[peers] <= view.now + self.window)]
    if not len(near) and self.skipped[worker] < self.max_gap:
      self.skipped[worker] += 1
      self.dims[worker] = lines[1 % len(lines)][0]
      return
    if not len(near):  # forced: the soonest free peer of any line, else its own line's live peers
      soonest = [(ready[p[free[p]]].min(), i) for i, (_, p) in enumerate(lines) if free[p].any()]
      if soonest:
        k, peers = lines[min(soonest)[1]]
        peers = peers[free[peers]]
      near = peers[ready[peers] <= ready[peers].min() + self.window]
    members = [worker, *near.tolist()]
    self.dims[members] = (k + 1) % d
    self.skipped[members] = 0
    view.buffer.append(members, view.now)


def division_sizes(num_workers: int, group_size: int) -> list[int]:
  """ceil(n / k) groups whose sizes differ by at most one (8 into 3s: 3,3,2; 16: 3,3,3,3,2,2): no
  singleton."""
  count = -(-num_workers // group_size)
  base, extra = divmod(num_workers, count)
  return [base + 1] * extra + [base] * (count - extra)


class division_gg(_Generator):
  """Group Division: a random partition of all workers into groups of balanced sizes; one division
  never conflicts with itself and covers every worker."""

  def __init__(self, num_workers: int, group_size: int, rng: np.random.Generator):
    super().__init__(rng)
    self.n, self.sizes = num_workers, division_sizes(num_workers, group_size)
    self.group_size = group_size

  def __call__(self, worker: int, view: GGView) -> None:
    if view.alive is None:
      perm, sizes = self.rng.permutation(self.n), self.sizes
    else:  # a division of the live workers (everyone live: the same draws)
      live = np.flatnonzero(view.alive)
      if len(live) < 2:
        return
      perm, sizes = self.rng.permutation(live), division_sizes(len(live), self.group_size)
    s = 0
    for size in sizes:
      view.buffer.append(perm[s : s + size].tolist(), view.now)
      s += size


class smart_gg:
  """Smart GG (heterogeneity-aware, our design since the paper's detail is not public).

  When worker i is ready with nothing to run, it is grouped with the group_size-1 workers that have no
  pending group and are expected to be ready soonest, counting only those expected within
  `tolerance` x i's own estimated step time: workers that will be ready together sync together and a
  slow worker is pulled in only when it is about to finish, i.e. in proportion to its speed. No pending
  worker is picked, so smart groups never conflict. If nobody is close, i skips this sync, but at most
  `max_gap` times in a row: then it takes the soonest workers whatever their distance, which bounds
  how far any worker drifts from the rest.
  """

  ask_ahead = False  # its groups are about who is ready together: asked when the worker is ready

  def __init__(
    self, num_workers: int, group_size: int, tolerance: float = 0.5, max_gap: int = 4, fresh: bool = False
  ):
    self.n, self.k, self.tolerance, self.max_gap = num_workers, group_size - 1, tolerance, max_gap
    self.skipped = np.zeros(num_workers, np.int64)
    # fresh: each worker's last group (-1 padded), whose members rank after the other workers ready
    # within the tolerance.
    self.fresh = fresh
    self.last = np.full((num_workers, group_size), -1, np.int64) if fresh else None

  def state(self):
    if self.fresh:
      return {"skipped": self.skipped.tolist(), "last": self.last.tolist()}
    return self.skipped.tolist()

  def load(self, state) -> None:
    if self.fresh:
      self.skipped[:], self.last[:] = state["skipped"], state["last"]
    else:
      self.skipped[:] = state

  def __call__(self, worker: int, view: GGView) -> None:
    # Vectorised over workers: this runs once per step of every worker, with n up to hundreds.
    k = self.k
    ready = view.started_at + view.estimates  # when each worker is expected to be ready
    ready[view.buffer.npending > 0] = np.inf  # never pick a worker with a pending group
    if view.alive is not None:
      ready[~view.alive] = np.inf  # nor a dead one
    ready[worker] = np.inf
    key = ready if not self.fresh else self._fresh_key(worker, ready, view)
    soonest = np.argpartition(key, k)[:k] if k < self.n else np.arange(self.n)
    soonest = soonest[np.argsort(key[soonest], kind="stable")]
    soonest = soonest[np.isfinite(ready[soonest])]
    near = soonest[ready[soonest] <= view.now + self.tolerance * view.estimates[worker]]
    if not len(near) and self.skipped[worker] < self.max_gap:
      self.skipped[worker] += 1
      return
    if not len(near):
      near = soonest
    self.skipped[worker] = 0
    members = [worker, *near.tolist()]
    if self.fresh:
      row = np.full(self.k + 1, -1, np.int64)
      row[: len(members)] = members
      self.last[members] = row
    view.buffer.append(members, view.now)

  def _fresh_key(self, worker: int, ready: np.ndarray, view: GGView) -> np.ndarray:
    """The order in which fresh picks: the workers expected within the tolerance that were not in the
    asker's last group (soonest first), then those that were, then the rest by expected readiness."""
    within = ready <= view.now + self.tolerance * view.estimates[worker]
    last = np.zeros(self.n, bool)
    mates = self.last[worker]
    last[mates[mates >= 0]] = True
    tier = np.where(within, last.astype(np.int64), 2)
    order = np.lexsort((ready, tier))  # by tier, then by readiness (no sum of the two: no rounding)
    rank = np.empty(self.n)
    rank[order] = np.arange(self.n)
    return np.where(np.isfinite(ready), rank, np.inf)
