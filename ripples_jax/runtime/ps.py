"""Parameter servers in the asynchronous runtime (ps_sync, ps_async; docs/design.md 3.4).

The server is the coordinator, process 0, worker id n in the exchanges. PS has no Group Generator, so
the coordinator's process is otherwise idle; the run keeps the n + 1 processes of every other
algorithm's run (the simulator's PS is n workers and one server slot too), and the server's final
model is the run's model, which the coordinator evaluates anyway. On GPU it shares worker 0's device.

  ps_sync   every worker takes its local step with its own optimizer, pushes its model to the server
            and pulls the mean: the server takes the n pushes in worker order, sums them left to
            right and divides by n (PairAverager's mean, bit for bit), and sends the mean to each
            worker in the same order. These are the simulator's ps_sync numerics, All-Reduce's (the
            mean of the models after every step; with plain SGD the mean gradient's step).
  ps_async  each worker computes a gradient on the model it pulled last, pushes it and pulls the
            server's model with that gradient applied; the server serves one request at a time in
            arrival order, each gradient applied by its own optimizer (workload.build: lr / n, as the
            simulator's server), so no update is lost and none is averaged away.
Transport: the engine's collectives, one pair program per worker and server (PairAverager's
all_gather over the pair's devices). A push and a pull are one exchange each; an all_gather moves a
buffer both ways, and the direction not needed (the server's model on a push, the worker's buffer on
a pull) is unread, so the bytes on the wire are those of the push and the pull.

Invariants: a worker has one request outstanding and the server serves whole requests (push, apply,
pull) one at a time, so the server's model is a sequence of versions, one per gradient, in the order
of server.jsonl's "apply" events (ps_async); ps_sync's rounds are the run's steps in order. Records:
the workers' traces (steps, and each push-pull as a group with the server, "m": [w, n]); the server's
in server.jsonl (its evaluation marks, applies and end), its snapshots eval<k>-<n>.npy, final-<n>.npy.
Not elastic (its records' no_elastic, ripples_jax/algorithms.py) and no mid-run checkpoints: the final
state only, as AD-PSGD.
"""

import os
import queue
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from ripples_jax import workload
from ripples_jax.distributed import coord, wire
from ripples_jax.distributed import resume as resume_lib
from ripples_jax.distributed.arrays import LOCAL
from ripples_jax.distributed.kvstore import values_in_order
from ripples_jax.distributed.markers import fail_now
from ripples_jax.runlog import RunLog
from ripples_jax.runlog.storage import save_array
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.preduce import PairAverager
from ripples_jax.runtime.process import (
  Loop,
  Worker,
  end_of_run,
  end_step,
  fails_here,
  make_step_fns,
  open_worker,
  result,
  snapshot_path,
  start_clock,
  watch,
  watched,
)
from ripples_jax.timeline.ps_async import Staleness

PUSH, DONE = "push", "done"
SERVER_TRACE = "server.jsonl"


def channel(worker: int) -> str:
  """Worker `worker`'s requests to the server: <channel>/0, /1, ... (ps_async)."""
  return f"{coord.PREFIX}/ps/{worker}"


def devices_with_server(n: int) -> dict:
  """Every worker's devices and the server's (id n: the coordinator's, process 0)."""
  return {w: [d for d in jax.devices() if d.process_index == coord.worker_process(w)] for w in range(n)} | {
    n: [d for d in jax.devices() if d.process_index == 0]
  }


class Link:
  """One side's exchanges with the other side of each (worker, server) pair: exchange(w, x) sends x,
  returns w's buffer (the server), or exchange(None, x) the server's (a worker)."""

  def __init__(self, n: int, me: int):
    devices = devices_with_server(n)
    self.n, self.me = n, me
    self.pairs = PairAverager(Mesh(np.array(devices[me]), (LOCAL,)), devices, me)

  def exchange(self, other, flat_D):
    other = self.n if other is None else other
    pieces = [s.data[None] for s in flat_D.addressable_shards]
    return self.pairs._exchange(tuple(sorted((self.me, other))), (0, 0), 0, pieces, flat_D.shape[0])

  def connect(self, flat_D) -> float:
    """Each pair's first run (compile and connection), before the run: the server meets the workers
    in id order, each worker meets the server once; returns the seconds it took."""
    t0 = time.perf_counter()
    for other in range(self.n) if self.me == self.n else [None]:
      self.exchange(other, flat_D).block_until_ready()
    self.pairs.ahead_s += time.perf_counter() - t0
    return time.perf_counter() - t0


