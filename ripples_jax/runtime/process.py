"""The life of an asynchronous worker process (executor=async), shared by the Ripples worker loop
(runtime/worker.py) and AD-PSGD (runtime/adpsgd.py): the worker's devices, jitted step halves and
checkpoint layout (Worker, Loop), the start barrier and the run's clock (start_clock, which the
coordinator takes too), the heartbeats and their watchdog (watch, watched), a restarted process's
request to be taken back (ask_back), the end of the run (end_of_run) and what a worker returns
(result). No executor's loop lives here, so the executors import this module and never each other.
"""

import contextlib
import dataclasses
import functools
import os
import sys
import time

import jax
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ripples_jax import algorithms, engine, optim, workload
from ripples_jax import data as data_lib
from ripples_jax.distributed import coord, kvstore, wire
from ripples_jax.distributed.arrays import LOCAL, WORKER, to_global, to_local
from ripples_jax.distributed.host import collective_timeout_s
from ripples_jax.models import init_model
from ripples_jax.runlog import RunLog, check_finite, make_workdir
from ripples_jax.runlog.storage import save_array
from ripples_jax.runtime import diloco, membership
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.preduce import GroupAverager, make_averager
from ripples_jax.timeline import slow_at

RESTART_ENV = "RIPPLES_RESTART"  # set by the local launcher in a restarted process: its restart count


GLOBAL = "global"  # DiLoCo's global model's snapshots (worker 0's copy: every worker holds the same)


def snapshot_path(workdir: str, name, worker: int | str) -> str:
  return os.path.join(workdir, "snapshots", f"{name}-{worker}.npy")


def make_step_fns(model, optimizer, unravel, local_mesh: Mesh):
  """The local step in two jitted halves on the flat state, so a gradient can be computed on one
  version of the parameters and applied to another (AD-PSGD's passive side; docs/design.md 3.3):
    grad(flat_D, x, y) -> (grads, model_state, loss);  apply(flat_D, opt_state, grads, model_state)."""
  rep = NamedSharding(local_mesh, P())
  batch = NamedSharding(local_mesh, P(LOCAL))  # several local devices: data parallel inside the worker

  def grad(flat, x_BxI, y_B):
    tree = unravel(flat)
    grad_fn = jax.value_and_grad(functools.partial(engine.cross_entropy_loss, model), has_aux=True)
    (loss, model_state), grads = grad_fn(tree["params"], tree["model_state"], x_BxI, y_B)
    return grads, model_state, loss

  def apply(flat, opt_state, grads, model_state):
    tree = unravel(flat)
    updates, opt_state = optimizer.update(grads, opt_state, tree["params"])
    params = optax.apply_updates(tree["params"], updates)
    flat, _ = ravel_pytree({"params": params, "model_state": model_state})
    return flat, opt_state

  grad_fn = jax.jit(grad, in_shardings=(rep, batch, batch), out_shardings=rep)
  apply_fn = jax.jit(
    apply, in_shardings=(rep, rep, rep, rep), out_shardings=(rep, rep), donate_argnums=(0, 1)
  )
  return grad_fn, apply_fn, rep, batch


@dataclasses.dataclass
class Loop:
  """This worker's loop state (its checkpoint's cursor and arrays)."""

  state: dict  # {"flat": D, "opt_state"} on this worker's devices (DiLoCo: and "outer")
  steps_done: int = 0  # this worker's local steps
  last_gid: int = -1  # the newest group it executed (global sequence number)
  epoch: int = 0  # checkpoint markers passed (trace events carry it: resume cuts there)
  evals: int = 0  # evaluation markers passed (their snapshots are kept on resume)
  syncs: int = 0  # group-or-none entries taken (a fixed schedule's position)
  last_step_time: float = 0.0  # its newest step's measured time (what its reports carry)
  time: float = 0.0  # seconds of the run before this process started (resume)
  resumed_at: int | None = None  # the checkpoint marker this process resumed from
  # Elastic membership (runtime/membership.py): every worker's incarnation as this worker's queue has
  # told it (pair connection keys), and whether it is a rejoined worker whose first group has not landed.
  incs: list | None = None
  joining: bool = False


