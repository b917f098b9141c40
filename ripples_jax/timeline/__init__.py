"""Discrete-event clock: worker speeds + a network cost model -> the ordered events of a run.

The clock never touches arrays. It decides *when* each worker starts a gradient, when the gradient is
applied, and when a group average lands; the engine then executes those events in order (a schedule
says what happens; an executor makes it happen; a clock says when). Gradients are computed on the
parameters a worker holds when its computation starts and applied to what it holds when it finishes
(AD-PSGD semantics), so staleness from averages landing mid-computation is modelled exactly.

Events are tuples (time, kind, a, b):
  START  a=worker              compute a gradient on the worker's current params (its next batch)
  APPLY  a=target, b=source    apply source's finished gradient to target's params (target=source,
                               or the parameter server's slot for asynchronous PS)
  AVG    a=members tuple       replace each member's params by the members' mean (atomic, at `time`)
  RING   -                     D-PSGD gossip on the ring: x_i <- (x_{i-1} + x_i + x_{i+1}) / 3
  OUTER  a=members tuple       DiLoCo's outer step: the members' pseudo-gradient mean, the outer
                               optimizer, every member restarts from the new global model
  PULL   a=worker, b=source    copy source's params (the server) into the worker
  JOIN   a=worker, b=source    a rejoined worker's first group: copy source's params (the others' mean;
                               its own weight is 0) and reset its optimizer state (docs/design.md 3.10)

With hetero.leave, workers leave and rejoin at given virtual times; trace.membership lists what the
clock applied: (time, worker, "leave" | "rejoin" | "first_group").
"""

import dataclasses
from typing import Callable

import numpy as np

from ripples_jax import algorithms
from ripples_jax.schedule.group_gen import Fixed
from ripples_jax.timeline.adpsgd import _adpsgd
from ripples_jax.timeline.clock import _Clock
from ripples_jax.timeline.costs import AdpsgdCost, AuthorityCost, Network, SpeedModel, slow_at
from ripples_jax.timeline.diloco import _simulate_diloco
from ripples_jax.timeline.group_buffer import _group_buffer
from ripples_jax.timeline.ps_async import _ps_async
from ripples_jax.timeline.rounds import pack_rounds
from ripples_jax.timeline.sync import _simulate_sync
from ripples_jax.timeline.trace import (
  APPLY,
  AVG,
  COMM,
  COMPUTE,
  EVENT_NAMES,
  JOIN,
  OUTER,
  PULL,
  RING,
  START,
  WAIT,
  Trace,
)

__all__ = [
  "APPLY",
  "AVG",
  "COMM",
  "COMPUTE",
  "EVENT_NAMES",
  "JOIN",
  "OUTER",
  "PULL",
  "RING",
  "START",
  "WAIT",
  "AdpsgdCost",
  "AuthorityCost",
  "ClockSpec",
  "Network",
  "SpeedModel",
  "Trace",
  "pack_rounds",
  "simulate",
  "slow_at",
]


@dataclasses.dataclass(frozen=True)
class ClockSpec:
  """One run of the clock: `simulate(ClockSpec(...))` runs until `total_steps` gradients (all workers
  together) are applied or `time_budget` seconds (0: none) have passed.

  `rtt`: seconds a request to the Group Generator takes to be answered (the online protocol); `ahead`:
  a worker requests its next group when its step starts (schedule.request_ahead); `adpsgd_cost`: the
  AD-PSGD cost model's parts (AdpsgdCost; default: as published); `server`: what the runtime's
  authority and group set-up cost (AuthorityCost; default: nothing); `leave`: (worker, t_leave,
  t_rejoin) triples, t_rejoin < 0 or inf for never (docs/design.md 3.10); `detect`: seconds from a
  death to its removal (the runtime's heartbeat timeout; Group Buffer algorithms only): in between the
  generators still draw the dead worker and its groups fail after their live members' exchanges. The
  live workers make up the steps of the dead: the run still ends at the total_steps-th gradient.
  `inner_steps`: DiLoCo's H, the local steps between two outer steps."""

  algorithm: str
  speed: SpeedModel
  net: Network
  total_steps: int
  time_budget: float = 0.0
  gg: Callable | None = None  # the Group Generator (stateful: one spec, one run)
  seed: int = 0
  rtt: float = 0.0
  ahead: bool = True
  adpsgd_cost: AdpsgdCost | None = None
  server: AuthorityCost | None = None
  leave: tuple = ()
  detect: float = 0.0
  inner_steps: int = 1


def simulate(spec: ClockSpec) -> Trace:
  """The clock's events for `spec` (ClockSpec says what each field means); refuses a leave plan where
  the algorithm cannot exclude a member (its record's no_leave) and `detect` outside the Group Buffer."""
  s = spec
  budget = s.time_budget or float("inf")
  a = algorithms.get(s.algorithm)  # its record says which clock protocol it runs
  if s.leave and (a.no_leave or isinstance(s.gg, Fixed)):
    why = a.no_leave or algorithms.get("ripples_static").no_leave
    raise ValueError(f"leave/join is not allowed with {s.algorithm}: {why}")
  if a.clock == algorithms.SYNC:
    return _simulate_sync(s.algorithm, s.speed, s.net, s.total_steps, budget)
  if a.clock == algorithms.DILOCO:
    return _simulate_diloco(s.speed, s.net, s.total_steps, budget, s.inner_steps)
  if s.detect and a.clock in (algorithms.ADPSGD, algorithms.PS_ASYNC):
    raise ValueError(f"detect is not allowed with {s.algorithm}: it models the Group Buffer's removal")
  clock = _Clock(s.speed, s.total_steps, budget, s.leave, s.detect)
  if a.clock == algorithms.ADPSGD:
    _adpsgd(clock, s.net, np.random.default_rng([3, s.seed]), s.adpsgd_cost or AdpsgdCost())
  elif a.clock == algorithms.PS_ASYNC:
    _ps_async(clock, s.net)
  else:
    ahead = s.ahead and getattr(s.gg, "ask_ahead", False)
    _group_buffer(clock, s.net, s.gg, s.rtt, ahead, s.server or AuthorityCost())
  return clock.finish()
