"""Coordination through the jax.distributed service, by topic; the names below are its face, the
namespace the executors and the launcher use (coord.Watchdog, coord.EXIT_LOST, ...).

roles.py      process roles (the coordinator, worker w = process w + 1) and the exit codes
kvstore.py    the key-value store: its client, agreed estimates, values in order (paged), PREFIX
watchdog.py   heartbeats and the watchdog that names a lost or stalled peer
sigterm.py    SIGTERM's stop (SigtermStop): the same exit line, code EXIT_TERM
addresses.py  where the coordination service and gloo's listeners bind; whether a port is free
failures.py   what a worker's last lines name: lost peers, an intruding task id
"""

from ripples_jax.distributed.addresses import bind_address, collectives_host, port_problem, split_address
from ripples_jax.distributed.failures import intruder_task, lost_named
from ripples_jax.distributed.kvstore import (
  PAGE,
  PREFIX,
  WARMUP,
  Either,
  client,
  fetch_estimates,
  paged,
  publish_estimate,
  values_in_order,
)
from ripples_jax.distributed.roles import (
  COORDINATOR,
  EXIT_LOST,
  EXIT_REFUSED,
  EXIT_REMOVED,
  EXIT_STORAGE,
  EXIT_TERM,
  worker_of,
  worker_process,
)
from ripples_jax.distributed.sigterm import LAUNCHER_PID_ENV, SigtermStop
from ripples_jax.distributed.watchdog import Watchdog, beat_key, read_beat

__all__ = [
  "COORDINATOR",
  "EXIT_LOST",
  "EXIT_REFUSED",
  "EXIT_REMOVED",
  "EXIT_STORAGE",
  "EXIT_TERM",
  "LAUNCHER_PID_ENV",
  "PAGE",
  "PREFIX",
  "WARMUP",
  "Either",
  "SigtermStop",
  "Watchdog",
  "beat_key",
  "bind_address",
  "client",
  "collectives_host",
  "fetch_estimates",
  "intruder_task",
  "lost_named",
  "paged",
  "port_problem",
  "publish_estimate",
  "read_beat",
  "split_address",
  "values_in_order",
  "worker_of",
  "worker_process",
]
