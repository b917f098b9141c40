r"""The Group Generator's authority alone, on the real coordination service: requests served per second,
its service time under 8 / 16 / 32 (and more) workers, and the store's size after the run.

  python -m benchmarks.bench_authority --workers=8,16,32,200 --steps=10000 \
      --json_out=results/authority/authority.json

Per worker count, 1 + `clients` processes on jax.distributed under the local launcher: process 0 hosts
the coordination service (the store every runtime uses, gRPC on loopback) and one Authority
(runtime/authority.py) with the run's Service and generator, and nothing else; processes 1.. run the
simulated workers as threads, each the runtime's real Feed: report a step start, sleep `step_time` (0:
none, the heaviest load), take the next entry, repeat, until STOP after `steps` worker steps in all.
Groups are not executed (no collectives): this measures the service. Reported: requests served per
second, the service time of a request (its arrival at the authority to the end of the round that
answered it: queueing included), the authority process's CPU use, and the keys left in the store.
"""

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from benchmarks.timing import print_json


class CountingKV:
  """The store's client, counting the calls made through it (each one RPC to the coordination
  service, which process 0 hosts: the service's own work per request)."""

  def __init__(self, kv):
    self.kv, self.calls = kv, {}
    self._lock = threading.Lock()

  def __getattr__(self, name):
    method = getattr(self.kv, name)

    def counted(*args, **kwargs):
      with self._lock:
        self.calls[name] = self.calls.get(name, 0) + 1
      return method(*args, **kwargs)

    return counted


