"""The clock's output: event kinds (the package docstring lists them), interval kinds, Trace."""

import dataclasses

import numpy as np

START, APPLY, AVG, RING, PULL, JOIN, OUTER = range(7)
EVENT_NAMES = ("start", "apply", "average", "ring", "pull", "join", "outer")
COMPUTE, WAIT, COMM = "compute", "wait", "comm"


@dataclasses.dataclass
class Trace:
  """The clock's output: ordered events, per-worker intervals and counters."""

  num_workers: int
  events: list = dataclasses.field(default_factory=list)
  intervals: list = dataclasses.field(default_factory=list)  # (worker, kind, t0, t1)
  worker_steps: np.ndarray = None
  conflicts: np.ndarray = None
  end_time: float = 0.0
  buffer: object = None  # the Group Buffer of a Ripples run (its groups, in global order)
  requests: int = 0  # requests sent to the Group Generator
  pairs: list = None  # AD-PSGD's (active, passive) averaging pairs
  membership: list = dataclasses.field(default_factory=list)  # (time, worker, event): leave and join

  def __post_init__(self):
    self.worker_steps = np.zeros(self.num_workers, np.int64)
    self.conflicts = np.zeros(self.num_workers, np.int64)

  def time_split(self) -> dict:
    """Seconds each worker spent computing, waiting for a group or the server, and communicating."""
    out = {k: np.zeros(self.num_workers) for k in (COMPUTE, WAIT, COMM)}
    for w, kind, t0, t1 in self.intervals:
      out[kind][w] += t1 - t0
    return out
