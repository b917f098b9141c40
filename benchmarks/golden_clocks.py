r"""Hashes of the simulator's and the hybrid's clocks: a refactor that must not move a number writes them
before and after, and the two files must be equal.

  python -m benchmarks.golden_clocks --out=/tmp/before.json   # on the old commit
  python -m benchmarks.golden_clocks --out=/tmp/after.json    # on the new one
  diff /tmp/before.json /tmp/after.json

Every registered algorithm on the simulator's clock (8 workers, 60 steps, homogeneous and one worker 5x
slower, jitter 0.1) and every generator of the hybrid (R=4, K=2, a 5x device, and a rotating 3x device
with jitter and sync_every=2). A hybrid event is hashed as ("tick" | "avg") tuples, its kinds' names
before the hybrid took the timeline's (WORKSPACE.md section 45: identical across the fourth pass).
"""

import hashlib
import json

from absl import app, flags

flags.DEFINE_string("out", None, "Where the JSON of hashes goes.", required=True)
FLAGS = flags.FLAGS


def digest(obj) -> str:
  return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def simulator_clocks() -> dict:
  from configs import default
  from ripples_jax import algorithms, sim

  out = {}
  for name in algorithms.names():
    for slow in [(), (3,)]:
      c = default.get_config(f"algorithm={name},executor=sim,num_workers=8,steps=60")
      c.hetero.slow_workers, c.hetero.slowdown, c.hetero.jitter = slow, 5.0, 0.1
      trace = sim.run_clock(c, 4e6, 0.05)
      out[f"sim/{name}/{slow}"] = f"{digest([tuple(e) for e in trace.events])} end={trace.end_time:.6f}"
  return out


def hybrid_clocks() -> dict:
  from configs import dsp
  from ripples_jax import algorithms
  from ripples_jax.hybrid import clock, sim

  out = {}
  scenarios = [
    dict(slow=(1, 0), slowdown=5.0),
    dict(slow=(0, 1), slowdown=3.0, rotate_every=0.5, jitter=0.05, sync_every=2),
  ]
  for name in algorithms.hybrid_names():
    for kw in scenarios:
      c = dsp.get_config("method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=4")
      c.replicas.update(count=4, algorithm=name, group_size=3, workers_per_node=2, **kw)
      trace = clock.simulate_replicas(sim.clock_spec(c, (0.1, 0.12), (4e6, 4e6), 400))
      named = [
        (e[0], "tick", e[2], e[3]) if e[1] == clock.TICK_END else (e[0], "avg", e[2]) for e in trace.events
      ]
      groups = sum(e[1] == "avg" for e in named)
      out[f"hyb/{name}/{sorted(kw.items())}"] = f"{digest(named)} end={trace.end_time:.6f} groups={groups}"
  return out


def main(_):
  out = {**simulator_clocks(), **hybrid_clocks()}
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)
  print(f"{len(out)} hashes: {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
