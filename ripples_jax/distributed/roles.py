"""Who is who in a multi-process run, and the exit codes a process ends with.

In an executor=async run, process 0 is the coordinator (COORDINATOR): it hosts the coordination service
and the Group Generator's authority and trains nothing; worker w is process w + 1 (worker_process). Its
watchdog watches every worker and exits last. Elsewhere (the pipeline) process k is stage k and process 0
hosts the service.
"""

EXIT_LOST = 75  # a peer was lost: distinct from crashes (1) and bad input (2); resume to go on
EXIT_TERM = 143  # stopped by SIGTERM: 128 + 15, what a shell reports for a SIGTERM death; resume to go on
EXIT_REMOVED = 76  # runtime.elastic: this worker was removed (it stalled); restart it to rejoin
EXIT_STORAGE = (
  74  # sysexits' EX_IOERR: the disk refused a write (full); free space and rerun; never restarted
)
EXIT_REFUSED = 78  # runtime.elastic: a rejoin the run cannot take (the line says why); not restarted
COORDINATOR = "coordinator"  # process 0 of an executor=async run (its watchdog's name in exit lines)


def worker_process(worker: int) -> int:
  """The process id of worker `worker` in an executor=async run (process 0 is the coordinator)."""
  return worker + 1


def worker_of(process: int) -> int:
  """The worker a process of an executor=async run is (-1: the coordinator)."""
  return process - 1
