"""What a worker's last lines say about a failure, for the local launcher: lost_named (the workers a
watchdog named) and intruder_task (a task id registered by a process nobody started as a worker).
"""

import re

from ripples_jax.distributed.roles import COORDINATOR

# The watchdog's exit lines (Watchdog.check, _run) and the worker(s) each one names.
_WHO = r"^(?:(?:worker|stage) \d+|coordinator)"
_LOST_LINES = (
  re.compile(_WHO + r": (?:worker|stage)\(s\) \[([\d, ]+)\] lost: no heartbeat"),
  re.compile(_WHO + r": no progress for .*; (?:worker|stage) (\d+) stalled first"),
  re.compile(
    _WHO + r": lost contact with the coordination service \(hosted by (?:worker (0)|the (coordinator))'s"
  ),
)


def lost_named(line: str) -> list:
  """The worker(s) a watchdog's exit line names as lost or stalled first (ints; COORDINATOR for the
  coordinator); [] for any other line."""
  for pattern in _LOST_LINES:
    if m := pattern.search(line):
      if m.lastindex and m.lastindex > 1 and m.group(2):
        return [COORDINATOR]
      return [int(w) for w in m.group(1).split(",")]
  return []


# What the coordination service reports (process 0's log, every client's abort line) when a task id that
# has already registered registers again: under the local launcher, nobody restarts a worker, so another
# process connected to the (unauthenticated) coordinator as that task.
_REREGISTERED = re.compile(r"\b(\d+) unexpectedly tried to connect with a different incarnation")


def intruder_task(line: str) -> int | None:
  """The task id in the coordination service's "registered again" error, or None."""
  m = _REREGISTERED.search(line)
  return int(m.group(1)) if m else None
