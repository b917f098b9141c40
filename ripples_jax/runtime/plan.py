"""The runtime's group plan: every process computes the same global group sequence, block by block.

A real collective backend needs every member of a group to reach it, and members that meet their
groups in different orders deadlock (DESIGN 5). So the groups form one global order (the Group Buffer),
and each worker executes its own groups in that order. The runtime plans the order in blocks:

  allreduce, ripples_static   closed form: every worker takes `block_steps` steps per block, each
                              followed by its group (all workers / its group in the next Static layout).
  ripples_random, _division,  the simulator's clock and Group Generator run over a horizon of
  ripples_smart, adpsgd       `block_steps` (+ 1/2) x the slowest estimated step, with the *agreed* per-worker
                              step-time estimates as the speeds; the order in which the clock applies
                              steps and lands averages is the plan. Smart GG thereby groups workers that
                              are expected to be ready together, exactly as it does in simulation.

The plan is a pure function of (config, block index, planned steps so far, estimates), and the
estimates are exchanged as decimal strings, so every process computes a bit-identical plan.
"""
import dataclasses
import math

import numpy as np

from ripples_jax import timeline
from ripples_jax.schedule import static_layouts

STEP = -1  # a token: take one local step (otherwise a token indexes the block's groups)
CLOSED_FORM = ("allreduce", "ripples_static")
PLANNED = ("ripples_random", "ripples_division", "ripples_smart", "adpsgd")
RUNTIME_ALGORITHMS = CLOSED_FORM + PLANNED


@dataclasses.dataclass(frozen=True)
class Block:
  index: int
  groups: tuple            # member tuples, in the global order
  tokens: tuple            # per worker: STEP or a group index, in the worker's execution order

  def steps(self) -> np.ndarray:
    return np.array([sum(t == STEP for t in tok) for tok in self.tokens], np.int64)


def plan_block(config, index: int, planned_steps: int, estimates, model_bytes: float) -> Block:
  """Block `index`, given the worker steps already planned (all workers) and the agreed estimates."""
  n = config.num_workers
  remaining = config.num_steps * n - planned_steps
  if remaining <= 0:
    return Block(index, (), tuple(() for _ in range(n)))
  rt = config.runtime
  if config.algorithm in CLOSED_FORM:
    k = min(rt.block_steps, math.ceil(remaining / n))
    if config.algorithm == "allreduce":
      layouts = [[tuple(range(n))]]
    else:
      layouts = static_layouts(config)
    groups, tokens = [], [[] for _ in range(n)]
    first = index * rt.block_steps  # the sync index of this block's first step (blocks are full)
    for j in range(k):
      for w in range(n):
        tokens[w].append(STEP)
      for members in layouts[(first + j) % len(layouts)]:
        if len(members) > 1:
          for m in members:
            tokens[m].append(len(groups))
          groups.append(tuple(sorted(members)))
    return Block(index, tuple(groups), tuple(tuple(t) for t in tokens))

  from ripples_jax.schedule import make_group_generator  # the simulator's generators, unchanged
  times = tuple(float(e) for e in estimates)
  speed = timeline.SpeedModel(max(times), n, times=times, seed=config.seed)
  tl = config.timeline
  net = timeline.Network(model_bytes, tl.alpha, tl.bandwidth, tl.ps_bandwidth)
  gg = make_group_generator(config, np.random.default_rng([4, config.seed, index]))
  # Half a slow step past block_steps of them: the slowest worker's last step (and its group) lands
  # inside the horizon even with communication, so it gets exactly block_steps steps per block.
  horizon = (rt.block_steps + 0.5) * max(times)
  trace = timeline.simulate(config.algorithm, speed, net, remaining, horizon, gg,
                            seed=config.seed * 100003 + index)
  groups, tokens = [], [[] for _ in range(n)]
  for _, kind, a, b in trace.events:
    if kind == timeline.APPLY:
      tokens[a].append(STEP)
    elif kind == timeline.AVG:
      for m in a:
        tokens[m].append(len(groups))
      groups.append(tuple(sorted(a)))
  if not any(tokens):  # a horizon shorter than every step: plan one step each rather than nothing
    tokens = [[STEP] for _ in range(min(n, remaining))] + [[] for _ in range(n - min(n, remaining))]
  return Block(index, tuple(groups), tuple(tuple(t) for t in tokens))