# The worker side.


def run(config, workdir: str) -> dict:
  """A worker process of ps_sync / ps_async: its steps, each followed by a push and a pull."""
  rt, n = config.runtime, config.num_workers
  sigterm, workdir, kv, worker = open_worker(config, workdir)
  me = worker.me
  worker.warm_up()
  link = Link(n, me)
  link.connect(worker.fresh()["flat"])
  ravel = jax.jit(lambda grads, ms: ravel_pytree({"params": grads, "model_state": ms})[0])
  ravel(*worker.grad_fn(worker.fresh()["flat"], *worker.batch(0))[:2]).block_until_ready()  # compiled now
  with worker.run_log(workdir) as log:
    resume_lib.restore_common(log, kv, me, n, None, rt.stall_timeout, resumable=False, what="worker")
    if me == 0:
      resume_lib.publish_point(kv, log, None)  # the coordinator's: a fresh start
    loop = Loop(worker.fresh())
    trace = trace_lib.TraceWriter(workdir, me)
    progress, watchdog = watch(kv, me, n, rt, sigterm)
    worker.t_start = start_clock(kv, me, n, 0, 0.0, int(rt.stall_timeout * 1000))
    watchdog.start()
    with watched(watchdog, trace, rt):
      sync = config.algorithm == "ps_sync"
      while loop.steps_done < config.num_steps:
        if fails_here(worker, loop, "step"):
          fail_now(log, None, loop.steps_done, me)
        (sync_step if sync else async_step)(worker, loop, log, trace, link, kv, ravel)
        progress["steps"] = progress["events"] = loop.steps_done
        trace.flush()
      if not sync:
        kv.key_value_set(f"{channel(me)}/{loop.steps_done}", DONE)
      end_of_run(worker, loop, log, kv, trace, progress, workdir)
    watchdog.stop()
    return result(worker, loop, log, workdir)


def _compute(worker: Worker, loop: Loop):
  """The step's gradient on the worker's model, padded: (grads, model_state, loss, (t0, t_compute))."""
  x, y = worker.batch(loop.steps_done)
  t0 = time.perf_counter()
  grads, ms, loss = worker.grad_fn(loop.state["flat"], x, y)
  loss = float(loss)  # blocks: the gradient is ready
  tc = time.perf_counter()
  worker.pad(t0, tc, loop.steps_done)
  return grads, ms, loss, (t0, tc)


def sync_step(worker: Worker, loop: Loop, log: RunLog, trace, link: Link, kv, ravel) -> None:
  """ps_sync: the local step (this worker's optimizer), then push the model and pull the mean. The
  group id is the step's, the same on every worker: a worker's wait for the slowest is its wait."""
  s = loop.steps_done
  grads, ms, loss, (t0, tc) = _compute(worker, loop)
  loop.state["flat"], loop.state["opt_state"] = worker.apply_fn(
    loop.state["flat"], loop.state["opt_state"], grads, ms
  )
  loop.state["flat"].block_until_ready()
  end_step(worker, loop, log, trace, 0, (t0, tc, time.perf_counter()), loss)
  ta = worker.now()
  link.exchange(None, loop.state["flat"])  # push
  loop.state["flat"] = link.exchange(None, loop.state["flat"])  # pull: the mean
  loop.state["flat"].block_until_ready()
  trace.add(k="group", c=0, g=f"ps{s}", m=[worker.me, link.n], t0=ta, t1=worker.now())


