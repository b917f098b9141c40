r"""Group set-up at scale: P-Reduce as one collective per member set (group) against pairwise exchanges
(pairs), real processes side by side in one invocation.

  python -m benchmarks.bench_preduce --num_processes=16 --rounds=60 --json_out=results/preduce/n16.json

Modes: group, pairs, and pairs_ahead (the n-1 pair programs compiled and connected before the rounds, as
the runtime does before its start barrier). Each round is a fresh random partition of the workers into
groups of `group_size` (Random GG's draw, the same on every process from one seed); every worker
averages its buffer of `size` floats with its group, rounds back to back. Per mode: programs compiled
per worker (and their growth over the second half of the rounds), seconds in first calls (compile and
connection set-up) as a share of the mode's wall time, the steady time per average, and the numerics
against numpy (every mean within 1e-6 of the float64 mean; every member's mean the same bits).
Printed as JSON; the ratios compare the modes measured in one run.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

from benchmarks.timing import print_json

MODES = ("group", "pairs", "pairs_ahead")  # pairs_ahead: compiled and connected before the rounds


def partitions(n: int, group_size: int, rounds: int, seed: int) -> list:
  """`rounds` random partitions of range(n) into groups of group_size (a last smaller one; no singleton)."""
  rng, out = np.random.default_rng(seed), []
  for _ in range(rounds):
    perm = rng.permutation(n).tolist()
    groups = [tuple(sorted(perm[i : i + group_size])) for i in range(0, n, group_size)]
    if len(groups[-1]) == 1 and len(groups) > 1:  # a singleton joins the group before it
      groups[-2] = tuple(sorted(groups[-2] + groups[-1]))
      groups.pop()
    out.append(groups)
  return out


def buffer(worker: int, round_: int, size: int) -> np.ndarray:
  return np.random.default_rng([worker, round_]).standard_normal(size).astype(np.float32)


def worker_main(argv) -> None:
  """One process of the benchmark (started by run() through the launcher)."""
  p = argparse.ArgumentParser()
  for name, kind in (("size", int), ("rounds", int), ("group_size", int), ("seed", int), ("out_dir", str)):
    p.add_argument(f"--{name}", type=kind)
  p.add_argument("--jax_distributed", action="store_true")
  p.add_argument("--coordinator_address")
  p.add_argument("--num_processes", type=int)
  p.add_argument("--process_id", type=int)
  a, _ = p.parse_known_args(argv)
  from ripples_jax.distributed.host import init_distributed, use_cpu_devices

  use_cpu_devices(1)
  init_distributed(a.coordinator_address, a.num_processes, a.process_id)
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from ripples_jax.distributed.arrays import LOCAL
  from ripples_jax.distributed.kvstore import client
  from ripples_jax.runtime.preduce import GroupAverager, PairAverager

  n, me = a.num_processes, jax.process_index()
  devices_of = {w: [d for d in jax.devices() if d.process_index == w] for w in range(n)}
  local_mesh = Mesh(np.array(devices_of[me]), (LOCAL,))
  rep = NamedSharding(local_mesh, P())
  schedule = partitions(n, a.group_size, a.rounds, a.seed)
  kv = client()
  out = {}
  for mode in MODES:
    if mode == "group":
      averager = GroupAverager(local_mesh, devices_of, 64)
    else:
      averager = PairAverager(local_mesh, devices_of, me)
    like = jax.ShapeDtypeStruct((a.size,), np.float32)
    precompile_s = 0.0
    if mode == "pairs_ahead":  # as the runtime does before its start barrier
      precompile_s = averager.precompile(like) + averager.connect_all(
        jax.device_put(np.zeros(a.size, np.float32), rep)
      )
    inputs = [jax.device_put(buffer(me, r, a.size), rep) for r in range(a.rounds)]
    kv.wait_at_barrier(f"bench_preduce/{mode}/start", 120_000)
    t_start, times, compiles, digests, worst = time.perf_counter(), [], [], [], 0.0
    for r, groups in enumerate(schedule):
      members = next(g for g in groups if me in g)
      t0, before = time.perf_counter(), averager.compiles
      mean = np.asarray(averager.average(members, inputs[r]))
      if averager.compiles == before:
        times.append(time.perf_counter() - t0)
      compiles.append(averager.compiles)
      ref = np.mean([buffer(m, r, a.size).astype(np.float64) for m in members], axis=0)
      worst = max(worst, float(np.max(np.abs(mean - ref))))
      digests.append(hashlib.sha1(mean.tobytes()).hexdigest()[:12])
    wall = time.perf_counter() - t_start
    out[mode] = {
      "wall_s": wall,
      "setup_s": averager.setup_s,
      "setup_share": averager.setup_s / wall,
      "precompile_s": precompile_s,
      "compiles": compiles,
      "steady_ms": 1e3 * float(np.median(times)) if times else None,
      "max_abs_error": worst,
      "digests": digests,
    }
  kv.wait_at_barrier("bench_preduce/end", 120_000)
  with open(os.path.join(a.out_dir, f"worker-{me}.json"), "w") as f:
    json.dump(out, f)


def run(
  out_dir: str, num_processes: int, rounds: int = 60, size: int = 100_000, group_size: int = 3, seed: int = 0
) -> dict:
  """Starts the processes, merges what each wrote; returns the per-mode figures and the ratios."""
  from ripples_jax.distributed.launcher import launch

  os.makedirs(out_dir, exist_ok=True)
  args = [
    f"--size={size}",
    f"--rounds={rounds}",
    f"--group_size={group_size}",
    f"--seed={seed}",
    f"--out_dir={out_dir}",
  ]
  code = launch(num_processes, args, module="benchmarks.bench_preduce", grace_s=10, out=open(os.devnull, "w"))
  if code:
    raise RuntimeError(f"bench_preduce workers failed with exit code {code}")
  per = [json.load(open(os.path.join(out_dir, f"worker-{w}.json"))) for w in range(num_processes)]
  schedule = partitions(num_processes, group_size, rounds, seed)
  result = {"num_processes": num_processes, "rounds": rounds, "size": size, "group_size": group_size}
  for mode in MODES:
    agree = all(
      len({per[m][mode]["digests"][r] for m in g}) == 1 for r, groups in enumerate(schedule) for g in groups
    )
    compiles = [p[mode]["compiles"] for p in per]
    half = rounds // 2
    result[mode] = {
      "compiles_max": max(c[-1] for c in compiles),
      "compiles_second_half": max(c[-1] - c[half - 1] for c in compiles),  # growth after warm-up
      "setup_share_max": max(p[mode]["setup_share"] for p in per),
      "setup_s_median": float(np.median([p[mode]["setup_s"] for p in per])),
      "precompile_s_median": float(np.median([p[mode]["precompile_s"] for p in per])),
      "wall_s_max": max(p[mode]["wall_s"] for p in per),
      "steady_ms_median": float(np.median([p[mode]["steady_ms"] for p in per if p[mode]["steady_ms"]])),
      "max_abs_error": max(p[mode]["max_abs_error"] for p in per),
      "members_agree_bitwise": agree,
    }
  result["pairs_over_group_wall"] = result["pairs"]["wall_s_max"] / result["group"]["wall_s_max"]
  result["pairs_over_group_steady"] = (
    result["pairs"]["steady_ms_median"] / result["group"]["steady_ms_median"]
  )
  result["pairs_ahead_over_group_wall"] = result["pairs_ahead"]["wall_s_max"] / result["group"]["wall_s_max"]
  return result


def main(argv) -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--num_processes", type=int, default=8)
  p.add_argument("--rounds", type=int, default=60)
  p.add_argument("--size", type=int, default=100_000)
  p.add_argument("--group_size", type=int, default=3)
  p.add_argument("--out_dir", default="/tmp/bench_preduce")
  p.add_argument("--json_out", default="")
  a = p.parse_args(argv)
  result = run(a.out_dir, a.num_processes, a.rounds, a.size, a.group_size)
  print_json(result, a.json_out)


if __name__ == "__main__":
  if "--jax_distributed" in sys.argv:
    worker_main(sys.argv[1:])
  else:
    main(sys.argv[1:])