class Worker:
  """This process's worker: its devices, jitted step, P-Reduce programs and checkpoint layout.

  Elastic (runtime/membership.py): life `life` of the worker runs on its process's local device `life`
  alone (membership.life_device), so a restarted process's collectives use device ids no earlier life
  connected with; otherwise the worker is all its process's devices (data parallel inside it)."""

  def __init__(self, config, s: workload.Setup, life: int = 0, kv=None):
    self.config, self.s, self.rt, self.kv = config, s, config.runtime, kv
    n, self.me = config.num_workers, coord.worker_of(jax.process_index())
    # Devices per worker, in the global order every process sees the same way (the coordinator's
    # device is in no mesh: it takes part in no collective).
    self.devices_of = {
      w: [d for d in jax.devices() if d.process_index == coord.worker_process(w)] for w in range(n)
    }
    params, model_state = init_model(s.model, jax.random.key(config.seed), s.data["x_train"][:1])
    flat0, self.unravel = ravel_pytree({"params": params, "model_state": model_state})
    # From host copies: the step donates its input, so every fresh state needs buffers of its own.
    self._flat0, self._opt0 = np.asarray(flat0), jax.device_get(s.optimizer.init(params))
    # DiLoCo: the outer step after each All-Reduce, on the global model every worker keeps a copy of.
    self._outer0, self.outer_step = None, None
    if config.algorithm == "diloco":
      self._outer0 = diloco.init_outer(self._flat0)
      self.outer_step = diloco.make_outer_step(config, params, model_state)
    self.place(life)
    self.t_start = 0.0  # perf_counter at the run's common start (minus the time before a resume)

  def place(self, life: int) -> None:
    """This worker's meshes, step and P-Reduce programs on the devices of its life `life` (elastic;
    a life beyond its devices is placed on life 0's, for a rejoin the run will refuse)."""
    n, elastic = self.config.num_workers, bool(self.rt.get("elastic", False))
    self.life = life
    if elastic:
      own = self.devices_of[self.me]
      mine = [membership.life_device(own, life if life < len(own) else 0)]
      # Checkpoints write this worker's row alone: the other rows' devices are any of their processes'.
      rows = [mine if w == self.me else self.devices_of[w][:1] for w in range(n)]
    else:
      mine, rows = self.devices_of[self.me], [self.devices_of[w] for w in range(n)]
    self.local_mesh = Mesh(np.array(mine), (LOCAL,))
    self.global_mesh = Mesh(np.array(rows), (WORKER, LOCAL))
    self.grad_fn, self.apply_fn, self.rep, self.batch_sharding = make_step_fns(
      self.s.model, self.s.optimizer, self.unravel, self.local_mesh
    )
    self.averager = make_averager(self.config, self.local_mesh, self.devices_of, self.me)
    if elastic and self.kv is not None:  # a pair of lives connecting in the run agrees first (membership)
      timeout_s = collective_timeout_s(self.rt)
      self.averager.handshake = lambda pair, key, gen, attempt: membership.handshake(
        self.kv, self.me, pair, key, timeout_s, gen=gen, attempt=attempt
      )
    # A rejoined worker's optimizer state: its schedule at its own step count (optim.at_schedule_step).
    self.schedule_at = jax.jit(optim.at_schedule_step, out_shardings=self.rep)

  def now(self) -> float:
    return time.perf_counter() - self.t_start

  def fresh(self) -> dict:
    state = {"flat": self._flat0, "opt_state": self._opt0}
    if self._outer0 is not None:
      state["outer"] = self._outer0
    return jax.device_put(state, self.rep)

  def batch(self, step: int):
    c, s = self.config, self.s
    idx = data_lib.batch_indices([s.shards[self.me]], c.batch_size, c.seed, [step], workers=[self.me])[0]
    return (
      jax.device_put(s.data["x_train"][idx], self.batch_sharding),
      jax.device_put(s.data["y_train"][idx], self.batch_sharding),
    )

  def slowdown(self, step: int, t: float) -> float:
    """Injected heterogeneity (docs/design.md 3.5, 3.7): a step starting at run time t takes `slowdown` x."""
    h, n = self.config.hetero, self.config.num_workers
    if self.me in slow_at(tuple(h.slow_workers), n, float(h.rotate_every), t):
      return float(h.slowdown)
    if h.random_p and np.random.default_rng([5, self.config.seed, self.me, step]).random() < h.random_p:
      return float(h.slowdown)
    return 1.0

  def pad(self, t0: float, t_compute: float, step: int) -> float:
    """Sleeps out the padding (runtime.step_time) and the slowdown; returns the end of the step."""
    padded = max(t_compute - t0, self.rt.step_time)
    target = t0 + padded * self.slowdown(step, t0 - self.t_start)
    while (left := target - time.perf_counter()) > 0:
      time.sleep(left)
    return time.perf_counter()

  def warm_up(self) -> float:
    """Compiles the step on a throw-away state; the median of the timed steps after it is this
    worker's first step-time estimate."""
    scratch = self.fresh()
    times = []
    for k in range(self.rt.warmup_steps + 1):
      x, y = self.batch(k)
      t0 = time.perf_counter()
      grads, ms, loss = self.grad_fn(scratch["flat"], x, y)
      scratch["flat"], scratch["opt_state"] = self.apply_fn(scratch["flat"], scratch["opt_state"], grads, ms)
      float(loss)
      times.append(max(time.perf_counter() - t0, self.rt.step_time))
    return float(np.median(times[1:])) if len(times) > 1 else times[0]

  # Checkpoints: this worker alone (RunLog per_process), as its row of (workers, ...) arrays.
  def pack(self, loop: Loop):
    exact = lambda a: np.asarray(a, np.float64).reshape(-1).view(np.int32)  # float64, bit for bit
    local = {
      **loop.state,
      "steps_done": np.int32(loop.steps_done),
      "last_gid": np.int32(loop.last_gid),
      "last_step_time": exact(loop.last_step_time),
    }
    return jax.tree.map(
      lambda a: jax.device_put(np.asarray(a) if not isinstance(a, jax.Array) else a, self.rep), local
    )

  def run_log(self, workdir: str) -> RunLog:
    """This worker's RunLog: its marker checkpoints alone, in ckpt/<worker>/ (per_process)."""
    rt = self.rt
    return RunLog(
      workdir,
      self.config,
      self.config.num_steps,
      checkpoint_every=rt.checkpoint_every,
      checkpoint_keep=rt.checkpoint_keep,
      per_process=(self.me, self.to_global, self.to_local),
    )

  def to_global(self, local):
    """This worker's state (on its devices or on the host) as its rows of (workers, ...) arrays."""
    return jax.tree.map(lambda a: to_global(jax.device_put(a, self.rep), self.global_mesh), local)

  def to_local(self, global_tree):
    return jax.tree.map(lambda a: to_local(a, self.rep), global_tree)

  def unpack(self, local, cursor: dict) -> Loop:
    f64 = lambda a: float(np.asarray(a).view(np.float64)[0])
    return Loop(
      {k: local[k] for k in ("flat", "opt_state", "outer") if k in local},
      int(local["steps_done"]),
      int(local["last_gid"]),
      cursor["mark"],
      cursor["evals"],
      cursor["syncs"],
      f64(local["last_step_time"]),
      cursor["time"],
      resumed_at=cursor["mark"],
    )


