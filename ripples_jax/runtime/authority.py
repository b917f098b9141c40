"""The online Group Generator in the runtime: one authority thread, queues in the coordination service.

Transport (the jax.distributed key-value store; no server of ours):
  ripples/q/<w>/<p>/<j>  the j-th batch of worker w's queue (page p = j // PAGE): its entries
                         (online.encode) joined by "|", written once by the authority; the worker
                         deletes a page (one call: the store deletes a key's whole directory) once
                         it has read its last batch, and its last page when it takes STOP
  ripples/req/<w>/<p>/<r>  worker w's r-th request: "<queue index it asks for> <when it is ready>
                         <its newest step time>[ <its start report>]" (the step time rides on the
                         request: the start report is sent from a thread and may arrive after it; a
                         request sent as a step starts carries that step's report, which is then not
                         sent on its own); the authority deletes a page once it has read it
  ripples/started/<w>    "<steps started> <started at> <last step time> <last gid> <checkpoint markers
                         passed>", overwritten by w (a rejoined worker's life inc > 0: started/<w>.<inc>,
                         read for its current life only: membership.report_key)
So the store holds O(workers) keys however long the run, and a request costs the store about five
calls, not seven (measured: benchmarks.bench_authority).
The authority (threads of the coordinator, process 0, which trains nothing: the paper's GG is one
service; runtime/coordinator.py) wakes on requests (one
listener thread per worker, blocked in a get of that worker's next request key) and otherwise polls
the start reports every `poll_s` for markers and the end of the run. A round serves every request
that has arrived: one read of the start reports, then generation for each request in arrival order,
then one write per worker whose queue grew. Posted entries and the Group Buffer's global list are
trimmed after each round (Service.trim), and a checkpoint's snapshot goes to `on_checkpoint` (the
coordinator writes it to a file) or is kept until taken (take_snapshot), so the authority's state is
bounded too. Times are seconds since the run's
common start (the start barrier), so no host clocks are compared.

A worker's `Feed` keeps a get of its next queue key outstanding in a thread, so an entry appended
while the worker computes is already local when the step ends; with request-ahead it also sends its
request when a step starts, so that only a round trip longer than the step is waited for.
"""

import collections
import concurrent.futures
import json
import math
import os
import queue
import threading
import time

import numpy as np
from absl import logging

from ripples_jax.distributed import wire
from ripples_jax.distributed.kvstore import PAGE, PREFIX, Either, paged, values_in_order
from ripples_jax.runtime import membership
from ripples_jax.schedule.online import MARK, STOP, encode


def snapshot_file(workdir: str, ident) -> str:
  """authority/<ident>.json: the authority's state at checkpoint marker ident (runtime/coordinator.py)."""
  return os.path.join(workdir, "authority", f"{ident}.json")


def out_at_marker(workdir: str, ident: int) -> set:
  """The workers a resume from checkpoint marker `ident` goes on without (out_at of its snapshot's
  membership; none when the snapshot is missing or the run is not elastic). Every process reads the
  same file, so all agree (distributed.resume's excused)."""
  try:
    with open(snapshot_file(workdir, ident)) as f:
      return out_at(json.load(f).get("members"))
  except (OSError, ValueError):
    return set()


def out_at(members: dict | None) -> set:
  """The workers a resume from a snapshot with this membership continues without (and that rejoin):
  those not live at it, and those live but still joining (no checkpoint of theirs is at it)."""
  if not members:
    return set()
  return {w for w, live in enumerate(members["alive"]) if not live} | set(members.get("joining", ()))


