"""Elastic membership (runtime.elastic): workers die, stall, restart and rejoin while the others go on.

What jax.distributed gives on CPU (docs/design.md 3.8, 3.12, measured): with `jax_enable_recoverability`
the survivors of a death live on; a collective with a dead member fails in that group only, as a Python
exception (at once when its connection was set up before: every pair is connected before the run,
runtime/preduce.py); a connection is keyed by its ordered list of global device ids, and a list that
failed once (or that a process's earlier life used) never connects again. So a worker's life i runs on
its process's local CPU device i (`life_device`): a pair of lives has a device pair nobody used before.
So:

  death    the coordinator's watchdog sees a worker's heartbeat stop for runtime.heartbeat_timeout
           and the authority appends ("E", "leave", w, inc) to every live queue: no group made after
           it holds w (the generators read GGView.alive), its pending groups leave the Group Buffer,
           and removed/<w> tells a stalled w, should it continue, that it was removed
  in flight a group with a dead member fails for the members whose exchange with it fails; they go
           on without that average (keep their own model), as the simulator's members do (3.10).
           Members whose exchanges all succeeded (the death came after theirs) apply the mean: the
           outcome is recorded per member (trace "failed"), and the replay reproduces both
  stall    a SIGSTOPped worker is a death after the timeout; once continued, its watchdog reads
           removed/<w> and it exits (coord.EXIT_REMOVED) to be restarted: it never joins a group made
           after its removal (those hold no removed worker) and its peers' collectives with it time out
           (--xla_cpu_collective_timeout_seconds, set for elastic runs: host.recoverable_flags)
  rejoin   a restarted process (the launcher's --max_restarts, or by hand under its id) asks through
           join/<slot>; the authority appends ("E", "join", w, inc), gives it a queue of its own
           (keys q/<w>.<inc>) and marks it joining: the first group made with it carries it as a
           joiner, weight 0 (the others' mean is kept, and it takes that mean with fresh optimizer
           state: 3.10). Life i of a worker runs on its process's local device i, so pair (a, b) of
           lives (i, j) connects on devices (a_i, b_j), which no earlier connection used (`pair_devices`):
           any number of workers may rejoin at once, and again, while their lives fit their devices
           (`lives_of`: --cpu_devices, which the launcher sets to max_restarts + 1 for an elastic run);
           a rejoin beyond them is refused with one line (coord.EXIT_REFUSED, `exhausted`) and the run
           goes on without it
  end      the step budget counts every worker's steps (the live make up the dead ones', the one a
           dead worker started and never completed too: `leave`); the
           coordinator waits until every worker is done or gone, then sets ENDED, which the done
           workers wait for (a barrier's fixed membership would wait for a worker that died late)

A worker's incarnation 0 is its first process; each accepted rejoin adds one. Its heartbeat and start
report keys are per life (watchdog.beat_key, report_key), and the coordinator's watchdog watches the
life accepted last from its acceptance (Watchdog.watch_life): an earlier life's process cannot keep
the worker alive, and a life that dies before its first beat is noticed.

AD-PSGD has no authority and no global order: the coordinator's `Roster` serves the same membership
(the watchdog's leave, join/<slot>, removed/<w>) and publishes who is live and each worker's
incarnation in one key (ROSTER) that every worker polls (`RosterView`). Its step budget is the run's
total: each local step first takes a ticket (TICKETS, an atomic increment), so the live make up the
dead ones' steps; a leave gives the dead life's ticket back (runtime/adpsgd.py has the rest).
"""

import threading
import time

import numpy as np
from absl import logging

from ripples_jax.distributed import wire
from ripples_jax.distributed.coord import PREFIX, beat_key, values_in_order, worker_process

RUNNING = f"{PREFIX}/running/0"  # set by the coordinator once the run has started
JOINS = f"{PREFIX}/joins"  # the join slots' counter: a rejoiner takes the next slot, then writes it
# A slot taken and still empty this long while a later one is taken is skipped by the authority (its
# rejoiner was killed between the two writes, or a stranger took it): a rejoiner writes its slot at once.
SLOT_WAIT_S = 3.0
ENDED = f"{PREFIX}/ended"  # set by the coordinator once every worker is done or gone: the workers may exit


def started(kv) -> bool:
  """Whether the run has started: a worker process starting now is a restart, and rejoins."""
  return bool(kv.key_value_dir_get(f"{PREFIX}/running/"))