def first_life(config, kv) -> int:
  """The life this process will most likely be (0 unless it is a restart of an elastic run that is on:
  membership.next_life), so that it warms up on that life's device before it asks to rejoin."""
  if not config.runtime.get("elastic", False) or not membership.started(kv):
    return 0
  return membership.next_life(kv, coord.worker_of(jax.process_index()))


def open_worker(config, workdir: str):
  """What every worker process does first, whatever its executor: SIGTERM ends it with one line
  (coord.EXIT_TERM), the setup, the run's folder, the coordination client, and this process's Worker
  on its first life's devices (elastic: a restart warms up on its life's device). Returns (sigterm,
  workdir, kv, worker)."""
  sigterm = coord.SigtermStop(name=f"worker {coord.worker_of(jax.process_index())}").install()
  s = workload.build(config)
  workdir = make_workdir(workdir, config)
  kvstore.RETRY_WINDOW_S = collective_timeout_s(config.runtime)  # store calls ride out 2 x heartbeat_timeout
  kv = coord.client()
  return sigterm, workdir, kv, Worker(config, s, first_life(config, kv), kv)


def ask_back(worker: Worker, kv, workdir: str) -> tuple[dict, list]:
  """A restarted process asks to be taken back (membership.ask_to_join); refused, it exits with one
  line (coord.EXIT_REFUSED). Returns the answer and its earlier lives' trace; the run's clock is set.
  Given another life than the one it warmed up for (first_life), it moves to that life's device and
  warms up again first."""
  me = worker.me
  got = membership.ask_to_join(kv, me, worker.rt.stall_timeout)
  if got["refused"]:
    print(f"worker {me}: cannot rejoin the run: {got['refused']}; exiting", file=sys.stderr, flush=True)
    os._exit(coord.EXIT_REFUSED)
  if got["inc"] != worker.life:
    worker.place(got["inc"])
    worker.warm_up()
  worker.t_start = got["received"] - got["now"]  # the coordinator's run clock, up to half a round trip
  path = trace_lib.trace_path(workdir, me)
  return got, trace_lib.read_trace(path) if os.path.exists(path) else []


