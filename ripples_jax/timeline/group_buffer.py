"""Ripples' Group Buffer protocol on the clock (Random GG, Group Division, Smart GG, Static GG) and
its leave/join rules."""

import dataclasses
import itertools

from ripples_jax.schedule.group_gen import Fixed
from ripples_jax.schedule.online import GROUP, Service, fixed_entry
from ripples_jax.timeline.clock import _Clock
from ripples_jax.timeline.costs import AuthorityCost, Network
from ripples_jax.timeline.trace import AVG, COMM, WAIT


def _group_buffer(clock: _Clock, net: Network, gg, rtt: float, ahead: bool, server: AuthorityCost) -> None:
  """Ripples as the online protocol (schedule/online.py): per local step a worker takes the head of
  its queue; with an empty queue it asks the Group Generator, whose answer arrives `rtt` seconds after
  the request (handled at its midpoint). With `ahead` (generators whose groups do not depend on when
  they are made: online.asks_ahead) a worker whose queue is empty when a step starts sends the request
  for the entry after that step right away, so the round trip overlaps the step. A fixed schedule
  (group_gen.Fixed) has no generator: the entry
  after each step is known locally and costs nothing."""
  _GroupBuffer(clock, net, gg, rtt, ahead, server).run()


@dataclasses.dataclass
class _BufferState:
  """The Group Buffer protocol's state (shared objects: _BufferMembership changes the first six when
  workers leave and join)."""

  pos: list  # next entry of each worker's queue
  asked: list  # the queue index of a worker's request in flight
  blocked: list  # since when a worker waits for its answer
  groups: dict  # gid -> [members, arrived set, arrival times]: groups some member has reached
  joining: set  # rejoined workers whose first group has not landed: no model to step on (3.10)
  released: dict  # gid -> its live members: a member left while its average was in flight
  last_gid: list  # each worker's newest group, for its start report to the generator
  met: set  # member sets (or pairs) whose set-up has been paid
  busy_until: float = 0.0  # the authority serves one request at a time: when it is free
  failed_with: set = dataclasses.field(default_factory=set)  # (live, dead) pairs: a group failed on them

  @classmethod
  def fresh(cls, n: int) -> "_BufferState":
    return cls([0] * n, [None] * n, [None] * n, {}, set(), {}, [-1] * n, set())


def held_members(live: list, dead: list, failed_with: set) -> set:
  """The live members of a group that wait until a dead member's removal. Each member exchanges with
  the others in rank order (runtime/preduce.py); one whose pair with a dead member failed before waits
  at that member in the handshake, and every member it reaches after its wait (a higher rank) waits
  for it, and so on; a first failure with a dead member is at once."""
  wait_at = {
    m: min(w for w in dead if (m, w) in failed_with) for m in live if any((m, w) in failed_with for w in dead)
  }
  while True:
    more = {
      x: min(h for h in wait_at if x > wait_at[h])
      for x in live
      if x not in wait_at and any(x > wait_at[h] for h in wait_at)
    }
    if not more:
      return set(wait_at)
    wait_at.update(more)