def queue_prefix(worker: int, inc: int) -> str:
  """Worker w's queue keys in its incarnation inc (incarnation 0: the non-elastic layout)."""
  return f"{PREFIX}/q/{worker}" if inc == 0 else f"{PREFIX}/q/{worker}.{inc}"


def request_prefix(worker: int, inc: int) -> str:
  return f"{PREFIX}/req/{worker}" if inc == 0 else f"{PREFIX}/req/{worker}.{inc}"


def report_key(worker: int, inc: int) -> str:
  """Worker w's start reports (progress) in its incarnation inc: one key per life, as its heartbeat's
  (watchdog.beat_key), so an earlier life's process cannot report for the life that replaced it."""
  return f"{PREFIX}/started/{worker}" if inc == 0 else f"{PREFIX}/started/{worker}.{inc}"


def life_of(key: str) -> tuple[int, int]:
  """(worker, incarnation) of a per-life key (report_key, beat_key)."""
  w, _, inc = key.rsplit("/", 1)[1].partition(".")
  return int(w), int(inc or 0)


def life_device(devices, inc: int):
  """The device life `inc` of a worker runs on, among its process's local devices (global order): life
  i on device i, so a restarted process never reuses a device id its earlier lives connected with."""
  if not 0 <= inc < len(devices):
    raise ValueError(f"life {inc} beyond the {len(devices)} CPU devices of its process (one device per life)")
  return devices[inc]


def pair_key(pair: tuple, incs) -> tuple:
  """A pair's connection key: its members' lives (sorted pair order). Each pair of lives has a device
  pair of its own (`pair_devices`), so no key is ever used twice with a failed connection."""
  return (int(incs[pair[0]]), int(incs[pair[1]]))


def pair_devices(pair: tuple, key: tuple, devices_of) -> list:
  """The mesh rows of a pair's connection `key` (pair_key): [worker's devices of its life], in pair order."""
  return [[life_device(devices_of[m], life)] for m, life in zip(pair, key)]


def handshake(
  kv,
  me: int,
  pair: tuple,
  key: tuple,
  timeout_s: float,
  poll_s: float = 0.02,
  gen: int = 0,
  attempt=None,
) -> str | None:
  """Before a pair of lives connects for the first time (a rejoined life's pairs, a pair's second
  connection), both sides agree in the store that both are there. gloo's own rendezvous waits 30 s for
  a dead life's keys (its store timeout, not the collective timeout), and every worker whose exchanges
  come after that one in the global order waits behind it, its own exchanges timing out, which breaks
  pairs of live workers. Each side writes hello/<lives>/<me> and rewrites it every poll while it waits
  (a beat); the first side to know the outcome writes it to .../decision, created once (the store
  refuses a second create), so both sides act on one decision: "go", "left" (the other life was
  removed, removed/<w>: its death noticed after heartbeat_timeout) or "timeout" (no proof of the other
  within the collective timeout). Returns None for "go", else the cause.
  Proof of life: "go" only on a hello that appeared or beat while this side watched. A hello that was
  there at the first look may be a dead life's (killed while it waited here: measured, 30 s of gloo's
  rendezvous for the side that came later, then a cascade of timeouts behind it), so it counts only
  once it beats again. A live waiter beats every poll, so the cost is one poll.
  `gen`: the pair's connection generation (runtime/preduce.py: a second connection after a timeout);
  `attempt`: the group both sides are in (a gid, an exchange id), so that a meeting that timed out
  consumes nothing and the pair's next group meets afresh."""
  other = pair[1] if pair[0] == me else pair[0]
  life = key[pair.index(other)]
  name = f"{PREFIX}/hello/{pair[0]}.{key[0]}-{pair[1]}.{key[1]}" + (f"/g{gen}" if gen else "")
  name += "" if attempt is None else f"/a{attempt}"
  deadline, beat, first = time.monotonic() + timeout_s, 0, ()
  while True:
    beat += 1
    kv.key_value_set(f"{name}/{me}", str(beat), allow_overwrite=True)
    seen = dict(kv.key_value_dir_get(f"{name}/"))
    outcome, hello = seen.get(f"{name}/decision"), seen.get(f"{name}/{other}")
    if first == ():  # the other's hello at the first look: evidence only once it changes
      first = hello
    if outcome is None:
      if hello is not None and hello != first:
        outcome = "go"
      elif removed_life(kv, other) >= life:
        outcome = "left"
      elif time.monotonic() > deadline:
        outcome = "timeout"
    if outcome is not None:
      try:
        kv.key_value_set(f"{name}/decision", outcome)  # created once: the first side's outcome holds
      except Exception:  # noqa: BLE001  the other side decided first: its outcome is the pair's
        outcome = kv.blocking_key_value_get(f"{name}/decision", 10_000)
      return None if outcome == "go" else outcome
    time.sleep(poll_s)