class Authority:
  """Serves a `schedule.online.Service` to every worker. The service's state when checkpoint marker c
  is inserted goes to on_checkpoint(c, state) before any queue holds c (default: kept in
  `snapshots[c]` until take_snapshot). `epochs[w]`: the checkpoint markers worker w has passed (its
  start reports)."""

  def __init__(
    self,
    kv,
    service,
    poll_s: float = 0.05,
    on_checkpoint=None,
    elastic: bool = False,
    now=None,
    lives: int = 1,
    members: dict | None = None,
  ):
    """members (elastic): the membership a resumed run continues from (a checkpoint's snapshot:
    Authority.state)."""
    self.kv, self.service, self.poll_s = kv, service, poll_s
    self.n = service.n
    # A worker's reported steps never exceed the run's (a larger one would end it: wire.report).
    self.max_steps = service.cadence.total_steps if service.cadence else 2**62
    # Elastic membership (runtime/membership.py): who is live, each worker's incarnation, what happened.
    self.elastic, self.now = elastic, now or time.perf_counter
    self.incs = [0] * self.n
    self.lives = lives  # lives per worker (elastic): its process's CPU devices (membership.lives_of)
    self.events = []  # (run time, worker, "leave" | "rejoin" | "refused")
    self.unmade = 0  # dead workers' started steps the run did not make up (membership.leave)
    self.on_join = None  # (w, inc): a new life accepted (the coordinator's watchdog watches it from then)
    if elastic:
      service.view.alive = np.ones(self.n, bool)
    self._quiet = [threading.Event() for _ in range(self.n)]  # a listener's own stop (its worker died)
    if elastic and members:
      self.load_members(members)
    self.on_checkpoint = on_checkpoint or (lambda ident, state: self.snapshots.__setitem__(ident, state))
    self.epochs = [0] * self.n
    self._reported = [0] * self.n  # the newest step whose start report was applied, per worker
    self._read = [0] * self.n  # requests read, per worker
    self.last_ckpt = service.marks["ckpt"]  # the newest checkpoint marker in the global order
    self.posted = [0] * self.n  # entries of each queue written to the store
    self.batches = [0] * self.n  # keys written per queue
    self.inbox = queue.Queue()
    self.snapshots = {}
    self.handled = Durations()  # seconds from taking each request to the end of its round (service time)
    self.rounds = 0
    self.busy_s = 0.0  # seconds the serving thread spent in rounds (its own capacity: requests / busy_s)
    self._seen = {}
    self._stop = threading.Event()
    self._writers = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="ripples-gg-post")
    self._threads = [self._listener(w) for w in range(self.n)]
    if elastic:
      self._threads.append(threading.Thread(target=self._joins, name="ripples-gg-joins", daemon=True))
    self._threads.append(threading.Thread(target=self._serve, name="ripples-gg", daemon=True))
    self.error = None

  def state(self) -> dict:
    """The service's state and, elastic, the membership (who is live, each worker's life, the steps
    not made up, the events so far): what a checkpoint's snapshot holds (authority/<c>.json)."""
    state = self.service.state()
    if self.elastic:
      state["members"] = {
        "alive": self.service.view.alive.tolist(),
        "joining": sorted(int(w) for w in self.service.joining),
        "incs": list(self.incs),  # for the record: a resume starts every life at 0 (load_members)
        "unmade": self.unmade,
        "events": [list(e) for e in self.events],
      }
    return state

  def load_members(self, members: dict) -> None:
    """Continues from a snapshot's membership. A worker live at it but still joining (it saved no
    checkpoint there: its first group had not landed) is out too: the resumed run has no model of it,
    and it rejoins like a dead one (out_at). Lives start again at 0: every process of a resumed run is
    new, on its device 0, in a new coordination service (no connection of an earlier start is cached
    or keyed anywhere: docs/design.md 3.12), so an out worker rejoins as life 1, if its process has a
    second device (the rerun's --max_restarts >= 1), and is refused otherwise."""
    out = out_at(members)
    self.service.view.alive[:] = [w not in out for w in range(self.n)]
    self.unmade = int(members.get("unmade", 0))
    self.events = [tuple(e) for e in members.get("events", [])]
    for w in out:
      self._quiet[w].set()  # nobody requests on its old life's channel

  def _listener(self, w: int) -> threading.Thread:
    return threading.Thread(
      target=self._listen, args=(w, self.incs[w], self._quiet[w]), name=f"ripples-gg-listen-{w}", daemon=True
    )

  def start(self):
    for t in self._threads:
      t.start()
    return self

  def stop(self):
    self._stop.set()
    self._writers.shutdown(wait=False)
    for w, r in enumerate(self._read):  # each worker's last page of requests, read or not
      try:
        self.kv.key_value_delete(f"{membership.request_prefix(w, self.incs[w])}/{r // PAGE}")
      except Exception:  # noqa: BLE001  the service is gone: nothing is left to tidy
        return

  def join(self, timeout_s: float | None = None) -> bool:
    """Waits for the serving thread to end (STOP posted to every queue); False on timeout."""
    self._threads[-1].join(timeout_s)
    return not self._threads[-1].is_alive()

  def _listen(self, w: int, inc: int, quiet: threading.Event) -> None:
    prefix = membership.request_prefix(w, inc)
    stop = Either(self._stop, quiet)
    try:
      for r, value in enumerate(values_in_order(self.kv, prefix, stop, page=True)):
        got = wire.request(f"{prefix}/{r // PAGE}/{r}", value, self.max_steps)
        self._read[w] = r + 1
        if got is not None:  # a malformed request is dropped (one warning); the next one is served
          want, ready_at, step_time, report = got
          self.inbox.put((w, want, ready_at, step_time, time.perf_counter(), report, inc))
        if (r + 1) % PAGE == 0:  # a page read: the store keeps no history
          self.kv.key_value_delete(f"{prefix}/{r // PAGE}")
    except Exception as e:  # noqa: BLE001  a store error (values are decoded above): the watchdog reports it
      logging.warning("authority: worker %d's request listener stopped: %s", w, e)
      return

  # -- elastic membership (runtime/membership.py) -----------------------------------------------------

  def leave(self, w: int, inc: int) -> None:
    """Worker w's incarnation inc is lost (the coordinator's watchdog): applied by the serving thread,
    in order; ignored if w has rejoined since (the silence was its earlier life's)."""
    self.inbox.put(("leave", w, inc))

  def settle(self) -> None:
    """After the serving thread has ended: the membership items it left (a death noticed after the
    run's last round is still recorded; a rejoin then is refused: the run has ended)."""
    while True:
      try:
        item = self.inbox.get_nowait()
      except queue.Empty:
        return
      if isinstance(item[0], str):
        self._member(item)

  def _joins(self) -> None:
    try:
      slots = values_in_order(
        self.kv, f"{PREFIX}/join", self._stop, skip=(membership.JOINS, membership.SLOT_WAIT_S), consume=True
      )
      for slot, value in enumerate(slots):
        if value is None:  # taken and left empty: skipped, the next rejoin still lands
          wire.bad(
            f"{PREFIX}/join/{slot}", "", f"empty {membership.SLOT_WAIT_S:g} s while a later slot is taken"
          )
          continue
        w = wire.worker_id(f"{PREFIX}/join/{slot}", value, self.n)
        if w is not None:  # a malformed slot is skipped (one warning): the next rejoin still lands
          self.inbox.put(("join", w, slot))
    except Exception as e:  # noqa: BLE001  a store error (values are decoded above): the watchdog reports it
      logging.warning("authority: the joins listener stopped: %s", e)
      return

  def _member(self, item) -> None:
    kind, w, arg = item
    if kind == "leave":
      if not self.service.view.alive[w] or arg != self.incs[w]:
        return  # already out (a removed worker seen silent again), or a later life is in
      completed = membership.completed_steps(self.kv, w, self.incs[w])
      self.unmade += membership.leave(self.service, w, self.incs[w], completed)
      self.posted[w] = self.service.appended(w)
      self._quiet[w].set()
      self.kv.key_value_set(membership.removed_key(w), str(self.incs[w]), allow_overwrite=True)
      self.events.append((self.now(), w, "leave"))
      logging.warning("worker %d (incarnation %d) left the run; the others go on", w, self.incs[w])
      return
    svc, alive = self.service, self.service.view.alive
    slot = [arg]
    if alive[w]:  # a restart before its death was noticed (or a stalled one's): it left first
      self._member(("leave", w, self.incs[w]))
    refused = ""
    if svc.stopped:
      refused = "the run has ended"
    elif membership.exhausted(w, self.incs, self.lives):
      refused = membership.refusal(w, self.lives)
    if refused:
      self.events.append((self.now(), w, "refused"))
      membership.answer(self.kv, slot[0], self.incs[w], 0, self.now(), svc.marks, self.incs, 0, refused)
      return
    self.incs[w] += 1
    if self.on_join is not None:
      self.on_join(w, self.incs[w])
    taken = membership.rejoin(svc, w, self.incs[w], self.now())
    self.posted[w], self.batches[w], self._read[w] = taken, 0, 0
    self._reported[w] = 0
    self._quiet[w] = threading.Event()
    self._listener(w).start()
    g0 = svc.gid0 + svc.buffer.count
    membership.answer(self.kv, slot[0], self.incs[w], taken, self.now(), svc.marks, self.incs, g0)
    self.events.append((self.now(), w, "rejoin"))
    logging.warning("worker %d rejoined the run (incarnation %d)", w, self.incs[w])

  def take_snapshot(self, ident: int):
    """The service's state at checkpoint marker `ident` (process 0 saves it); older ones are dropped."""
    for c in [c for c in self.snapshots if c < ident]:
      del self.snapshots[c]
    return self.snapshots.pop(ident, None)

  def _reports(self) -> None:
    for key, value in self.kv.key_value_dir_get(f"{PREFIX}/started/"):
      if self._seen.get(key) == value:
        continue
      self._seen[key] = value
      life, fields = wire.life_key(key, self.n), wire.report(key, value, self.max_steps)
      # An earlier life's process (stopped, then continued) is not this one; a malformed key or value
      # is dropped (one warning).
      if life is not None and fields is not None and life[1] == self.incs[life[0]]:
        self._report(life[0], fields)

  def _report(self, w: int, fields) -> None:
    """A start report (steps, started at, step time, last gid, epoch: wire.report), unless a newer one
    (one that rode on a request) was applied already."""
    steps, started, step_time, last_gid, epoch = fields
    alive = self.service.view.alive
    if steps < self._reported[w] or (alive is not None and not alive[w]):
      return
    self._reported[w] = steps
    self.service.report(w, started, step_time, steps, last_gid)
    self.epochs[w] = epoch

  def _serve(self) -> None:
    try:
      while not self._stop.is_set():
        try:
          batch = [self.inbox.get(timeout=self.poll_s)]
        except queue.Empty:
          batch = []
        while True:  # every request that has arrived is served in this round
          try:
            batch.append(self.inbox.get_nowait())
          except queue.Empty:
            break
        self._round(batch)
        if self.service.stopped and all(p == self.service.appended(w) for w, p in enumerate(self.posted)):
          return
    except Exception as e:  # noqa: BLE001  the service is gone (process 0 exiting): the watchdog tells
      self.error = e
      logging.warning("the Group Generator's authority stopped: %s: %s", type(e).__name__, e)

  def _round(self, batch) -> None:
    t0 = time.perf_counter()
    for item in batch:  # membership first: no group is made with a worker known to be dead
      if isinstance(item[0], str):
        self._member(item)
    alive = self.service.view.alive
    # A request of a dead worker's (or of an incarnation since replaced) is not served.
    batch = [
      i
      for i in batch
      if not isinstance(i[0], str) and (alive is None or (alive[i[0]] and i[-1] == self.incs[i[0]]))
    ]
    self._reports()  # the freshest starts and step times before generating (Smart GG reads them)
    for w, *_, report, _inc in batch:
      if report:
        self._report(w, report)
    for w, want, ready_at, step_time, *_ in batch:
      self.service.request(w, want, ready_at, step_time)
    for kind, ident in self.service.tick():
      if kind == "ckpt":  # saved before _post: a worker can checkpoint at it only once it is posted
        self.on_checkpoint(ident, self.state())
        self.last_ckpt = ident
    self._post()
    done = time.perf_counter()
    self.handled.extend(done - item[4] for item in batch)
    self.rounds += bool(batch)
    self.busy_s += done - t0

  def _post(self) -> None:
    """One batch per queue that grew, written in parallel (the store's client releases the GIL: 8
    writers set ~2.5x the keys per second of one), all done before the round ends, so a queue's
    batches land in order."""
    writes, alive = [], self.service.view.alive
    for w, entries in enumerate(self.service.entries):
      new = entries[self.posted[w] - self.service.base[w] :]
      if new and alive is not None and not alive[w]:  # a dead worker's queue: nobody reads it
        self.posted[w] += len(new)
        continue
      if new:
        prefix = membership.queue_prefix(w, self.incs[w])
        writes.append((paged(prefix, self.batches[w]), "|".join(encode(e) for e in new)))
        self.batches[w] += 1
        self.posted[w] += len(new)
    if len(writes) > 1:
      list(self._writers.map(lambda kv_pair: self.kv.key_value_set(*kv_pair), writes))
    elif writes:
      self.kv.key_value_set(*writes[0])
    self.service.trim(self.posted)


