"""executor=async, process 0: the coordinator. It computes no gradient and holds no checkpoint; it hosts the
coordination service (jax.distributed's, as process 0 always does), the Group Generator's authority
(dynamic generators) or the parameter server (ps_sync, ps_async: runtime/ps.py, the one algorithm
family whose process 0 holds a model), and owns the run's records (config.json, metrics.jsonl,
summary.json, the Gantt; RunLog's lead). No training process is special: worker w is process w + 1
(coord.worker_process).

  start-up  the run's folder and lock -> the workers' agreed resume point (worker 0 publishes it:
            distributed.resume.publish_point) -> the records cut back to it -> the authority's state
            at that marker -> the start barrier (one clock: worker.start_clock)
  run       the authority serves; a watchdog watches every worker's heartbeat (a lost or stalled
            worker ends the run, and the coordinator exits after its peers: its service going first
            would abort their clients before they can say why)
  end       every worker done -> the authority's final state -> the end barrier -> evaluation of the
            marker snapshots and summary.json (runtime/summary.py)

authority/<c>.json  the authority's state when checkpoint marker c entered the global order. It is
  written (atomically, fsynced) before any queue holds c, so every worker checkpoint at c has one; it
  is removed once every worker has passed marker c + checkpoint_keep, after which no worker holds
  checkpoint c (each keeps its newest checkpoint_keep), so the folder stays bounded.
"""

import json
import math
import os
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.flatten_util import ravel_pytree

from ripples_jax import algorithms, workload
from ripples_jax.algorithms import make_group_generator
from ripples_jax.distributed import coord, host, kvstore
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.errors import ConfigError
from ripples_jax.models import init_model
from ripples_jax.runlog import RunLog, make_workdir, storage
from ripples_jax.runtime import authority as authority_lib
from ripples_jax.runtime import membership, ps
from ripples_jax.runtime import summary as summary_lib
from ripples_jax.runtime.process import start_clock
from ripples_jax.schedule.online import Cadence, Service


def save_snapshot(workdir: str, ident, state: dict) -> None:
  """authority/<ident>.json, whole or not at all (storage.durable_write: a temporary file fsynced,
  renamed, the folder fsynced; none left behind by a failed write)."""
  path = authority_lib.snapshot_file(workdir, ident)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  storage.durable_write(path, lambda f: json.dump(state, f), "w")


def load_snapshot(workdir: str, ident: int) -> dict:
  path = authority_lib.snapshot_file(workdir, ident)
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"{path}: the Group Generator's state at checkpoint marker {ident}, which the workers resume "
      "from, is missing; nothing was deleted; move ckpt/ aside to start afresh, or use another --workdir"
    )
  with open(path) as f:
    return json.load(f)


def trim_snapshots(workdir: str, epochs, keep: int) -> None:
  """Removes the snapshots no worker can resume from: below min(epochs) - keep (none: nothing)."""
  if not len(epochs):
    return
  oldest = min(epochs) - keep
  folder = os.path.join(workdir, "authority")
  for name in os.listdir(folder) if os.path.isdir(folder) else []:
    stem = name.split(".", 1)[0]
    if stem.isdigit() and int(stem) < oldest:
      os.remove(os.path.join(folder, name))


def make_authority(config, kv, workdir: str, state: dict | None, estimate: float, now=None):
  """The Group Generator service, from the resumed state, with its snapshots written to files (`now`:
  the run's clock, for membership events)."""
  c, n, keep = config, config.num_workers, config.runtime.checkpoint_keep
  cadence = Cadence(c.num_steps * n, c.eval_every * n, c.runtime.checkpoint_every * n)
  service = Service(n, make_group_generator(c, np.random.default_rng([4, c.seed])), cadence, estimate)
  if state is not None:
    service.load(state)
  authority = None

  def on_checkpoint(ident, snapshot):
    save_snapshot(workdir, ident, snapshot)
    # The live workers' markers only: a worker dead for good passes none, and a resume goes on
    # without it (authority.out_at), so its old markers need no snapshot (the folder stays bounded).
    alive = authority.service.view.alive
    trim_snapshots(workdir, [e for w, e in enumerate(authority.epochs) if alive is None or alive[w]], keep)

  lives = membership.lives_of(jax.devices(), n)  # elastic: one CPU device per life of a worker
  members = (state or {}).get("members")
  authority = authority_lib.Authority(
    kv,
    service,
    on_checkpoint=on_checkpoint,
    elastic=bool(c.runtime.elastic),
    now=now,
    lives=lives,
    members=members,
  )
  return authority