class _GroupBuffer:
  """The Group Buffer protocol of `_group_buffer`: each method below handles one clock event."""

  def __init__(self, clock: _Clock, net: Network, gg, rtt: float, ahead: bool, server: AuthorityCost):
    self.clock, self.net, self.gg, self.rtt, self.ahead, self.server = clock, net, gg, rtt, ahead, server
    self.fixed = isinstance(gg, Fixed)
    self.service = None if self.fixed else Service(clock.n, gg, estimate=clock.speed.base_time)
    self.st = _BufferState.fresh(clock.n)
    self.hooks = None  # _BufferMembership, with a leave plan only
    clock.trace.buffer = self.service.buffer if self.service else None

  def run(self) -> None:
    clock, service = self.clock, self.service
    if clock.plan:
      self.hooks = _BufferMembership(clock, service, self.st, self.go_on, self.ask, self.start)
      clock.plan_membership(self.hooks.leave, self.hooks.rejoin, self.died)
    for w in range(clock.n):
      self.start(w)
    clock.run()
    if service is not None:
      clock.trace.conflicts = service.buffer.conflicts
      clock.trace.requests = service.buffer.requests

  def start(self, w: int) -> None:
    clock, service, st = self.clock, self.service, self.st
    if service is not None:  # what a worker's start report tells the generator (instant here)
      service.report(w, clock.now, clock.last_time[w], clock.iterations[w] + 1, st.last_gid[w])
    clock.start_compute(w, self.on_finish)
    # With `ahead`, an empty queue asks now for the entry after this step: the round trip overlaps it.
    if service is not None and self.ahead and st.pos[w] >= service.appended(w) and st.asked[w] is None:
      estimate = clock.last_time[w] or clock.speed.base_time
      self.ask(w, clock.now + estimate)

  def ask(self, w: int, ready_at: float) -> None:
    st, clock = self.st, self.clock
    st.asked[w] = st.pos[w]
    at_authority = self.queue_at_authority if self.server.service else self.handle
    clock.at_w(clock.now + self.rtt / 2, w, at_authority, w, st.pos[w], ready_at)

  def queue_at_authority(self, w: int, want: int, ready_at: float) -> None:
    """FIFO: the request is served once the requests before it are."""
    st, clock = self.st, self.clock
    begin = max(clock.now, st.busy_until)
    st.busy_until = begin + self.server.service
    clock.at_w(st.busy_until, w, self.handle, w, want, ready_at)

  def handle(self, w: int, want: int, ready_at: float) -> None:
    """At the authority: generate on this arrival, answer after rtt / 2."""
    self.service.request(w, want, ready_at)
    self.clock.at_w(self.clock.now + self.rtt / 2, w, self.answered, w)

  def answered(self, w: int) -> None:
    st, clock = self.st, self.clock
    if st.blocked[w] is not None:
      clock.interval(w, WAIT, st.blocked[w], clock.now)
      st.blocked[w] = None
      self.take(w)

  def setup_cost(self, members) -> float:
    server, met = self.server, self.st.met
    units = [tuple(members)] if server.setup_unit == "group" else list(itertools.combinations(members, 2))
    new = [u for u in units if u not in met]
    met.update(new)
    return server.setup * len(new)

  def on_finish(self, w: int) -> None:
    self.clock.applied(w, w)
    if not self.clock.stopped:
      self.take(w)

  def take(self, w: int) -> None:
    """After a step: the head of w's queue; with an empty one, w waits for its answer (and asks, if no
    request of it is in flight)."""
    clock, service, st = self.clock, self.service, self.st
    if self.fixed:
      entry = fixed_entry(self.gg.layouts, clock.n, w, clock.iterations[w] - 1)
    elif st.pos[w] < service.appended(w):
      entry = service.entry(w, st.pos[w])
      if st.asked[w] == st.pos[w]:
        st.asked[w] = None
      st.pos[w] += 1
    else:
      st.blocked[w] = clock.now
      if st.asked[w] is None:
        self.ask(w, clock.now)
      return
    if entry[0] == GROUP:
      self.arrive(w, entry)
    else:
      self.go_on(w)

  def go_on(self, w: int) -> None:
    """No group after this step (or its group failed): step again, or, rejoining, ask again."""
    if w in self.st.joining:
      self.hooks.retry(w)
    else:
      self.start(w)

  def arrive(self, w: int, entry: tuple) -> None:
    """w reaches its group; the last member to arrive starts the average."""
    clock = self.clock
    _, gid, members = entry[:3]
    g = self.st.groups.setdefault(gid, [members, set(), {}])
    g[1].add(w)
    g[2][w] = clock.now
    if clock.unnoticed:
      self.fail_if_dead(gid)
    elif len(g[1]) == len(members):
      self.arrive_complete(gid)

  def arrive_complete(self, gid: int) -> None:
    """Every member is there: the average runs."""
    clock = self.clock
    members, _, times = self.st.groups[gid]
    d = self.net.allreduce(len(members)) + (self.setup_cost(members) if self.server.setup else 0.0)
    for m in members:
      clock.interval(m, WAIT, times[m], clock.now)
      clock.interval(m, COMM, clock.now, clock.now + d)
    # Not clock.at_w: the average is no one member's; a member leaving meanwhile fails it (released).
    clock.at(clock.now + d, self.group_end, gid)

  def died(self, w: int) -> None:
    """A death not yet noticed (detect > 0): groups whose live members are all there fail now."""
    for gid in [gid for gid, g in self.st.groups.items() if w in g[0]]:
      self.fail_if_dead(gid)

  def fail_if_dead(self, gid: int) -> None:
    """A group with a dead, unnoticed member, once its live members have all arrived: they exchange
    among themselves (the runtime's pairs), find the dead one gone, and go on without the average.

    Only the first time a live member meets that dead one: the failure moves the pair to a fresh
    connection (runtime/preduce.py), met through the handshake, which waits until the dead worker is
    removed (runtime/membership.py). Such a member, and those its wait holds up (held_members), stay
    in the group; the removal (_BufferMembership.leave, `detect` after the death) fails it and they go
    on then. The others go on now."""
    clock, st = self.clock, self.st
    members, arrived, times = st.groups[gid]
    live = [m for m in members if m not in clock.unnoticed]
    if len(live) == len(members):
      if len(arrived) == len(members):  # nobody in it is dead: the average runs as usual
        self.arrive_complete(gid)
      return
    if not set(live) <= arrived or gid in st.released:
      return
    dead = [m for m in members if m in clock.unnoticed]
    held = held_members(live, [w for w in dead if w not in arrived], st.failed_with)  # dead in flight: fails
    st.failed_with |= {(m, w) for m in live for w in dead}
    go = [m for m in live if m not in held]
    d = self.net.allreduce(len(live)) if len(live) > 1 else 0.0
    for m in go:
      clock.interval(m, WAIT, times[m], clock.now)
      clock.interval(m, COMM, clock.now, clock.now + d)
    if not held:
      st.released[gid] = set(live)  # group_end: the live members go on, no average
      clock.at(clock.now + d, self.group_end, gid)
      return
    for m in go:  # out of the group: the removal releases the held ones only
      arrived.discard(m)
      clock.at_w(clock.now + d, m, self.go_on, m)

  def group_end(self, gid: int) -> None:
    st = self.st
    members = st.groups.pop(gid)[0]
    if st.released and gid in st.released:  # a member left during the average: it failed (3.10)
      for m in sorted(st.released.pop(gid)):
        self.go_on(m)
      return
    if st.joining and not st.joining.isdisjoint(members):
      self.hooks.first_group(members)
    else:
      self.clock.emit(AVG, members)
    for m in members:
      st.last_gid[m] = gid
      self.start(m)


