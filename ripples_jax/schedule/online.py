"""The online Group Generator protocol (docs/design.md 3.7): one implementation for the simulator and the
runtime.

One authority (the `Service`) holds the Group Buffer and the generator's state. Every worker owns a
queue of entries that only the authority appends to:
  ("G", gid, members)   after your current step, average with `members` (all of them have it)
  ("N",)                the answer to your request when no group was made for you: step again
  ("M", kind, id)       a point of the global order (a checkpoint or an evaluation): act, then go on
  ("S",)                the run is over
  ("E", kind, w, inc)   a membership entry (runtime.elastic, runtime/membership.py): worker w left
                        (kind "leave") or rejoined as its incarnation inc ("join") at this point of
                        the global order; a group made for a rejoined worker's first average carries
                        it as a fourth field, ("G", gid, members, joiners): its weight there is 0
Per local step a worker takes the head of its queue, markers first; with an empty queue it sends a
request carrying its measured step time and waits for its next entry. With request-ahead
(schedule.request_ahead, the default; `asks_ahead`) a worker whose queue is empty when a step
*starts* sends the request for the entry after that step at once, so the round trip overlaps the
step. Only for generators whose groups do not depend on when they are made (Random GG, Group
Division): Smart GG groups the workers that are ready together, so its requests are sent when ready
(sent ahead, a request would be decided on the speeds before a straggler's first slow step). The authority
generates groups
on these actual arrivals and appends each group to all its members' queues under one global sequence
number (gid); markers and STOP go to every queue at once.

Invariants (tests/test_online.py checks them under random speeds and arrival orders):
  - every worker's queue is a subsequence of one global order, so every worker executes a prefix of
    it and no cycle of waits can form (a group runs when all its members reach it);
  - a request is answered: a queue that is empty when its request is handled receives an entry;
  - one group per local step: a worker never runs two groups without a step between them.
The simulator calls this class directly (with the round trip as a virtual cost); the runtime's
authority thread calls it on requests that arrive through the coordination service.

Fixed schedules (All-Reduce, Static GG) need no authority: `fixed_entry(config, worker, k)` is the
entry after a worker's k-th step (its group in layout k mod period, or NONE), the same in both
executors. Static GG thereby means the authors' schedule: a worker's k-th sync is its group of the
k-th layout, whenever it gets there (asynchronous across groups, lockstep within one).
"""

import dataclasses

import numpy as np

from ripples_jax.schedule.group_gen import GGView, GroupBuffer

GROUP, NONE, MARK, STOP, MEMBER = "G", "N", "M", "S", "E"
DYNAMIC = ("ripples_random", "ripples_division", "ripples_smart")
FIXED = ("allreduce", "ripples_static")
RUNTIME_ALGORITHMS = FIXED + DYNAMIC + ("adpsgd",)  # what executor=async runs
ADPSGD_PASSIVE = ("concurrent", "blocking")  # runtime.adpsgd_passive
PREDUCE_MODES = ("auto", "group", "pairs")  # runtime.preduce (runtime/preduce.py)


def encode(entry: tuple) -> str:
  """An entry as the coordination service's string value."""
  if entry[0] == GROUP:
    joiners = f" {','.join(map(str, entry[3]))}" if len(entry) > 3 and entry[3] else ""
    return f"G {entry[1]} {','.join(map(str, entry[2]))}{joiners}"
  if entry[0] == MARK:
    return f"M {entry[1]} {entry[2]}"
  if entry[0] == MEMBER:
    return f"E {entry[1]} {entry[2]} {entry[3]}"
  return entry[0]


def decode(text: str) -> tuple:
  parts = text.split()
  ints = lambda field: tuple(int(m) for m in field.split(","))
  if parts[0] == GROUP:
    group = (GROUP, int(parts[1]), ints(parts[2]))
    return group + (ints(parts[3]),) if len(parts) > 3 else group
  if parts[0] == MARK:
    return (MARK, parts[1], int(parts[2]))
  if parts[0] == MEMBER:
    return (MEMBER, parts[1], int(parts[2]), int(parts[3]))
  return (parts[0],)


@dataclasses.dataclass
class Cadence:
  """When the authority inserts markers and STOP, in worker steps started (all workers together)."""

  total_steps: int  # STOP once this many steps have started
  eval_every: int = 0  # an ("M", "eval", k) marker every this many steps (0: none)
  checkpoint_every: int = 0  # an ("M", "ckpt", k) marker every this many steps (0: none)


def asks_ahead(config) -> bool:
  """Whether workers send their requests when a step starts (see the module docstring)."""
  from ripples_jax.schedule import make_group_generator

  gg = make_group_generator(config, np.random.default_rng(0))
  return bool(config.schedule.request_ahead and getattr(gg, "ask_ahead", False))


