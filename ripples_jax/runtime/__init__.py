"""executor=async: the asynchronous multi-process Ripples runtime on jax.distributed.

  plan       the global group order, block by block (the simulator's Group Buffer and generators)
  preduce    P-Reduce between processes over a group's sub-mesh, one cached program per member set
  coord      estimates, heartbeats and the watchdog, through the coordination service
  worker     one process's worker loop, checkpoints, snapshots for evaluation
  summary    throughput, time split and accuracy over wall-clock time, from the run's files
  trace      per-worker event traces and their Gantt chart
  replay     the recorded event order through the single-process engine (what the runtime computed)
  launcher   N local processes on 127.0.0.1, prefixed logs, fail-fast: names the first failing worker,
             SIGTERM to the others (process 0 last), SIGKILL after a grace period
"""