class _BufferMembership:
  """Leaving and joining under the Group Buffer (Random GG, Group Division, Smart GG; 3.10).

  A leaving worker's groups that have not run fail: members that have not reached one skip it (its
  entry becomes NONE: they step again), members waiting at one go on at once, and the members of an
  average in flight go on when it would have ended, without it. The alternative, averaging the
  survivors alone, is not what a runtime can do: a collective with a dead member fails in that group
  only (3.8), and averaging the rest would need another member set, i.e. another group agreed by the
  authority. What the authority does at a leave and a rejoin is the runtime's too (Service.leave,
  Service.rejoin: no group made afterwards holds the worker; a rejoin gets a fresh queue); failing
  the groups is Service.fail_group. A rejoined worker asks at once; it takes no step before its first
  group lands, where it has weight 0 (clock.joined)."""

  def __init__(self, clock: _Clock, service: Service, st: _BufferState, go_on, ask, start):
    self.clock, self.service, self.st = clock, service, st
    self.go_on, self.ask, self.start = go_on, ask, start
    service.view.alive = clock.alive

  def _fail(self, gid: int, members: tuple) -> None:
    self.service.fail_group(gid, members, self.st.pos)

  def leave(self, w: int) -> None:
    clock, st, service = self.clock, self.st, self.service
    for entry in service.entries[w][st.pos[w] - service.base[w] :]:
      if entry[0] == GROUP:
        self._fail(entry[1], entry[2])
    for gid, (members, arrived, times) in list(st.groups.items()):
      if w not in members or (clock.detect and gid in st.released):  # failing already (fail_if_dead)
        continue
      self._fail(gid, members)
      if len(arrived) == len(members):  # its average is in flight: the rest go on at its end
        st.released[gid] = {m for m in members if clock.alive[m]}
        continue
      del st.groups[gid]  # the others waiting at it go on now
      for m in sorted(arrived):
        if m in clock.unnoticed:  # another dead one, arrived before its death: its life has ended
          continue
        clock.interval(m, WAIT, times[m], clock.now)
        if m != w:
          self.go_on(m)
    for live in st.released.values():
      live.discard(w)
    st.failed_with = {p for p in st.failed_with if w not in p}  # its next life meets afresh
    if st.blocked[w] is not None:
      clock.interval(w, WAIT, st.blocked[w], clock.now)
    st.blocked[w] = st.asked[w] = None
    st.joining.discard(w)
    service.leave(w, drop_pending=False)  # the failed groups left the buffer one by one (_fail)

  def rejoin(self, w: int) -> None:
    """It asks at once and waits, from its fresh queue's first index (every group of its earlier life
    failed at the leave). Smart GG sees it ready now (Service.rejoin)."""
    st = self.st
    st.pos[w] = self.service.rejoin(w, self.clock.now)
    st.joining.add(w)
    st.blocked[w] = self.clock.now
    self.ask(w, self.clock.now)

  def retry(self, w: int) -> None:
    """A rejoined worker got no group (Smart GG skipped it, or its group failed): it asks again a base
    step later (asking at once could repeat at one instant forever). Alone, it starts from its own
    parameters, with fresh optimizer state."""
    clock = self.clock
    if clock.alive.sum() == 1:
      self.first_group((w,))
      self.start(w)
      return
    self.st.blocked[w] = clock.now
    clock.at_w(clock.now + clock.speed.base_time, w, lambda: self.ask(w, clock.now))

  def first_group(self, members: tuple) -> None:
    """A group with rejoined members lands: the others average among themselves and every joiner
    takes that mean (its own weight is 0, so the others' mean is kept). A group of joiners only
    averages as usual: none of them holds a newer model."""
    joiners = [m for m in members if m in self.st.joining]
    others = tuple(m for m in members if m not in self.st.joining)
    if len(others or members) > 1:
      self.clock.emit(AVG, others or members)
    for j in joiners:
      self.clock.joined(j, others[0] if others else j)
      self.st.joining.discard(j)