def removed_life(kv, worker: int) -> int:
  """The newest life of `worker` the coordinator removed (removed/<w>), -1 if none."""
  return int(dict(kv.key_value_dir_get(f"{PREFIX}/removed/")).get(removed_key(worker), -1))


def lives_of(devices, n: int) -> int:
  """How many lives every worker of an async run can have: the fewest local devices of a worker
  process (`devices`: jax.devices(), every process's; worker w is process w + 1)."""
  counts = [sum(d.process_index == worker_process(w) for d in devices) for w in range(n)]
  return min(counts) if counts else 1


def exhausted(worker: int, incs, lives: int) -> bool:
  """Whether `worker`'s next life would have no device of its own (lives_of: one per life)."""
  return incs[worker] + 1 >= lives


def refusal(worker: int, lives: int) -> str:
  """The one line a rejoin beyond the devices is refused with."""
  return (
    f"worker {worker} has used its {lives} lives: one CPU device per life (--cpu_devices={lives}; the "
    "launcher gives an elastic run max_restarts + 1, docs/design.md 3.12)"
  )


def next_life(kv, worker: int) -> int:
  """The life a restarted process of `worker` will most likely be given (1 + the newest life the run's
  answers to join/<slot> named for it), read before it asks: it compiles on that life's device while
  the run goes on. The answer decides (a wrong guess costs a second warm-up: process.ask_back)."""
  asked = {k.rsplit("/", 1)[1]: v for k, v in kv.key_value_dir_get(f"{PREFIX}/join/")}
  lives = [
    int(v.split(" ", 1)[0])
    for k, v in kv.key_value_dir_get(f"{PREFIX}/joined/")
    if asked.get(k.rsplit("/", 1)[1]) == str(worker)
  ]
  return max(lives, default=0) + 1


# -- the authority's side (it holds the Service) ----------------------------------------------------


def completed_steps(kv, worker: int, inc: int) -> int | None:
  """The local steps `worker` had completed by its last heartbeat in life `inc` (None: no beat of that
  life), read from its heartbeat key, which outlives the process."""
  key = beat_key(worker, inc)
  value = dict(kv.key_value_dir_get(f"{PREFIX}/hb/")).get(key)
  got = None if value is None else wire.beat(key, value)
  if got is None:
    return None
  steps, _, _, life = got
  return steps if life == inc else None


def leave(service, worker: int, inc: int, completed: int | None = None) -> int:
  """Worker's incarnation inc left: its started step uncounted unless `completed` (its last beat, this
  life's) shows it done, then Service.leave with the membership entry (both rules are the Service's).
  Returns the steps taken off that the run will not make up (Service.uncount_unfinished)."""
  unmade = service.uncount_unfinished(worker, completed)
  service.leave(worker, inc)
  return unmade


def rejoin(service, worker: int, inc: int, now: float) -> int:
  """Worker rejoins as incarnation inc (Service.rejoin has the rules); returns its new queue's first
  index (its Feed counts from there)."""
  return service.rejoin(worker, now, inc)


# -- the rejoining worker's side --------------------------------------------------------------------


def ask_to_join(kv, worker: int, timeout_s: float) -> dict:
  """Asks the authority to take this worker back; blocks until it answers. The answer: inc, taken (its
  queue's first index), now (the run's clock when answered), marks (checkpoint and eval markers in
  the global order so far), incs (every worker's incarnation), g0 (groups made so far), refused (a
  line, or absent)."""
  slot = int(kv.key_value_increment(JOINS, 1)) - 1
  sent = time.perf_counter()
  kv.key_value_set(f"{PREFIX}/join/{slot}", str(worker))
  answer = kv.blocking_key_value_get(f"{PREFIX}/joined/{slot}", int(timeout_s * 1000))
  got = time.perf_counter()
  kv.key_value_delete(f"{PREFIX}/joined/{slot}")  # read once, by this rejoiner only
  inc, taken, now, ckpt, evals, incs, g0, *refused = answer.split(" ", 7)
  return {
    "inc": int(inc),
    "taken": int(taken),
    "now": float(now) + (got - sent) / 2,  # the answer's age: half the round trip
    "received": got,
    "ckpt": int(ckpt),
    "evals": int(evals),
    "incs": [int(i) for i in incs.split(",")],
    "g0": int(g0),
    "refused": refused[0] if refused else None,
  }