def check_timeout_fits(rt, slowest_s: float) -> None:
  """config.py's check of the collective timeout against the slowest step, on the measured warm-up
  steps (the slow workers' slowdown in them): an elastic run whose live pairs would time out waiting
  for a slow partner's step ends here, before any exchange, with one line (ConfigError: exit 2)."""
  if rt.get("elastic") is True and not host.collective_timeout_s(rt) > 2 * slowest_s:
    raise ConfigError(
      f"config.runtime.heartbeat_timeout: {rt.heartbeat_timeout:g} is not allowed: seconds > {slowest_s:g} "
      "with runtime.elastic: its collective timeout (2 x it) must exceed twice the slowest worker's "
      f"measured warm-up step ({slowest_s:.3g} s), or a live worker's partner times out waiting for it"
    )


def resume_records(log: RunLog, point: dict | None) -> int:
  """The records at the workers' resume point (fresh: an earlier run's set aside); its marker."""
  if point is None:
    log.start_fresh()
    return 0
  log.resume_records(point["meta"])
  logging.info("coordinator: the workers resume at checkpoint marker %d", point["mark"])
  return int(point["mark"])


GROWTH_EVERY_S = 5.0  # growth.jsonl's cadence


def growth_sample(kv, t: float) -> dict:
  """What must stay flat over a long run (benchmarks/bench_growth.py): the store's key count under
  the run's prefix, this process's resident memory and open file descriptors."""
  with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  return {
    "t": round(t, 3),
    # Every key, the counters' too (they carry no MAC): the store's own listing, not the run's view.
    "keys": len(getattr(kv, "raw", kv).key_value_dir_get(f"{coord.PREFIX}/")),
    "rss_mb": round(rss / 2**20, 2),
    "fds": len(os.listdir("/proc/self/fd")),
  }


def follow(
  log: RunLog, watchdog, authority, num_steps: int, stop: threading.Event, kv=None, workdir=""
) -> None:
  """The progress line until `stop`: the run's steps (every worker's, over the workers); with kv, a
  growth_sample in workdir/growth.jsonl every GROWTH_EVERY_S (Linux: /proc)."""
  n = watchdog.n
  t0, last = time.monotonic(), -math.inf
  while not stop.wait(0.5):
    if authority is not None:
      done = int(authority.service.steps.sum()) // n
    else:
      done = sum(watchdog.steps.values()) // n
    log.progress(min(done, num_steps))
    if kv is not None and os.path.exists("/proc/self/statm") and time.monotonic() - last >= GROWTH_EVERY_S:
      last = time.monotonic()
      try:
        sample = {**growth_sample(kv, last - t0), "step": min(done, num_steps)}
      except Exception as e:  # noqa: BLE001 - telemetry: a store error is the watchdog's to report
        logging.warning("coordinator: growth sample skipped (%s)", e)
        continue
      with open(os.path.join(workdir, "growth.jsonl"), "a") as f:
        f.write(json.dumps(sample) + "\n")


def await_workers(watchdog, authority, workdir: str, timeout_s: float) -> None:
  """Until every worker's heartbeat says done (it saved its final state). With an authority, its
  final state is saved first, as authority/<final marker>.json (the workers' final checkpoint).
  However long the run, it is waited for (the watchdog ends a run that is lost or stalls); only
  once the run has ended (STOP posted, or a first worker done) must the rest finish in timeout_s."""
  if authority is not None:
    while not authority.join(1.0):
      if authority.error is not None:
        raise RuntimeError(f"the Group Generator's authority stopped: {authority.error}")
    save_snapshot(workdir, authority.last_ckpt + 1, authority.state())
  deadline = time.monotonic() + timeout_s if authority is not None else None
  gone = getattr(watchdog, "gone", set())  # elastic: the dead are not waited for
  # ... unless every worker is gone and none finished: that run has not ended (a restart may rejoin;
  # the watchdog ends it after stall_timeout), and a summary now would call it complete.
  everyone_gone = lambda: len(gone) == len(watchdog.done) and not any(watchdog.done.values())
  while everyone_gone() or not all(d or w in gone for w, d in watchdog.done.items()):
    if deadline is None and any(watchdog.done.values()):
      deadline = time.monotonic() + timeout_s
    if deadline is not None and time.monotonic() > deadline:
      raise TimeoutError(f"the workers did not finish within {timeout_s:.0f} s of the run's end")
    time.sleep(0.1)


def record_start(workdir: str, run_time: float) -> None:
  """clock.jsonl: one line per start of the run (fresh, or each resume): the wall-clock time (unix
  seconds) at which the run's clock read `run` seconds. A resumed run's clock continues from its
  marker's saved time, so the time lost to a failure (the work redone, the restart) is in no trace:
  the wall time of a trace event at run time t is wall + (t - run) of the start it belongs to."""
  with open(os.path.join(workdir, "clock.jsonl"), "a") as f:
    f.write(json.dumps({"wall": time.time(), "run": run_time}) + "\n")


