"""Group Generators and baseline schedules: host-side numpy, deterministic under a seed.

A schedule says what happens in each round; the engine makes it happen. For the lockstep executor a
round is (which workers step, which layout averages), where the layout is an index into the schedule's
fixed tuple of layouts so that the jitted round never sees a Python constant change.
"""

import dataclasses

import numpy as np

from ripples_jax.collectives import Layout
from ripples_jax.schedule import group_gen
from ripples_jax.schedule.static import (
  allreduce_layouts,
  default_grid,  # noqa: F401  (configs/default.py's moshpit.grid)
  grid_layouts,
  hypercube_layouts,
  static_gg_layouts,
)

# Every algorithm runs in the simulator (executor=sim); the lockstep executor runs the periodic ones.
ALGORITHMS = (
  "allreduce",
  "ps_sync",
  "ps_async",
  "adpsgd",
  "dpsgd",
  "ripples_static",
  "ripples_random",
  "ripples_division",
  "ripples_smart",
  "diloco",
  "moshpit",
)
LOCKSTEP_ALGORITHMS = ("allreduce", "ripples_static")
STATIC_LAYOUTS = ("node", "hypercube")


@dataclasses.dataclass(frozen=True)
class Round:
  step_mask: np.ndarray  # bool[n]: workers that take a local step this round
  layout_idx: int  # index into Schedule.layouts: the groups that average after the step


@dataclasses.dataclass(frozen=True)
class PeriodicSchedule:
  """Every worker steps every round; round t averages with layouts[t % period]."""

  num_workers: int
  layouts: tuple[Layout, ...]

  def round(self, step: int) -> Round:
    return Round(np.ones(self.num_workers, bool), step % len(self.layouts))

  def groups(self, step: int) -> Layout:
    return self.layouts[step % len(self.layouts)]


def static_layouts(config) -> tuple[Layout, ...]:
  """The Static GG's periodic layouts chosen by config.schedule (the authors' node layout or a cube)."""
  n, s = config.num_workers, config.schedule
  if s.layout == "node":
    return static_gg_layouts(n, s.workers_per_node)
  if s.layout == "hypercube":
    return hypercube_layouts(n, s.hypercube_group_size)
  raise ValueError(f"config.schedule.layout: {s.layout!r} is not allowed: one of {', '.join(STATIC_LAYOUTS)}")


def make_group_generator(config, rng: np.random.Generator):
  """The Group Generator of a ripples_* algorithm or Moshpit (None for the other baselines); used by
  sim and runtime."""
  n, s = config.num_workers, config.schedule
  if config.algorithm == "ripples_static":
    return group_gen.Fixed(static_layouts(config))
  if config.algorithm == "ripples_random":
    return group_gen.random_gg(n, s.group_size, rng)
  if config.algorithm == "ripples_division":
    return group_gen.division_gg(n, s.group_size, rng)
  if config.algorithm == "ripples_smart":
    return group_gen.smart_gg(
      n, s.group_size, s.smart_tolerance, s.smart_max_gap, s.get("smart_fresh", False)
    )
  if config.algorithm == "moshpit":
    return group_gen.moshpit_gg(grid_layouts(config.moshpit.grid))
  return None


def make_schedule(config) -> PeriodicSchedule:
  """Builds the lockstep schedule named by config.algorithm (config.schedule holds its options)."""
  n = config.num_workers
  if config.algorithm == "allreduce":
    return PeriodicSchedule(n, allreduce_layouts(n))
  if config.algorithm == "ripples_static":
    return PeriodicSchedule(n, static_layouts(config))
  raise ValueError(
    f"config.algorithm: {config.algorithm!r} is not allowed: one of {', '.join(LOCKSTEP_ALGORITHMS)}"
  )
