"""Group Generators and baseline schedules: host-side numpy, deterministic under a seed.

A schedule says what happens in each round; the engine makes it happen. For the lockstep executor a
round is (which workers step, which layout averages), where the layout is an index into the schedule's
fixed tuple of layouts so that the jitted round never sees a Python constant change.

Which algorithm uses which generator or layouts is the algorithm registry's (ripples_jax/algorithms.py).
"""

import dataclasses

import numpy as np

from ripples_jax.collectives import Layout
from ripples_jax.schedule.static import (  # noqa: F401  (the schedules' names, one import away)
  allreduce_layouts,
  default_grid,
  grid_layouts,
  hypercube_layouts,
  static_gg_layouts,
)


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