def async_step(worker: Worker, loop: Loop, log: RunLog, trace, link: Link, kv, ravel) -> None:
  """ps_async: the gradient on the model pulled last; post the request, push the gradient (with the
  model state the step computed: BatchNorm-like statistics), pull the server's model after it."""
  s, me = loop.steps_done, worker.me
  grads, ms, loss, (t0, tc) = _compute(worker, loop)
  g_D = ravel(grads, ms)
  end_step(worker, loop, log, trace, 0, (t0, tc, time.perf_counter()), loss)
  ta = worker.now()
  kv.key_value_set(f"{channel(me)}/{s}", PUSH)
  link.exchange(None, g_D)  # push: the server applies it
  loop.state["flat"] = link.exchange(None, g_D)  # pull: its model with this gradient applied
  loop.state["flat"].block_until_ready()
  trace.add(k="group", c=0, g=f"ps/{me}/{s}", m=[me, link.n], t0=ta, t1=worker.now())


# The server side: a thread of the coordinator.


class Server:
  """The parameter server (the coordinator's thread): its model, optimizer state and records.
  serve() runs the run's rounds (ps_sync) or requests (ps_async) to the end; `error` holds what
  stopped it early (the coordinator raises it after the watchdog's verdict)."""

  def __init__(self, config, s: workload.Setup, kv, workdir: str, params, model_state):
    """params, model_state: the run's initial model (the coordinator's init_model)."""
    self.config, self.kv, self.workdir, self.n = config, kv, workdir, config.num_workers
    self.link = Link(self.n, self.n)
    flat0, unravel = ravel_pytree({"params": params, "model_state": model_state})
    self.unravel = jax.jit(unravel)
    _, self.apply_fn, rep, _ = make_step_fns(s.model, s.optimizer, unravel, self.link.pairs.local_mesh)
    self.flat = jax.device_put(np.asarray(flat0), rep)
    self.opt_state = jax.device_put(jax.device_get(s.optimizer.init(params)), rep)
    self.mean = self.link.pairs._mean(self.n)
    # ps.staleness=divide: each gradient times 1 / its staleness before the optimizer (the simulator's
    # engine._scaled, the same float32 product); the versions count every apply and each worker's pull.
    self.divide = config.algorithm == "ps_async" and workload.ps_staleness(config) == "divide"
    self.scale = jax.jit(lambda g, c: jax.tree.map(lambda a: a * c.astype(a.dtype), g))
    self.versions = Staleness()
    self.t0 = None  # perf_counter at the run's clock 0 (start_clock)
    self.applied = 0  # worker steps the server's model holds
    self.evals = 0
    self.error = None
    self.trace = None  # opened by start(): a run refused at start-up leaves an earlier one's records
    self.thread = None

  def connect(self) -> float:
    """The pairs' first runs, and the server's programs compiled on copies (no request pays them)."""
    seconds = self.link.connect(self.flat)
    copy = lambda tree: jax.tree.map(jax.numpy.array, tree)  # noqa: E731  (apply donates its inputs)
    self.mean(*[self.flat] * self.n).block_until_ready()
    g = self.unravel(self.flat)
    if self.divide:
      jax.block_until_ready(self.scale(g["params"], np.float32(1)))
    self.apply_fn(copy(self.flat), copy(self.opt_state), g["params"], g["model_state"])[0].block_until_ready()
    return seconds

  def now(self) -> float:
    return time.perf_counter() - self.t0

  def start(self, t0: float) -> "Server":
    self.t0 = t0
    self.trace = trace_lib.TraceWriter(self.workdir, self.n, path=os.path.join(self.workdir, SERVER_TRACE))
    os.makedirs(os.path.join(self.workdir, "snapshots"), exist_ok=True)
    self._snapshot("eval0")
    self.trace.add(k="mark", kind="eval", id=0, t=0.0, s=0)
    self.thread = threading.Thread(target=self._serve, name="ripples-ps-server", daemon=True)
    self.thread.start()
    return self

  def join(self, timeout_s: float) -> bool:
    self.thread.join(timeout_s)
    return not self.thread.is_alive()

  def _serve(self) -> None:
    try:
      self.serve_sync() if self.config.algorithm == "ps_sync" else self.serve_async()
      self._snapshot("final")
      self.trace.add(k="end", t=self.now(), s=self.applied, setup_s=self.link.pairs.setup_s)
    except Exception as e:  # noqa: BLE001  a lost worker: the watchdog names it; the coordinator raises
      self.error = e
      logging.warning("the parameter server stopped: %s", e)
    finally:
      self.trace.flush()

  def _snapshot(self, name: str) -> None:
    save_array(snapshot_path(self.workdir, name, self.n), np.asarray(self.flat))

  def _eval_due(self) -> None:
    """Evaluation k after k x eval_every x n worker steps (the simulator's step k: n worker-steps)."""
    every = self.config.eval_every * self.n
    if every and self.applied // every > self.evals and self.applied < self.config.num_steps * self.n:
      self.evals = self.applied // every
      self._snapshot(f"eval{self.evals}")
      self.trace.add(k="mark", kind="eval", id=self.evals, t=self.now(), s=self.applied)
      self.trace.flush()

  def serve_sync(self) -> None:
    """Every step: the n pushes in worker order, their mean, the n pulls in the same order."""
    for step in range(self.config.num_steps):
      t0 = self.now()
      models = [self.link.exchange(w, self.flat) for w in range(self.n)]  # each waits for its worker
      self.flat = self.mean(*models)
      t_pull = self.now()
      for w in range(self.n):
        self.link.exchange(w, self.flat).block_until_ready()
      self.applied += self.n
      # pull_s: one pull's seconds (no worker is late for it: each waits in it), the link's time
      # per transfer that the simulator's clock is fed (benchmarks/bench_scale.py).
      self.trace.add(k="round", s=step, t0=t0, t1=self.now(), pull_s=(self.now() - t_pull) / self.n)
      self._eval_due()

  def serve_async(self) -> None:
    """Requests in arrival order (one listener thread per worker feeds one queue), until every
    worker's DONE: push (its gradient), apply, pull (the model after it)."""
    inbox, stop = queue.Queue(), threading.Event()

    def listen(w):
      try:
        for r, value in enumerate(values_in_order(self.kv, channel(w), stop, consume=True)):
          if wire.token(f"{channel(w)}/{r}", value, (PUSH, DONE)) is None:
            continue  # not the worker's (one warning): no exchange is entered for it
          inbox.put((w, r, value, self.now()))
          if value == DONE:
            return
      except Exception as e:  # noqa: BLE001  the service is gone: the server stops with it
        inbox.put(e)

    for w in range(self.n):
      threading.Thread(target=listen, args=(w,), name=f"ripples-ps-listen-{w}", daemon=True).start()
    done = set()
    try:
      while len(done) < self.n:
        item = inbox.get()
        if isinstance(item, Exception):
          raise item
        w, r, value, got = item
        if value == DONE:
          done.add(w)
          continue
        t0 = self.now()
        g = self.unravel(self.link.exchange(w, self.flat))  # push
        tau = self.versions.apply(w)  # computed on the version w pulled last (the initial model: 0)
        grads = self.scale(g["params"], np.float32(1.0 / tau)) if self.divide else g["params"]
        self.flat, self.opt_state = self.apply_fn(self.flat, self.opt_state, grads, g["model_state"])
        t_pull = self.now()
        self.link.exchange(w, self.flat).block_until_ready()  # pull
        self.versions.pull(w)
        self.applied += 1
        # got: when the request reached the server (its delivery; t0 - got: its wait in the queue);
        # tau: the gradient's staleness, the server's updates from w's pull to this one (>= 1).
        self.trace.add(
          k="apply", w=w, s=r, got=got, t0=t0, t1=self.now(), pull_s=self.now() - t_pull, tau=tau
        )
        self._eval_due()
    finally:
      stop.set()


def server_records(workdir: str) -> list:
  """server.jsonl's events (a PS run's server)."""
  return trace_lib.read_trace(os.path.join(workdir, SERVER_TRACE))
