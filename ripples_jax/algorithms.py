"""The algorithms: one record each, the one place an algorithm is registered (docs/design.md 3.14).

Everything that used to keep its own list reads this one: the validator (which executor runs which
algorithm, which config keys it reads, why it cannot run elastic or with leaves), docs/config.md, the
simulator's clock (`clock`), the runtime (`runtime`, whether a Group Generator drives it), the hybrid
(`make_group_generator` on a replica-sized view of the config) and the studies' labels.

Adding a baseline: its own module (its clock, its runtime role if new) and one record here. A Group
Generator (schedule/group_gen.py) with a record whose `generator` builds it runs in every executor that
drives generators (sim, async, hybrid) with no other change.

Invariants (tests/test_algorithms.py): names are unique; every record's clock protocol is one the
timeline simulates; the executors' lists, the hybrid's and the validator's messages are derived here.
"""

import dataclasses
from typing import Callable

import numpy as np

from ripples_jax.schedule import PeriodicSchedule, group_gen
from ripples_jax.schedule.static import allreduce_layouts, grid_layouts, hypercube_layouts, static_gg_layouts

# The simulator's clock protocols (timeline.simulate dispatches on them).
SYNC, DILOCO, ADPSGD, PS_ASYNC, GROUP_BUFFER = "sync", "diloco", "adpsgd", "ps_async", "group_buffer"
# The asynchronous runtime's roles (run.py dispatches on them): groups through the Group Buffer or a fixed
# schedule (runtime/worker.py), AD-PSGD's pairs (runtime/adpsgd.py), a parameter server (runtime/ps.py).
GROUPS, PAIRS, SERVER = "groups", "pairs", "server"
# The model a user can deploy (docs/design.md 3.14): every worker holds it (HELD: All-Reduce's, a
# server's), DiLoCo's global model after its last outer step (GLOBAL), or the workers' mean, which one
# All-Reduce builds and the simulator charges at each evaluation (BUILT: gossip and group methods).
HELD, GLOBAL, BUILT = "held", "global", "built"
STATIC_LAYOUTS = ("node", "hypercube")


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One algorithm. `generator(config, rng)`: its Group Generator (dynamic: the authority drives it);
  `layouts(config)`: a fixed schedule's periodic layouts (no authority; online.fixed_entry)."""

  name: str
  label: str  # the tables' name
  clock: str  # the simulator's protocol: SYNC, DILOCO, ADPSGD, PS_ASYNC or GROUP_BUFFER
  executors: tuple = ("sim",)  # sim, spmd (lockstep), async (the runtime)
  runtime: str | None = None  # executor=async's role: GROUPS, PAIRS or SERVER
  generator: Callable | None = None
  layouts: Callable | None = None
  keys: tuple = ()  # the config keys it reads (config.py validates each)
  min_workers: int = 1
  no_elastic: str | None = None  # why it cannot run with runtime.elastic (None: it can)
  no_leave: str | None = None  # why the simulator's hetero.leave cannot apply to it (None: it can)
  average_last: bool = False  # the runtime averages after the last step too (DiLoCo's final outer step)
  consensus: str = BUILT  # how the deployable model is had: HELD, GLOBAL or BUILT (one All-Reduce)

  @property
  def dynamic(self) -> bool:
    """A Group Generator the authority drives (schedule/online.Service)."""
    return self.generator is not None

  @property
  def hybrid(self) -> bool:
    """Runs across pipeline replicas (ripples_jax/hybrid): anything with groups, dynamic or fixed."""
    return self.generator is not None or self.layouts is not None

  @property
  def server(self) -> bool:
    return self.runtime == SERVER


def static_layouts(config) -> tuple:
  """The Static GG's periodic layouts chosen by config.schedule (the authors' node layout or a cube)."""
  n, s = config.num_workers, config.schedule
  if s.layout == "node":
    return static_gg_layouts(n, s.workers_per_node)
  if s.layout == "hypercube":
    return hypercube_layouts(n, s.hypercube_group_size)
  raise ValueError(f"config.schedule.layout: {s.layout!r} is not allowed: one of {', '.join(STATIC_LAYOUTS)}")


def _smart(config, rng):
  s = config.schedule
  return group_gen.smart_gg(
    config.num_workers, s.group_size, s.smart_tolerance, s.smart_max_gap, s.get("smart_fresh", False)
  )


def _moshpit(config, rng):
  """Moshpit's lockstep rounds (moshpit.window 0 or absent: every earlier figure) or, with a window, its
  published matchmaking (group_gen.moshpit_window_gg)."""
  m = config.moshpit
  layouts = grid_layouts(m.grid)
  if not m.get("window", 0.0):
    return group_gen.moshpit_gg(layouts)
  return group_gen.moshpit_window_gg(layouts, m.window, m.get("max_gap", 4))


def group_generator(name: str, label: str, generator, keys: tuple = ()) -> Algorithm:
  """The record of a Group Generator algorithm: the Group Buffer's protocol on the simulator's clock, the
  runtime's groups, its generator `generator(config, rng)` driven by the authority; elastic, with
  leaves, its deployable model built by one All-Reduce (the defaults). One line adds a generator."""
  return Algorithm(name, label, GROUP_BUFFER, ("sim", "async"), GROUPS, generator=generator, keys=keys)


_EVERY_WORKER = "every step averages over all workers, so no step can exclude a dead one"
_RESTART_ALL = "(its elastic form is the restart of every worker from the newest checkpoint: "
_RESTART_ALL += "experiments.launch --max_restarts)"
_GROUP_KEYS = ("schedule.group_size", "schedule.request_ahead")

