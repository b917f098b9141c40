"""DiLoCo on the clock (Douillard et al., 2023): H local steps per worker, then one All-Reduce of the
pseudo-gradient, which waits for the slowest worker, then the outer step (OUTER)."""

from ripples_jax.timeline.trace import APPLY, COMM, COMPUTE, OUTER, START, WAIT, Trace


def _simulate_diloco(speed, net, total_steps: int, budget: float, inner_steps: int) -> Trace:
  """Outer rounds until `total_steps` gradients (all workers together) are applied.

  In each round every worker computes h = min(H, the steps left per worker) steps back to back from
  the round's start (START then APPLY on its own slot: the run's optimizer, its state its own); the
  collective starts when the slowest worker's h-th step ends and takes one All-Reduce of the model;
  the OUTER event lands at its end and every worker starts again from the new global model.
  Invariants: without jitter, a round lasts h x the slowest worker's step + net.allreduce(n); each
  slot's events are in clock order. Unlike the lockstep algorithms the last round's collective is part
  of the run (end_time is its end): DiLoCo's model is the global one, which only the outer step makes.
  A round whose outer step would end past `budget` is not run.
  """
  n = speed.num_workers
  tr = Trace(n)
  rngs = speed.streams()
  comm = net.allreduce(n)
  everyone = tuple(range(n))
  t, done = 0.0, 0
  while done < total_steps:
    h = min(inner_steps, -(-(total_steps - done) // n))
    events, ends, intervals = [], [], []
    for w in range(n):
      t_w = t
      for _ in range(h):
        c = speed.draw(rngs, w, t_w)
        events += [(t_w, START, w, None), (t_w + c, APPLY, w, w)]
        intervals.append((w, COMPUTE, t_w, t_w + c))
        t_w += c
      ends.append(t_w)
    slowest = max(ends)
    if slowest + comm > budget:
      break
    # Stable: a worker's APPLY stays before its next START at the same instant.
    tr.events += sorted(events, key=lambda e: e[0])
    for w, end in enumerate(ends):
      if end < slowest:
        intervals.append((w, WAIT, end, slowest))
      if comm > 0:
        intervals.append((w, COMM, slowest, slowest + comm))
    tr.intervals += intervals
    tr.worker_steps += h
    done += n * h
    t = tr.end_time = slowest + comm
    tr.events.append((t, OUTER, everyone, None))
  return tr