def _service(n: int, steps: int, algorithm: str):
  from configs import default as default_config
  from ripples_jax.algorithms import make_group_generator
  from ripples_jax.schedule.online import Cadence, Service

  config = default_config.get_config(f"algorithm={algorithm},executor=sim,num_workers={n}")
  gg = make_group_generator(config, np.random.default_rng(0))
  return Service(n, gg, Cadence(steps, eval_every=steps // 10, checkpoint_every=steps // 5), 1e-3)


def serve(kv, n: int, steps: int, algorithm: str, out: str) -> None:
  """Process 0: the authority alone, until every worker has taken STOP."""
  from ripples_jax.runtime import authority as authority_lib

  service = _service(n, steps, algorithm)
  kv.wait_at_barrier("bench/start", 120_000)
  t0, cpu0 = time.perf_counter(), time.process_time()
  counted = CountingKV(kv)
  authority = authority_lib.Authority(counted, service, poll_s=0.005).start()
  ckpt = 0
  while not (service.stopped and all(p == service.appended(w) for w, p in enumerate(authority.posted))):
    time.sleep(0.01)
    while authority.snapshots and ckpt < service.marks["ckpt"]:  # as process 0 saves each one
      ckpt += 1
      authority.take_snapshot(ckpt)
  kv.wait_at_barrier("bench/end", 600_000)
  wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  authority.stop()
  keys = kv.key_value_dir_get("ripples/")
  clients = [json.loads(v) for _, v in kv.key_value_dir_get("bench/calls/")]
  handled = authority.handled
  row = {
    "workers": n,
    "worker_steps": int(service.steps.sum()),
    "requests": len(handled),
    "rounds": authority.rounds,
    "requests_per_s": len(handled) / wall,
    "busy_share": authority.busy_s / wall,  # the serving thread's time in rounds
    "requests_per_busy_s": len(handled) / authority.busy_s,
    "service_ms": authority_lib.percentiles(handled),
    "authority_cpu_use": cpu / wall,
    "wall_s": wall,
    "store_keys_after": len(keys),
    # Calls to the store per request served: the authority's and the simulated workers' (every one
    # an RPC the coordination service in this process answers).
    "store_calls_per_request": {
      "authority": sum(counted.calls.values()) / max(1, len(handled)),
      "workers": sum(sum(c.values()) for c in clients) / max(1, len(handled)),
      "by_call": {
        k: sum(c.get(k, 0) for c in [counted.calls, *clients]) / max(1, len(handled))
        for k in sorted({k for c in [counted.calls, *clients] for k in c})
      },
    },
    "service_state": {
      "entries_kept": sum(len(e) for e in service.entries),
      "groups_kept": len(service.buffer.groups),
      "groups_made": service.buffer.count,
      "snapshots_kept": len(authority.snapshots),
    },
  }
  with open(out, "w") as f:
    json.dump(row, f)


def simulate(kv, workers: list, step_time: float) -> None:
  """A client process: its simulated workers, one thread each, until STOP."""
  from ripples_jax.runtime import authority as authority_lib
  from ripples_jax.schedule.online import GROUP, MARK, STOP

  kv.wait_at_barrier("bench/start", 120_000)
  t0, errors = time.perf_counter(), []
  now = lambda: time.perf_counter() - t0  # noqa: E731
  counted = CountingKV(kv)

  def worker(w):
    try:
      feed, steps, last_gid = authority_lib.Feed(counted, w, now, ahead=True), 0, -1
      while True:
        feed.report(steps + 1, now(), max(step_time, 1e-3), last_gid)
        if step_time:
          time.sleep(step_time)
        steps += 1
        entry = feed.next(120.0)
        while entry[0] == MARK:
          entry = feed.next(120.0)
        if entry[0] == STOP:
          break
        if entry[0] == GROUP:
          last_gid = entry[1]
      feed.close()
    except Exception as e:  # noqa: BLE001
      errors.append((w, repr(e)))

  threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in workers]
  for t in threads:
    t.start()
  for t in threads:
    t.join(600)
  if errors:
    raise RuntimeError(f"simulated workers failed: {errors[:3]}")
  kv.key_value_set(f"bench/calls/{min(workers)}", json.dumps(counted.calls))
  kv.wait_at_barrier("bench/end", 600_000)


def process_main(argv) -> None:
  p = argparse.ArgumentParser()
  for name, kind in (("n", int), ("steps", int), ("step_time", float), ("algorithm", str), ("out", str)):
    p.add_argument(f"--{name}", type=kind)
  for name, kind in (("coordinator_address", str), ("num_processes", int), ("process_id", int)):
    p.add_argument(f"--{name}", type=kind)
  p.add_argument("--jax_distributed", action="store_true")
  a, _ = p.parse_known_args(argv)
  from ripples_jax.distributed.host import init_distributed
  from ripples_jax.distributed.kvstore import client

  init_distributed(a.coordinator_address, a.num_processes, a.process_id)
  kv = client()
  if a.process_id == 0:
    serve(kv, a.n, a.steps, a.algorithm, a.out)
  else:
    clients = a.num_processes - 1
    simulate(kv, [w for w in range(a.n) if w % clients == a.process_id - 1], a.step_time)
  sys.stdout.flush()
  os._exit(0)  # threads still blocked in the store's gets would abort an orderly interpreter exit


def run(n: int, steps: int, step_time: float, algorithm: str, clients: int, out_dir: str) -> dict:
  from ripples_jax.distributed.launcher import launch

  os.makedirs(out_dir, exist_ok=True)
  out = os.path.join(out_dir, f"authority-{n}.json")
  args = [
    f"--n={n}",
    f"--steps={steps}",
    f"--step_time={step_time}",
    f"--algorithm={algorithm}",
    f"--out={out}",
  ]
  with open(os.path.join(out_dir, f"launch-{n}.log"), "w") as log:
    code = launch(1 + clients, args, module="benchmarks.bench_authority", grace_s=10, out=log)
  if code:
    raise RuntimeError(f"bench_authority with {n} workers failed ({code}): {out_dir}/launch-{n}.log")
  with open(out) as f:
    return json.load(f)


def main(argv) -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--workers", default="8,16,32")
  p.add_argument("--steps", type=int, default=10000)
  p.add_argument("--step_time", type=float, default=0.0)
  p.add_argument("--algorithm", default="ripples_smart")
  p.add_argument("--clients", type=int, default=2, help="Processes holding the simulated workers.")
  p.add_argument("--out_dir", default="/tmp/bench_authority")
  p.add_argument("--json_out", default="")
  a = p.parse_args(argv)
  rows = [run(int(n), a.steps, a.step_time, a.algorithm, a.clients, a.out_dir) for n in a.workers.split(",")]
  result = {"algorithm": a.algorithm, "steps": a.steps, "step_time": a.step_time, "clients": a.clients}
  print_json({**result, "rows": rows}, a.json_out)


if __name__ == "__main__":
  if "--jax_distributed" in sys.argv:
    process_main(sys.argv[1:])
  else:
    main(sys.argv[1:])