def answer(kv, slot: int, inc: int, taken: int, now: float, marks: dict, incs, g0: int, refused: str = ""):
  value = f"{inc} {taken} {now!r} {marks['ckpt']} {marks['eval']} {','.join(map(str, incs))} {g0}" + (
    f" {refused}" if refused else ""
  )
  kv.key_value_set(f"{PREFIX}/joined/{slot}", value)


def removed_key(worker: int) -> str:
  return f"{PREFIX}/removed/{worker}"


# -- without an authority (AD-PSGD): the coordinator's roster, the workers' view of it --------------

ROSTER = f"{PREFIX}/roster/0"  # "<version> <incarnations, comma-separated> <alive, one 0/1 per worker>"
TICKETS = f"{PREFIX}/ad/tickets"  # local steps taken by every worker so far (each takes one first)


def encode_roster(version: int, incs, alive) -> str:
  return f"{version} {','.join(map(str, incs))} {''.join('1' if a else '0' for a in alive)}"


def decode_roster(value: str) -> tuple:
  version, incs, alive = value.split()
  return int(version), [int(i) for i in incs.split(",")], np.array([a == "1" for a in alive])


def give_back_ticket(kv, budget: int) -> int:
  """A dead worker's ticket goes back to the run: a worker takes its next ticket right after its last
  step, so a death almost always comes inside a step it holds a ticket for (if it held none, the run
  takes one step more than its budget). Once a ticket past the budget has been refused, the worker
  refused has ended and the budget stays spent for all (the give-back is undone: a ticket freed then
  would be taken by some live workers and not others); returns 1 then (the step is not made up), else
  0 (the live are all still taking tickets: the next one takes it)."""
  if int(kv.key_value_increment(TICKETS, -1)) < budget:
    return 0
  kv.key_value_increment(TICKETS, 1)
  return 1


def take_ticket(kv, budget: int) -> int | None:
  """This worker's next step's number in the run (1, 2, ...), if the run's step budget (num_steps x
  num_workers local steps in all) has one left; taking it counts it. None: the budget is spent."""
  ticket = int(kv.key_value_increment(TICKETS, 1))
  return ticket if ticket <= budget else None


class Roster:
  """Membership without an authority (AD-PSGD): the coordinator's watchdog calls leave(w, inc) for a
  silent worker; a restarted one asks through join/<slot>. Each change is published to ROSTER before
  the rejoiner is answered, so every request the rejoiner makes finds its peers' view of it live (a
  peer polls ROSTER every heartbeat_s: until then it picks no rejoiner and fails fast at a dead one)."""

  def __init__(self, kv, n: int, budget: int, now=None, lives: int = 1):
    self.kv, self.n, self.budget, self.now = kv, n, budget, now or time.perf_counter
    self.lives = lives  # lives per worker: its process's CPU devices (lives_of)
    self.incs, self.alive, self.version = [0] * n, [True] * n, 0
    self.events = []  # (run time, worker, "leave" | "rejoin" | "refused"): summary.json's membership
    self.unmade = 0  # dead workers' steps the run did not make up (give_back_ticket)
    self.on_join = None  # (w, inc): a new life accepted (the coordinator's watchdog watches it from then)
    self._lock = threading.RLock()  # the watchdog's thread (leave) and the joins thread (join)
    self._stop = threading.Event()
    self._publish()
    self._thread = threading.Thread(target=self._joins, name="ripples-roster-joins", daemon=True)

  def start(self):
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def _publish(self) -> None:
    self.version += 1
    self.kv.key_value_set(ROSTER, encode_roster(self.version, self.incs, self.alive), allow_overwrite=True)

  def leave(self, w: int, inc: int) -> None:
    with self._lock:
      if not self.alive[w] or inc != self.incs[w]:
        return  # already out, or the silence was an earlier life's
      self.alive[w] = False
      self.unmade += give_back_ticket(self.kv, self.budget)
      self.kv.key_value_set(removed_key(w), str(inc), allow_overwrite=True)
      self._publish()
      self.events.append((self.now(), w, "leave"))
      logging.warning("worker %d (incarnation %d) left the run; the others go on", w, inc)

  def _joins(self) -> None:
    try:
      for slot, value in enumerate(
        values_in_order(self.kv, f"{PREFIX}/join", self._stop, skip=(JOINS, SLOT_WAIT_S), consume=True)
      ):
        if value is None:  # taken and left empty: skipped, the next rejoin still lands
          wire.bad(f"{PREFIX}/join/{slot}", "", f"empty {SLOT_WAIT_S:g} s while a later slot is taken")
          continue
        w = wire.worker_id(f"{PREFIX}/join/{slot}", value, len(self.alive))
        if w is not None:  # a malformed slot is skipped (one warning): the next rejoin still lands
          self.join(w, slot)
    except Exception as e:  # noqa: BLE001  a store error (values are decoded above): the watchdog reports it
      logging.warning("the roster's joins listener stopped: %s", e)
      return

  def join(self, w: int, slot: int) -> None:
    with self._lock:
      if self.alive[w]:  # a restart before its death was noticed: it left first
        self.leave(w, self.incs[w])
      refused = ""
      if int(self.kv.key_value_increment(TICKETS, 0)) >= self.budget:
        refused = "the run has ended"
      elif exhausted(w, self.incs, self.lives):
        refused = refusal(w, self.lives)
      marks = {"ckpt": 0, "eval": 0}  # no markers: AD-PSGD checkpoints its final state only
      if refused:
        self.events.append((self.now(), w, "refused"))
        answer(self.kv, slot, self.incs[w], 0, self.now(), marks, self.incs, 0, refused)
        return
      self.incs[w] += 1
      self.alive[w] = True
      if self.on_join is not None:
        self.on_join(w, self.incs[w])
      self._publish()
      answer(self.kv, slot, self.incs[w], 0, self.now(), marks, self.incs, 0)
      self.events.append((self.now(), w, "rejoin"))
      logging.warning("worker %d rejoined the run (incarnation %d)", w, self.incs[w])


