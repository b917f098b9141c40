"""The lockstep algorithms' clock (All-Reduce, synchronous PS, D-PSGD: algorithms.SYNC)."""

import numpy as np

from ripples_jax.timeline.trace import APPLY, AVG, COMM, COMPUTE, RING, START, WAIT, Trace


def _simulate_sync(algorithm, speed, net, total_steps, budget) -> Trace:
  """Lockstep: everybody computes, waits for the slowest, then one collective."""
  n = speed.num_workers
  tr = Trace(n)
  rngs = speed.streams()
  comm = {"allreduce": net.allreduce(n), "ps_sync": net.ps_sync_step(n), "dpsgd": net.ring_gossip()}[
    algorithm
  ]
  t = 0.0
  done = 0
  while done < total_steps:
    c = np.array([speed.draw(rngs, w, t) for w in range(n)])
    for w in range(n):
      tr.events.append((t, START, w, None))
    slowest = t + c.max()
    if slowest + comm > budget:
      break
    last = done + n >= total_steps
    for w in np.argsort(c, kind="stable"):
      tr.events.append((t + c[w], APPLY, int(w), int(w)))
      tr.intervals.append((int(w), COMPUTE, t, t + c[w]))
      if t + c[w] < slowest:
        tr.intervals.append((int(w), WAIT, t + c[w], slowest))
      if not last:
        tr.intervals.append((int(w), COMM, slowest, slowest + comm))
    tr.worker_steps += 1
    done += n
    # Every algorithm's run ends when its last gradient lands (the asynchronous ones cannot wait for
    # a final sync), so the last step's collective is not part of the run.
    tr.end_time = slowest
    if done >= total_steps:
      break
    t = slowest + comm
    tr.events.append((t, RING, None, None) if algorithm == "dpsgd" else (t, AVG, tuple(range(n)), None))
  return tr