REGISTRY = (
  Algorithm(
    "allreduce",
    "All-Reduce",
    SYNC,
    ("sim", "spmd", "async"),
    GROUPS,
    layouts=lambda c: allreduce_layouts(c.num_workers),
    no_elastic=f"{_EVERY_WORKER} {_RESTART_ALL}",
    no_leave="its every-worker collective cannot go on without a member",
    consensus=HELD,
  ),
  Algorithm(
    "ps_sync",
    "sync PS",
    SYNC,
    ("sim", "async"),
    SERVER,
    no_elastic="its step waits for every worker's push, and its server is the coordinator, whose loss "
    "ends the run (runtime/ps.py)",
    no_leave="its synchronous step waits for every worker",
    consensus=HELD,
  ),
  Algorithm(
    "ps_async",
    "async PS",
    PS_ASYNC,
    ("sim", "async"),
    SERVER,
    keys=("ps.staleness", "ps.server_momentum"),
    min_workers=2,
    no_elastic="its server is the coordinator, whose loss ends the run, and a dead worker's request "
    "would hold the server in its exchange (runtime/ps.py)",
    consensus=HELD,  # the server's model
  ),
  Algorithm("adpsgd", "AD-PSGD", ADPSGD, ("sim", "async"), PAIRS, min_workers=2),
  Algorithm("dpsgd", "D-PSGD", SYNC, no_leave="its fixed ring cannot exclude a member"),
  Algorithm(
    "ripples_static",
    "Static GG",
    GROUP_BUFFER,
    ("sim", "spmd", "async"),
    GROUPS,
    layouts=static_layouts,
    keys=("schedule.layout",),
    no_elastic="its groups are fixed in advance and cannot exclude a member",
    no_leave="Static GG's fixed groups cannot exclude a member",
  ),
  group_generator(
    "ripples_random",
    "Random GG",
    lambda c, rng: group_gen.random_gg(c.num_workers, c.schedule.group_size, rng),
    _GROUP_KEYS,
  ),
  group_generator(
    "ripples_division",
    "Group Division",
    lambda c, rng: group_gen.division_gg(c.num_workers, c.schedule.group_size, rng),
    _GROUP_KEYS,
  ),
  group_generator(
    "ripples_smart",
    "Smart GG",
    _smart,
    _GROUP_KEYS + ("schedule.smart_tolerance", "schedule.smart_max_gap", "schedule.smart_fresh"),
  ),
  Algorithm(
    "diloco",
    "DiLoCo",
    DILOCO,
    ("sim", "async"),
    GROUPS,
    keys=("diloco.inner_steps", "diloco.outer_lr", "diloco.outer_momentum"),
    no_elastic=f"its outer step all-reduces over every worker {_RESTART_ALL}",
    no_leave="its outer step all-reduces over every worker and waits for the slowest",
    average_last=True,
    consensus=GLOBAL,
  ),
  group_generator("moshpit", "Moshpit", _moshpit, ("moshpit.grid", "moshpit.window", "moshpit.max_gap")),
)
BY_NAME = {a.name: a for a in REGISTRY}
NONE = "none"  # the hybrid's replicas without averaging (replicas.algorithm only)


def get(name: str) -> Algorithm:
  """The record of `name` (KeyError names the allowed ones; the validator refuses unknown names first)."""
  if name not in BY_NAME:
    raise KeyError(f"algorithm {name!r} is not registered: one of {', '.join(BY_NAME)}")
  return BY_NAME[name]


def names(executor: str | None = None, **capabilities) -> tuple:
  """The registered names in registry order, those `executor` runs, and those whose fields or
  properties equal `capabilities` (e.g. names(dynamic=True), names("async", runtime=GROUPS))."""
  return tuple(
    a.name
    for a in REGISTRY
    if (executor is None or executor in a.executors)
    and all(getattr(a, k) == v for k, v in capabilities.items())
  )


def hybrid_names() -> tuple:
  """What replicas.algorithm allows: every algorithm with groups, and none."""
  return names(hybrid=True) + (NONE,)


def make_group_generator(config, rng: np.random.Generator):
  """config.algorithm's Group Generator (dynamic), group_gen.Fixed of its layouts for Static GG, None for
  the rest (the simulator's sync clocks and the runtime's fixed schedules take All-Reduce's groups
  without one); used by sim and runtime."""
  a = get(config.algorithm)
  if a.dynamic:
    return a.generator(config, rng)
  if a.clock == GROUP_BUFFER and a.layouts is not None:
    return group_gen.Fixed(a.layouts(config))
  return None


def groups_of(config, rng: np.random.Generator):
  """What averages in groups under config.algorithm: its Group Generator, group_gen.Fixed of a fixed
  schedule's layouts (All-Reduce's included), or None (`none`, or an algorithm without groups). The
  hybrid calls it on a replica-sized view of its config (hybrid.sim.replica_view)."""
  if config.algorithm == NONE:
    return None
  a = get(config.algorithm)
  if a.dynamic:
    return a.generator(config, rng)
  return group_gen.Fixed(a.layouts(config)) if a.layouts is not None else None


def make_schedule(config) -> PeriodicSchedule:
  """The lockstep executor's schedule (executor=spmd) of config.algorithm: its layouts, periodically."""
  allowed = names("spmd")
  if config.algorithm not in allowed:
    raise ValueError(f"config.algorithm: {config.algorithm!r} is not allowed: one of {', '.join(allowed)}")
  return PeriodicSchedule(config.num_workers, get(config.algorithm).layouts(config))


def asks_ahead(config) -> bool:
  """Whether the runtime's workers send their requests when a step starts (schedule/online.py's
  request-ahead: only for generators whose groups do not depend on when they are made)."""
  gg = make_group_generator(config, np.random.default_rng(0))
  return bool(config.schedule.request_ahead and getattr(gg, "ask_ahead", False))
