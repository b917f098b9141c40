"""The online Group Generator protocol (docs/design.md 3.7): one implementation for the simulator and the
runtime.

One authority (the `Service`) holds the Group Buffer and the generator's state. Every worker owns a
queue of entries that only the authority appends to:
  ("G", gid, members)   after your current step, average with `members` (all of them have it)
  ("N",)                the answer to your request when no group was made for you: step again
  ("M", kind, id)       a point of the global order (a checkpoint or an evaluation): act, then go on
  ("S",)                the run is over
  ("E", kind, w, inc)   a membership entry (runtime.elastic; Service.leave, Service.rejoin): worker w left
                        (kind "leave") or rejoined as its incarnation inc ("join") at this point of
                        the global order; a group made for a rejoined worker's first average carries
                        it as a fourth field, ("G", gid, members, joiners): its weight there is 0
Per local step a worker takes the head of its queue, markers first; with an empty queue it sends a
request carrying its measured step time and waits for its next entry. With request-ahead
(schedule.request_ahead, the default; algorithms.asks_ahead) a worker whose queue is empty when a step
*starts* sends the request for the entry after that step at once, so the round trip overlaps the
step. Only for generators whose groups do not depend on when they are made (Random GG, Group
Division, Moshpit's lockstep rounds): Smart GG and Moshpit's window group the workers that are ready
together, so their requests are sent when ready (sent ahead, a request would be decided on the speeds
before a straggler's first slow step). The authority generates groups on these actual arrivals and
appends each group to all its members' queues under one global sequence number (gid); markers and STOP
go to every queue at once.

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
    self.joining = set()  # rejoined workers (Service.rejoin) that have not reported a step since
    self.view = GGView(0.0, self.buffer, self.started_at, self.estimates, lambda j: int(self.steps[j]))

  # -- what workers tell the authority -----------------------------------------------------------

  def report(self, worker: int, started_at: float, step_time: float, steps: int, last_gid: int) -> None:
    """Worker started its `steps`-th step at `started_at`; its previous step took `step_time`; it has
    executed every group of its queue up to `last_gid` (-1: none)."""
    self.started_at[worker] = started_at
    if step_time > 0:
      self.estimates[worker] = step_time
    self.steps[worker] = max(self.steps[worker], steps)
    # A joiner steps only once a group of its has landed: from its first report on it holds a model of
    # the run's. Until then every group made with it carries it as a joiner (weight 0), so a first
    # group that failed (a member died in it) is followed by another, never by one where its fresh
    # model would count. A group made in the round trip after its first group landed carries it
    # again: it takes the others' mean once more (the steps it took since are lost; seen: up to 3 groups).
    self.joining.discard(worker)
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
      for m in g.members:
        self.entries[m].append(entry)
    if want >= self.appended(worker):
      self.entries[worker].append((NONE,))
    return True

  def appended(self, worker: int) -> int:
    """Entries ever appended to the worker's queue."""
    return self.base[worker] + len(self.entries[worker])

  def entry(self, worker: int, k: int) -> tuple:
    """Entry k of the worker's queue, k counting every entry ever appended (k >= base[worker])."""
    return self.entries[worker][k - self.base[worker]]

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

  # -- membership (docs/design.md 3.10): the rules both executors apply ---------------------------

  def leave(self, worker: int, inc: int | None = None, drop_pending: bool = True) -> None:
    """Worker left at this point of the global order (docs/design.md 3.10). From here on the generators
    see it dead (GGView.alive) and make no group with it; it is no longer joining; its queue is
    closed: nothing more is posted to it (appended() stays, and a rejoin starts a fresh queue there).
    Groups already made with it are not failed here: the simulator fails them first (fail_group), the
    runtime's fail in their collectives (runtime/membership.py).

    With `inc` (the runtime) every live queue gets ("E", "leave", worker, inc), so each live worker
    learns of the leave at this point of its order. The simulator passes none: its workers read no
    membership entries (an "E" would be taken as NONE, a step without a group) and its clock records
    the leave (trace.membership).

    `drop_pending` (the runtime): its pending groups leave its Group Buffer queue at once (its reports
    have stopped). The simulator passes False: fail_group has taken out each group it failed, and a
    group whose failure was already under way (a death noticed late, timeline's detect) stays pending
    for the worker until its first report after a rejoin, as the simulator has always counted it
    (Smart GG's view of the worker, its conflicts)."""
    self.view.alive[worker] = False
    if drop_pending:
      self.buffer.npending[worker] = 0
      self.buffer.queues[worker] = []
    self.joining.discard(worker)
    self._restart_queue(worker)
    if inc is not None:
      self._announce("leave", worker, inc)

  def rejoin(self, worker: int, now: float, inc: int | None = None) -> int:
    """Worker rejoins: live again, joining (the first group made with it carries it as a joiner,
    weight 0: it takes the others' mean, 3.10), ready now (Smart GG: started_at is a step ago), with a
    fresh queue; returns that queue's first index (the runtime's Feed counts from there; the
    simulator's next position). With `inc` (the runtime: its incarnation) every live queue gets
    ("E", "join", worker, inc) before it is live, so its own queue holds no entry of its return."""
    if inc is not None:
      self._announce("join", worker, inc)
    self.view.alive[worker] = True
    self.joining.add(worker)
    self.started_at[worker] = now - self.estimates[worker]
    self._restart_queue(worker)
    return self.appended(worker)

  def fail_group(self, gid: int, members: tuple, taken) -> None:
    """Group gid will not run (a member left; the simulator's rule, 3.10): for each member m, its
    entries from index taken[m] on (what m has not taken yet) that are the group become NONE, so a
    member that has not reached it steps again; and the group leaves the members' Group Buffer queues
    (Smart GG picks no worker with a pending group). A closed queue (a member that left) holds none."""
    buf = self.buffer
    for m in members:
      q = self.entries[m]
      for i in range(max(taken[m] - self.base[m], 0), len(q)):
        if q[i][0] == GROUP and q[i][1] == gid:
          q[i] = (NONE,)
      kept = [g for g in buf.queues[m] if g.gid != gid - self.gid0]
      buf.npending[m] -= len(buf.queues[m]) - len(kept)
      buf.queues[m] = kept

  def uncount_unfinished(self, worker: int, completed: int | None) -> int:
    """The step budget counts steps started (reports): a worker that died inside a step started one it
    never completed, so its last started step is taken off unless its last heartbeat (`completed`,
    this life's; None: no beat) shows it completed: the live make that step up. A beat may predate the
    worker's last completion, so the run may take one step more than its budget per death. Returns the
    steps taken off that the run will not make up (1 when STOP was out before the leave: the budget
    was handed out, the live end without it; else 0). The runtime's rule: the simulator's clock counts
    applied gradients instead."""
    started = int(self.steps[worker])
    if not started or (completed is not None and completed >= started):
      return 0
    self.steps[worker] = started - 1
    return int(self.stopped)

  def _announce(self, kind: str, worker: int, inc: int) -> None:
    for w, live in enumerate(self.view.alive):
      if live:
        self.entries[w].append((MEMBER, kind, worker, inc))

  def _restart_queue(self, worker: int) -> None:
    self.base[worker] += len(self.entries[worker])
    self.entries[worker] = []

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
