"""The runtime's worker loop runs one queue entry per local step: a group that is queued while the
worker computes waits for the next step; a loop that drained its queue back to back would run many
groups per step and skew every generator's statistics (docs/design.md 3.9, fidelity gap (a))."""

import types

import jax.numpy as jnp

from ripples_jax.runtime import process as process_lib
from ripples_jax.runtime import worker as worker_lib
from ripples_jax.schedule.online import GROUP, MARK, NONE, STOP


class Queue:
  """A queue that already holds everything (a worker whose peers ran ahead)."""

  def __init__(self, entries):
    self.entries, self.taken = list(entries), 0

  def next(self, timeout_s):
    self.taken += 1
    return self.entries.pop(0)


def run(entries, resumed: bool, monkeypatch):
  events = []
  monkeypatch.setattr(worker_lib, "run_step", lambda w, loop, *a: events.append("step"))
  monkeypatch.setattr(worker_lib, "mark", lambda w, loop, log, t, entry, wd: events.append(entry[1]))
  averager = types.SimpleNamespace(average=lambda members, flat: events.append(members) or flat)
  rt = types.SimpleNamespace(fail_worker=-1, fail_step=0, stall_timeout=1.0)
  worker = types.SimpleNamespace(rt=rt, me=0, averager=averager, now=lambda: 0.0, outer_step=None)
  loop = process_lib.Loop({"flat": jnp.zeros(2)}, resumed_at=0 if resumed else None)
  trace = types.SimpleNamespace(add=lambda **kw: None)
  worker_lib.run_loop(worker, loop, None, Queue(entries), trace, {"steps": 0, "events": 0}, "")
  return events, loop


def test_one_entry_per_local_step_however_many_are_queued(monkeypatch):
  g = [(GROUP, i, (0, 1 + i % 2)) for i in range(3)]
  entries = [g[0], g[1], (MARK, "eval", 1), g[2], (NONE,), (STOP,)]
  events, loop = run(entries, resumed=False, monkeypatch=monkeypatch)
  # eval 0 first; then step, entry, step, entry, ...; a marker does not count as the step's entry.
  assert events == ["eval", "step", (0, 1), "step", (0, 2), "step", "eval", (0, 1), "step", "step"]
  assert loop.syncs == 4 and loop.last_gid == 2
  resumed, _ = run([g[0], g[1], (STOP,)], resumed=True, monkeypatch=monkeypatch)
  assert resumed == [(0, 1), "step", (0, 2), "step"]  # a resumed worker takes its entry first


def test_resumed_workers_share_one_clock():
  """Each worker saved its marker at its own run time (here 10.0 .. 10.3 s); after the start barrier
  every worker's clock reads the latest of them, so Smart GG and the moving straggler compare equal
  clocks. A fresh run starts every clock at 0."""
  import threading
  import time

  from tests.fakes import FakeKV

  for saved, expect in (([10.0, 10.1, 10.3], 10.3), ([0.0, 0.0, 0.0], 0.0)):
    kv, starts = FakeKV(processes=3), {}
    epoch = 4 if expect else 0

    def worker(w, saved=saved, kv=kv, epoch=epoch, starts=starts):
      time.sleep(0.05 * w)  # they reach the barrier at different moments
      starts[w] = process_lib.start_clock(kv, w, 3, epoch, saved[w], 5000)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(10)
    now = time.perf_counter()
    clocks = [now - starts[w] for w in range(3)]
    assert max(clocks) - min(clocks) < 0.02, clocks  # one clock, up to the barrier's release
    assert abs(min(clocks) - expect) < 0.5, (clocks, expect)