def start_clock(kv, me: int | None, n: int, epoch: int, own_time: float, timeout_ms: int) -> float:
  """The start barrier, and the perf_counter value at which the run's clock reads 0 on this process.

  A resumed worker saved its marker at its own moment, so the workers' saved run times differ (by up
  to a slow step). Smart GG and the moving straggler compare the workers' times, so every worker
  resumes the one clock: the latest saved time, at the barrier's release. me=None: the coordinator,
  which has no time of its own and reads the workers'."""
  key, fresh = f"{coord.PREFIX}/clock/{epoch}", epoch == 0 and own_time == 0.0  # fresh: all or none
  if not fresh and me is not None:
    kv.key_value_set(f"{key}/{me}", repr(float(own_time)), allow_overwrite=True)
  kv.wait_at_barrier(f"{coord.PREFIX}/start/{epoch}", timeout_ms)
  released = time.perf_counter()  # the same instant on every worker, up to the barrier's release skew
  if fresh:  # every clock starts at 0
    return released
  times = [
    wire.require(wire.seconds(f"{key}/{w}", v), f"{key}/{w}", v)
    for w in range(n)
    for v in [kv.blocking_key_value_get(f"{key}/{w}", timeout_ms)]
  ]
  return released - max(times)


def watch(kv, me: int, n: int, rt, sigterm, steps: int = 0, incarnation: int | None = None):
  """(progress, watchdog): what this worker's heartbeats report (local steps, queue entries taken,
  done) and the watchdog that beats them; SIGTERM then says every worker's last step. incarnation
  (elastic): the coordinator judges the peers; this worker exits once it is removed."""
  progress = {"steps": steps, "events": 0, "done": False}
  watchdog = coord.Watchdog(
    kv,
    me,
    n,
    lambda: (progress["steps"], progress["events"], progress["done"]),
    rt.heartbeat_s,
    rt.heartbeat_timeout,
    rt.stall_timeout,
    hosts_service=False,
    service_host=f"the {coord.COORDINATOR}",
    incarnation=incarnation,
  )
  sigterm.watchdog = watchdog
  return progress, watchdog


@contextlib.contextmanager
def watched(watchdog, trace, rt):
  """The run's body: its trace is flushed however it ends. A collective or the key-value store may fail
  (rather than hang) when a peer dies: the watchdog gets the time to name the lost worker (it exits the
  process) before the error surfaces."""
  try:
    yield
  except Exception:
    trace.flush()
    watchdog.await_verdict(rt.heartbeat_timeout + 3 * rt.heartbeat_s)
    raise
  finally:
    trace.flush()


