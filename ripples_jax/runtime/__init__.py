"""executor=async: the asynchronous multi-process Ripples runtime on jax.distributed.

coordinator  process 0: hosts the coordination service and the authority (PS: the server), owns the
           run's records, computes no gradient (worker w is process w + 1)
authority  the online Group Generator: the coordinator's authority, per-worker queues in the
           coordination service (schedule/online.py is the protocol, shared with the simulator)
preduce    P-Reduce between processes: one cached program per member set, or pairwise exchanges
           (at most n-1 programs per worker)
membership elastic membership (runtime.elastic): deaths and stalls become membership entries in the
           global order, restarted workers rejoin with weight 0 under fresh connection keys
process    the life-cycle every process of the runtime shares: start barrier and clock, heartbeats and
           the watchdog (distributed/watchdog.py), ask_back, end of run and result, snapshot paths
worker     one process's Ripples worker loop, marker checkpoints (per worker, no barrier), eval snapshots
adpsgd     AD-PSGD: active workers average with a random passive one while computing (Lian et al.'s
           order), served concurrently
ps         parameter servers (ps_sync, ps_async): the coordinator serves pushes and pulls
summary    throughput, time split and accuracy over wall-clock time, from the run's files
trace      per-worker event traces and their Gantt chart
replay     the recorded event order through the single-process engine (what the runtime computed)
The launcher (distributed/launcher.py) starts N local workers and the coordinator on 127.0.0.1 with
prefixed logs, fail-fast: it names the first failing process, SIGTERMs the others (process 0 last) and
SIGKILLs them after a grace period.
"""