class Feed:
  """A worker's side of the protocol: its queue, prefetched; requests when it is empty."""

  def __init__(
    self,
    kv,
    worker: int,
    now,
    ahead: bool = True,
    lead: bool = False,
    inc: int = 0,
    taken: int = 0,
    n: int = 2**31,
  ):
    self.kv, self.me, self.now, self.ahead, self.lead, self.n = kv, worker, now, ahead, lead, n
    self.reports_at = membership.report_key(worker, inc)
    self.queue, self.requests_at = (
      membership.queue_prefix(worker, inc),
      membership.request_prefix(worker, inc),
    )
    self.local = queue.Queue()
    self.taken = taken  # entries of this worker's queue consumed (a rejoined one's starts where it joined)
    self.requests = 0
    self.asked = None  # (queue index, when sent) of the request in flight
    self.rtts = Durations()  # seconds from a request to its answer's arrival here
    self.blocked = Durations()  # seconds the worker waited for an answer after its step
    self.step_time = 0.0  # its newest reported step time, which each request carries
    self._stop = threading.Event()
    self._reports = queue.Queue()
    self._lock = threading.Lock()  # asked / requests: the worker's thread and the lead timer
    self._timer = None
    threading.Thread(target=self._fetch, name="ripples-feed", daemon=True).start()
    threading.Thread(target=self._send, name="ripples-report", daemon=True).start()

  def _fetch(self) -> None:
    try:
      for j, value in enumerate(values_in_order(self.kv, self.queue, self._stop, page=True)):
        arrived = time.perf_counter()
        # A malformed batch (one warning) is none of the run's: nothing of it is taken.
        entries = wire.entries(f"{self.queue}/{j // PAGE}/{j}", value, self.n) or []
        for entry in entries:
          self.local.put((entry, arrived))
        stop = bool(entries) and entries[-1][0] == STOP
        if stop or (j + 1) % PAGE == 0:  # a page read (or the last)
          self._forget(f"{self.queue}/{j // PAGE}", last=stop)
        if stop:
          return
    except Exception as e:  # noqa: BLE001  raised in the worker's loop, at its next entry
      self.local.put((e, None))

  def _forget(self, page: str, last: bool) -> None:
    try:
      self.kv.key_value_delete(page)
    except Exception:  # noqa: BLE001  after STOP the service may be gone: nothing is left to tidy
      if not last:
        raise

  def _send(self) -> None:
    while True:
      value = self._reports.get()
      if value is None:
        return
      try:
        self.kv.key_value_set(self.reports_at, value, allow_overwrite=True)
      except Exception:  # noqa: BLE001  the service is gone: the watchdog reports it
        return

  def _request(self, ready_at: float, report: str = "") -> None:
    value = f"{self.taken} {ready_at!r} {self.step_time!r}" + (f" {report}" if report else "")
    self.kv.key_value_set(paged(self.requests_at, self.requests), value)
    self.requests += 1
    self.asked = (self.taken, time.perf_counter())

  def report(self, steps: int, started_at: float, step_time: float, last_gid: int, epoch: int = 0) -> None:
    """A step starts: tell the authority (from a thread, overlapped with the step); with request-ahead
    and nothing queued, ask for the entry after this step now. With `lead` (a generator that plans with
    who is ready when, Smart GG), ask instead one round trip before the step is expected to end, so the
    answer arrives as the step does and the plan is made with nearly the state a request at the end
    would see (lead_s: the recent round trips' 90th percentile and a margin; none measured yet: no lead)."""
    self.step_time = float(step_time)
    report = f"{steps} {started_at!r} {step_time!r} {last_gid} {epoch}"
    if self.ahead and self.asked is None and self.local.empty():
      self._request(started_at + step_time, report)  # the report rides on it: one call, not two
      return
    self._reports.put(report)
    if self.lead and (lead := self.lead_s()) and step_time > lead:
      self._timer = threading.Timer(step_time - lead, self._ask_if_empty, (started_at + step_time,))
      self._timer.daemon = True
      self._timer.start()

  def lead_s(self) -> float:
    if len(self.rtts) < 3:
      return 0.0
    return float(np.percentile(self.rtts.recent, 90)) + 0.002

  def _ask_if_empty(self, ready_at: float) -> None:
    with self._lock:
      if self.asked is None and self.local.empty():
        self._request(ready_at)

  def next(self, timeout_s: float) -> tuple:
    """The head entry of this worker's queue; with an empty queue, a request and its answer."""
    if self._timer is not None:  # the step ended before its lead request went: ask now instead
      self._timer.cancel()
      self._timer = None
    try:
      entry, arrived = self.local.get_nowait()
    except queue.Empty:
      t0 = time.perf_counter()
      with self._lock:
        if self.asked is None:
          self._request(self.now())
      entry, arrived = self.local.get(timeout=timeout_s)
      self.blocked.add(time.perf_counter() - t0)
    if isinstance(entry, Exception):
      raise entry
    with self._lock:
      if self.asked is not None and self.asked[0] == self.taken:  # the answer (or what came first)
        self.rtts.add(max(0.0, arrived - self.asked[1]))
        self.asked = None
      self.taken += 1
    return entry

  def close(self) -> None:
    if self._timer is not None:
      self._timer.cancel()
    self._stop.set()
    self._reports.put(None)