def end_of_run(
  worker: Worker,
  loop: Loop,
  log: RunLog,
  kv,
  trace,
  progress,
  workdir: str,
  **end,
) -> None:
  """Every worker, after its last step: the final checkpoint (marker epoch + 1, the same id on every
  worker; loadable), the final state file, the trace's end event, then the end barrier."""
  rt = worker.rt
  if rt.checkpoint_every:
    final = loop.epoch + 1
    log.checkpoint(final, worker.pack(loop), cursor(worker, loop, final), force=True)
  save_array(snapshot_path(workdir, "final", worker.me), np.asarray(loop.state["flat"]))
  if worker.outer_step is not None and worker.me == 0:  # DiLoCo: its deployable model, the global one
    save_array(snapshot_path(workdir, "final", GLOBAL), np.asarray(loop.state["outer"]["global"]))
  if rt.get("consensus_allreduce") and algorithms.get(worker.config.algorithm).consensus == algorithms.BUILT:
    end["consensus_s"] = consensus_allreduce(worker, loop.state["flat"])
  trace.add(
    k="end",
    c=loop.epoch,
    t=worker.now(),
    s=loop.steps_done,
    compiles=worker.averager.compiles,
    setup_s=worker.averager.setup_s,
    ahead_s=worker.averager.ahead_s,
    **end,
  )
  trace.flush()
  log.wait()
  progress["done"] = True
  if loop.incs is not None:  # elastic: who is left at the end is the coordinator's to say
    kv.blocking_key_value_get(membership.ENDED, int(10 * rt.stall_timeout * 1000))
  else:
    kv.wait_at_barrier(f"{coord.PREFIX}/end", int(10 * rt.stall_timeout * 1000))


def consensus_allreduce(worker: Worker, flat_D) -> float:
  """Seconds of one All-Reduce of this worker's model over every worker: what building a gossip or
  group method's deployable model (the workers' mean) costs. Timed warm, on an averager of its own (the
  run's counters untouched): its program is compiled and its connection made by a first call, as the
  All-Reduce algorithm's are before its run; the result is dropped (the run's records are the run's)."""
  everyone = tuple(range(worker.config.num_workers))
  averager = GroupAverager(worker.local_mesh, worker.devices_of, 1)
  averager.connect(everyone, flat_D)
  t0 = time.perf_counter()
  averager.average(everyone, flat_D).block_until_ready()
  return time.perf_counter() - t0


def result(worker: Worker, loop: Loop, log: RunLog, workdir: str) -> dict:
  """A worker's own counts (the coordinator evaluates and writes summary.json)."""
  return {
    "algorithm": worker.config.algorithm,
    "executor": "async",
    "worker": worker.me,
    "worker_steps": loop.steps_done,
    "workdir": workdir,
  }


def cursor(worker: Worker, loop: Loop, mark: int | None = None) -> dict:
  return {
    "mark": loop.epoch if mark is None else mark,
    "evals": loop.evals,
    "syncs": loop.syncs,
    "time": worker.now(),
  }


def fails_here(worker: Worker, loop: Loop, where: str) -> bool:
  """Fault injection (runtime.fail_worker/fail_step/fail_where), in a process's first life only: a
  restarted one (the launcher's RIPPLES_RESTART, or a rejoined worker) runs on."""
  rt = worker.rt
  if worker.me != rt.fail_worker or loop.steps_done != rt.fail_step or rt.fail_where != where:
    return False
  return os.environ.get(RESTART_ENV, "0") == "0" and not (loop.incs and loop.incs[worker.me])


def end_step(worker: Worker, loop: Loop, log: RunLog, trace, epoch: int, times, loss: float) -> None:
  """A finished local step: its trace line (start, end of compute, end), the count, the NaN stop (it
  stops this worker; its peers' watchdogs then stop theirs) and the progress line."""
  t0, tc, t1 = (t - worker.t_start for t in times)
  trace.add(k="step", c=epoch, s=loop.steps_done, t0=t0, t1=t1, c_end=tc, loss=loss)
  loop.steps_done += 1
  check_finite(loop.steps_done, log.describe_last(), train_loss=loss)