class Service:
  """The authority's state: the Group Buffer, the generator, what it knows of every worker."""

  def __init__(self, num_workers: int, gg, cadence: Cadence | None = None, estimate: float = 1.0):
    n = self.n = num_workers
    self.gg = gg
    self.cadence = cadence
    self.buffer = GroupBuffer(n)
    self.entries = [[] for _ in range(n)]  # each queue's entries from index base[w] on, in order
    self.base = [0] * n  # entries before this index of each queue were trimmed (trim())
    self.started_at = np.zeros(n)  # when each worker last reported starting a step
    self.estimates = np.full(n, float(estimate))  # each worker's newest measured step time
    self.steps = np.zeros(n, np.int64)  # steps each worker has started (its reports)
    self.marks = {"eval": 0, "ckpt": 0}  # markers inserted so far, per kind
    self.stopped = False
    self.gid0 = 0  # global sequence numbers continue across a resume
    self.joining = set()  # rejoined workers (runtime.elastic) whose first group is not yet made
    self.view = GGView(0.0, self.buffer, self.started_at, self.estimates, lambda j: int(self.steps[j]))

  # -- what workers tell the authority -----------------------------------------------------------

  def report(self, worker: int, started_at: float, step_time: float, steps: int, last_gid: int) -> None:
    """Worker started its `steps`-th step at `started_at`; its previous step took `step_time`; it has
    executed every group of its queue up to `last_gid` (-1: none)."""
    self.started_at[worker] = started_at
    if step_time > 0:
      self.estimates[worker] = step_time
    self.steps[worker] = max(self.steps[worker], steps)
    self.buffer.done(worker, last_gid - self.gid0)

  def request(self, worker: int, want: int, now: float, step_time: float = 0.0) -> bool:
    """Worker asks for entry `want` of its queue (which is empty), being ready at `now` (a request
    sent ahead: when it expects to be), its newest step taking `step_time` (0: not given). Returns
    whether anything was generated for it."""
    if step_time > 0:  # what Smart GG plans with: the request's own, however late the report comes
      self.estimates[worker] = step_time
    if want < self.appended(worker):
      return False  # something was appended while the request travelled: the worker takes that
    self.buffer.requests += 1
    self.view.now = now
    before = len(self.buffer.groups)
    if not self.stopped:
      self.gg(worker, self.view)
    for g in self.buffer.groups[before:]:
      entry = (GROUP, self.gid0 + g.gid, g.members)
      joiners = tuple(m for m in g.members if m in self.joining)
      if joiners and len(joiners) < len(g.members):  # their first average: weight 0 (3.10)
        entry += (joiners,)
        self.joining.difference_update(joiners)
      for m in g.members:
        self.entries[m].append(entry)
    if want >= self.appended(worker):
      self.entries[worker].append((NONE,))
    return True

  def appended(self, worker: int) -> int:
    """Entries ever appended to the worker's queue."""
    return self.base[worker] + len(self.entries[worker])

  def trim(self, upto) -> None:
    """Forgets each queue's entries before index upto[w] (the authority has posted them) and the Group
    Buffer's global list: a long run's state stays bounded. The simulator never trims."""
    for w, u in enumerate(upto):
      del self.entries[w][: u - self.base[w]]
      self.base[w] = u
    self.buffer.forget()

  def tick(self) -> list:
    """Markers and STOP due by the steps reported so far; returns the (kind, id) markers inserted."""
    if self.cadence is None or self.stopped:
      return []
    done, c, out = int(self.steps.sum()), self.cadence, []
    for kind, every in (("eval", c.eval_every), ("ckpt", c.checkpoint_every)):
      while every and (self.marks[kind] + 1) * every <= done and done < c.total_steps:
        self.marks[kind] += 1
        self.mark(kind, self.marks[kind])
        out.append((kind, self.marks[kind]))
    if done >= c.total_steps:
      self.stop()
    return out

  def mark(self, kind: str, ident: int) -> None:
    for q in self.entries:
      q.append((MARK, kind, ident))

  def stop(self) -> None:
    if not self.stopped:
      self.stopped = True
      for q in self.entries:
        q.append((STOP,))

  # -- resume ------------------------------------------------------------------------------------

  def state(self) -> dict:
    """What a resumed authority needs (JSON): the sequence numbers, markers, steps, generator state."""
    return {
      "gid": self.gid0 + self.buffer.count,
      "marks": dict(self.marks),
      "steps": self.steps.tolist(),
      "estimates": self.estimates.tolist(),
      "gg": self.gg.state() if hasattr(self.gg, "state") else None,
    }

  def load(self, state: dict) -> None:
    """Continues from `state` with empty queues (every worker resumes at the same marker)."""
    self.gid0 = int(state["gid"])
    self.marks = dict(state["marks"])
    self.steps[:] = state["steps"]
    self.estimates[:] = state["estimates"]
    if state.get("gg") is not None:
      self.gg.load(state["gg"])


def fixed_entry(layouts, num_workers: int, worker: int, k: int) -> tuple:
  """The entry after `worker`'s k-th step (0-based) under a fixed schedule: its group in layout
  k mod period, or NONE when the layout leaves it alone. gid orders layouts first (every worker
  meets them in that order), then groups inside a layout (disjoint, so their order is free)."""
  layout = layouts[k % len(layouts)]
  for members in layout:
    if worker in members and len(members) > 1:
      members = tuple(sorted(members))
      return (GROUP, k * num_workers + members[0], members)
  return (NONE,)