class RosterView:
  """A worker's view of the Roster: `incs` and `alive`, polled every `interval_s` from a thread;
  on_change(incs, alive) is called (from that thread) after each new version."""

  def __init__(self, kv, interval_s: float, on_change=None):
    self.kv, self.interval, self.on_change = kv, interval_s, on_change
    value = kv.blocking_key_value_get(ROSTER, 60_000)
    self.version, self.incs, alive = wire.require(wire.roster(ROSTER, value, None), ROSTER, value)
    self.alive = np.array(alive)
    self.polled_at = time.monotonic()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="ripples-roster-view", daemon=True)

  def start(self):
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def fresh(self) -> "RosterView":
    """Polls now if the last poll is older than the interval (a process that was stopped: it must not
    act on the view it had before the stop); returns self."""
    if time.monotonic() - self.polled_at > self.interval:
      self.poll()
    return self

  def poll(self) -> None:
    # Its thread and the worker's (fresh) may poll at once: one of them applies a version, once.
    with self._lock:
      self.polled_at = time.monotonic()
      value = dict(self.kv.key_value_dir_get(f"{PREFIX}/roster/")).get(ROSTER)
      if value is None:
        return
      got = wire.roster(ROSTER, value, len(self.incs))
      if got is None:  # malformed (one warning): this view keeps the last good version
        return
      version, incs, alive = got
      alive = np.array(alive)
      if version > self.version:
        self.version, self.incs, self.alive = version, incs, alive
        if self.on_change is not None:
          self.on_change(incs, alive)

  def _run(self) -> None:
    while not self._stop.wait(self.interval):
      try:
        self.poll()
      except Exception as e:  # noqa: BLE001  a store error (values are decoded in poll): the watchdog reports it
        logging.warning("the roster view stopped polling: %s", e)
        return


def channel(server: int, server_inc: int, client: int, client_inc: int) -> str:
  """The keys of client's requests to server (AD-PSGD): one channel per pair of lives, so a restarted
  process never reads what its earlier life was sent, nor is sent what was meant for that life."""
  if server_inc == 0 and client_inc == 0:
    return f"{PREFIX}/ad/{server}/{client}"
  return f"{PREFIX}/ad/{server}.{server_inc}/{client}.{client_inc}"


def exchange_id(client: int, client_inc: int, server: int, server_inc: int, r: int) -> str:
  """An AD-PSGD exchange's name in both traces (its channel's r-th request)."""
  lives = f"@{client_inc}.{server_inc}" if client_inc or server_inc else ""
  return f"{client}.{server}.{r}{lives}"
