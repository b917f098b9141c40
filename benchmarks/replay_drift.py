r"""Where a runtime run and the engine's replay of its traces part: each step's loss at its start.

  python -m benchmarks.replay_drift --workdir=RUN [--workdir=RUN2 ...]

For each run (a finished executor=async run's workdir), the engine replays the traces
(runtime/replay.py) and every start's loss is compared with the loss the worker recorded for that step.
Prints per run: the starts, the fraction equal bit for bit and within 3e-7 (a few ulp), the first start
off by more than 1e-5 (its round of the replay, worker and step), the first start off at all, the largest
difference in each tenth of the rounds, and the largest relative difference.
The engine's rounds and the workers' programs order float sums differently; the figures show where a
few ulp became more (docs/design.md 3.12).
"""

import json
import os

import ml_collections
import numpy as np
from absl import app, flags

from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.replay import replay

FLAGS = flags.FLAGS


def drift(workdir: str) -> dict:
  config = ml_collections.ConfigDict(json.load(open(os.path.join(workdir, "config.json"))))
  want = {w: [e["loss"] for e in ev if e["k"] == "step"] for w, ev in trace_lib.load_traces(workdir).items()}
  rows, rounds = [], [0]  # (round, worker, step, relative difference); rounds replayed

  def on_round(started, steps, loss):
    for w, s, got in zip(started, steps, loss):
      ref = want[int(w)][int(s)]
      rows.append((rounds[0], int(w), int(s), abs(float(got) - ref) / abs(ref)))
    rounds[0] += 1

  replay(config, workdir, on_round=on_round)
  rel = np.array([r[3] for r in rows])
  first = next((r for r in rows if r[3] > 1e-5), None)
  return {
    "workdir": workdir,
    "starts": len(rows),
    "rounds": rounds[0],
    "exact": float(np.mean(rel == 0)),
    "within_3e-7": float(np.mean(rel <= 3e-7)),
    "first_over_1e-5": None if first is None else {"round": first[0], "worker": first[1], "step": first[2]},
    "first_off": next(({"round": r[0], "relative": r[3]} for r in rows if r[3] > 0), None),
    # the largest difference in each tenth of the rounds: a float-order drift grows from a few ulp
    # smoothly; a wrong update would jump at its round
    "growth": [
      float(rel[[r[0] * 10 // max(rounds[0], 1) == k for r in rows]].max(initial=0.0)) for k in range(10)
    ],
    "max": float(rel.max()) if len(rel) else 0.0,
  }


def main(argv):
  del argv
  for w in FLAGS.workdir:
    print(json.dumps(drift(w)), flush=True)


if __name__ == "__main__":
  flags.DEFINE_multi_string("workdir", [], "A finished executor=async run's workdir (repeatable).")
  app.run(main)