class LocalFeed:
  """A fixed schedule's queue (All-Reduce, Static GG): known locally, no authority, no round trip.

  After the worker's step k+1 (k = 0 ..): the markers of point k (k syncs done; eval then ckpt),
  then its group of layout k, or STOP after the last step. Markers: every `eval_every` and
  `checkpoint_every` syncs, numbered from 1, the same points on every worker."""

  def __init__(
    self,
    layouts,
    num_workers: int,
    worker: int,
    num_steps: int,
    eval_every: int,
    checkpoint_every: int,
    resume_point: int = 0,
    average_last: bool = False,
  ):
    """average_last (DiLoCo): the group of every worker after the last step, then STOP (its outer step
    makes the run's model the global one); otherwise STOP follows the last step at once."""
    from ripples_jax.schedule.online import fixed_entry

    self._fixed = lambda k: fixed_entry(layouts, num_workers, worker, k)
    everyone = ((tuple(range(num_workers)),),)
    self._last = (lambda k: fixed_entry(everyone, num_workers, worker, k)) if average_last else None
    self.num_steps, self.every = num_steps, (("eval", eval_every), ("ckpt", checkpoint_every))
    self._gen = self._entries(resume_point)
    self.rtts, self.blocked, self.requests, self.taken = Durations(), Durations(), 0, 0
    self.steps_over = False

  def _entries(self, start: int):
    for k in range(start, self.num_steps):
      if k > start or start == 0:  # a resumed run starts right after its point's markers
        for kind, every in self.every:
          if k and every and k % every == 0:
            yield (MARK, kind, k // every)
      if k < self.num_steps - 1:
        yield self._fixed(k)
        continue
      if self._last is not None:
        self.steps_over = True  # the worker takes this group without a step after it, then STOP
        yield self._last(k)
      yield (STOP,)

  def report(self, *args) -> None:
    pass

  def next(self, timeout_s: float) -> tuple:
    self.taken += 1
    return next(self._gen)

  def close(self) -> None:
    pass


class Durations:
  """Seconds recorded one per request (round trips, waits, service times) in bounded memory, however
  long the run: the count and the sum exact; every value while there are at most EXACT of them (the
  percentiles are then np.percentile's, as from a list), beyond that a histogram of log-spaced bins of
  relative width BIN (the percentiles within BIN of np.percentile's; at most ~2.3e4 bins from 1 us to a
  day). `recent`: the newest RECENT values (Feed.lead_s). The trace's end line holds `as_record()`: the
  list of values while exact (the format before), else {"n", "sum", "bins"}."""

  EXACT, BIN, RECENT = 4096, 1e-3, 20
  _ZERO = -(10**9)  # the bin of values too small to time (<= 1 ns)

  def __init__(self, values=(), bounded: bool = True):
    self.count, self.total, self.cap = 0, 0.0, self.EXACT if bounded else None
    self.values, self.bins = [], None  # bins: {bin index: count} once past the cap
    self.recent = collections.deque(maxlen=self.RECENT)
    self.extend(values)

  def __len__(self) -> int:
    return self.count

  def add(self, seconds: float) -> None:
    x = float(seconds)
    self.count, self.total = self.count + 1, self.total + x
    self.recent.append(x)
    if self.bins is not None:
      self._bin(x, 1)
      return
    self.values.append(x)
    if self.cap is not None and len(self.values) > self.cap:
      self.bins, values, self.values = {}, self.values, []
      for v in values:
        self._bin(v, 1)

  def extend(self, values) -> None:
    for x in values:
      self.add(x)

  def _bin(self, x: float, k: int) -> None:
    b = self._ZERO if x <= 1e-9 else math.floor(math.log(x) / math.log1p(self.BIN))
    self.bins[b] = self.bins.get(b, 0) + k

  def _at(self, b: int) -> float:
    return 0.0 if b == self._ZERO else (1 + self.BIN) ** (b + 0.5)  # the bin's geometric middle

  def percentile(self, q: float) -> float:
    if self.bins is None:
      return float(np.percentile(self.values, q))
    keys = sorted(self.bins)
    ends = np.cumsum([self.bins[b] for b in keys])  # the rank after each bin's last value
    rank = lambda i: self._at(keys[int(np.searchsorted(ends, i, side="right"))])  # noqa: E731
    pos = q / 100 * (self.count - 1)  # np.percentile's linear interpolation between two ranks
    lo, hi = rank(math.floor(pos)), rank(math.ceil(pos))
    return float(lo + (pos - math.floor(pos)) * (hi - lo))

  def as_record(self):
    if self.bins is None:
      return list(self.values)
    return {"n": self.count, "sum": self.total, "bins": {str(b): c for b, c in self.bins.items()}}

  @classmethod
  def merged(cls, records) -> "Durations":
    """One Durations of several end lines' records (lists or as_record dicts, None: none): exact when
    every one is (the values joined, uncapped: the summary's figures are the lists' own)."""
    out = cls(bounded=False)
    for record in records:
      if isinstance(record, dict):
        out._take_bins(record)
      else:
        out.extend(record or ())
    return out

  def _take_bins(self, record: dict) -> None:
    if self.bins is None:
      self.bins, values = {}, self.values
      self.values = []
      for v in values:
        self._bin(v, 1)
    for b, c in record["bins"].items():
      self.bins[int(b)] = self.bins.get(int(b), 0) + c
    self.count, self.total = self.count + record["n"], self.total + record["sum"]


def percentiles(seconds) -> dict:
  """Median and p99 in milliseconds (None when empty) of a list of seconds or a Durations."""
  d = seconds if isinstance(seconds, Durations) else Durations(seconds, bounded=False)
  if not len(d):
    return {"median_ms": None, "p99_ms": None, "count": 0}
  if d.bins is None:  # every value kept: the figures as from the list
    a = np.asarray(d.values) * 1e3
    return {"median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "count": int(len(a))}
  return {"median_ms": d.percentile(50) * 1e3, "p99_ms": d.percentile(99) * 1e3, "count": len(d)}