def await_end(config, kv, watchdog, authority, server, workdir: str) -> None:
  """The run's end: the server's last pull, every worker done or gone, the authority settled, then the
  end barrier (elastic: the ENDED key instead)."""
  rt = config.runtime
  if server is not None:  # the server ends with the run's last pull (ps_async: every worker's DONE)
    while not server.join(1.0):
      pass
    if server.error is not None:
      raise RuntimeError(f"the parameter server stopped: {server.error}")
  await_workers(watchdog, authority, workdir, 10 * rt.stall_timeout)
  if authority is not None:
    authority.settle()
  if rt.elastic:  # every worker done or gone: a barrier's fixed membership would wait for the dead
    kv.key_value_set(membership.ENDED, "1")
  else:
    kv.wait_at_barrier(f"{coord.PREFIX}/end", int(10 * rt.stall_timeout * 1000))


def run(config, workdir: str) -> dict:
  """The coordinator of an executor=async run; returns the run's summary."""
  rt, n = config.runtime, config.num_workers
  sigterm = coord.SigtermStop(name=coord.COORDINATOR).install()
  s = workload.build(config)
  workdir = make_workdir(workdir, config)
  kvstore.RETRY_WINDOW_S = host.collective_timeout_s(
    config.runtime
  )  # store calls ride out 2 x heartbeat_timeout
  kv = coord.client()
  params, model_state = init_model(s.model, jax.random.key(config.seed), s.data["x_train"][:1])
  _, unravel = ravel_pytree({"params": params, "model_state": model_state})
  timeout_ms = int(rt.stall_timeout * 1000)
  server = None
  if algorithms.get(config.algorithm).server:  # this process is the server: it meets each worker first
    server = ps.Server(config, s, kv, workdir, params, model_state)
    logging.info("coordinator: the parameter server connected to %d workers in %.2f s", n, server.connect())
  with RunLog(workdir, config, config.num_steps, is_lead=True, checkpoint_every=0) as log:
    epoch = resume_records(log, resume_lib.await_point(kv, rt.stall_timeout * 4))
    dynamic = algorithms.get(config.algorithm).dynamic
    state = load_snapshot(workdir, epoch) if dynamic and epoch else None
    clock = {"t0": time.perf_counter()}
    authority = None
    if dynamic:  # its first plan: the workers' median warm-up step (each worker's own arrives with it)
      steps_s = coord.fetch_estimates(kv, coord.WARMUP, n, rt.stall_timeout * 4)
      check_timeout_fits(rt, max(steps_s))
      estimate = float(np.median(steps_s))
      authority = make_authority(
        config, kv, workdir, state, estimate, lambda: time.perf_counter() - clock["t0"]
      )
    roster = None
    if rt.elastic and not dynamic:  # AD-PSGD: membership without an authority (membership.Roster)
      now = lambda: time.perf_counter() - clock["t0"]  # noqa: E731
      lives = membership.lives_of(jax.devices(), n)  # one CPU device per life of a worker
      roster = membership.Roster(kv, n, config.num_steps * n, now, lives).start()
    watchdog = coord.Watchdog(
      kv,
      None,
      n,
      lambda: (0, 0, False),
      rt.heartbeat_s,
      rt.heartbeat_timeout,
      rt.stall_timeout,
      hosts_service=True,
      on_lost=(authority or roster).leave if rt.elastic else None,  # elastic: the run goes on without it
      lives=membership.lives_of(jax.devices(), n) if rt.elastic else None,
    )
    if rt.elastic:  # a new life is watched from its acceptance, before its first beat
      (authority or roster).on_join = watchdog.watch_life
      if authority is not None:  # resumed: the workers out at the marker are gone until they rejoin
        watchdog.resume_members(authority_lib.out_at((state or {}).get("members")))
    sigterm.watchdog = watchdog
    clock["t0"] = start_clock(kv, None, n, epoch, 0.0, timeout_ms)
    record_start(workdir, time.perf_counter() - clock["t0"])
    if rt.elastic:  # a worker process started from now on is a restart: it rejoins (membership.py)
      kv.key_value_set(membership.RUNNING, "1", allow_overwrite=True)
    if authority is not None:
      authority.start()
    if server is not None:
      server.start(clock["t0"])
    watchdog.start()
    stop = threading.Event()
    threading.Thread(
      target=follow, args=(log, watchdog, authority, config.num_steps, stop, kv, workdir), daemon=True
    ).start()
    try:
      await_end(config, kv, watchdog, authority, server, workdir)
    except Exception:
      watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)  # a lost worker is named first
      raise
    finally:
      stop.set()
      if authority is not None:
        authority.stop()
      if roster is not None:
        roster.stop()
    watchdog.stop()
    return summary_lib.summarize(config, workdir, s, unravel, log, authority, roster)
