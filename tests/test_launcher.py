"""The local launcher and the workers' stop paths: a failing worker is named and the rest stopped (process
0 last), signals to the launcher or to a worker, no process left behind (checked by PID), the
coordinator on loopback, a taken port as one line; bad launcher flags as one line (exit 2), too many
workers for the cores as one warning; every worker listener on loopback (gloo's too, also where the host
name resolves to a network address); the cause named: a stalled worker rather than the peers that gave
up on it, an unknown process registering at the coordinator rather than worker 0.

`python -m tests.test_launcher --process_id=I --fake=...` is a stand-in worker (no JAX), for the
launcher's own logic in a few seconds; the other multi-process tests run experiments.train for real.
"""

import argparse
import errno
import io
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from experiments.config_args import needs_coordinator
from ripples_jax.distributed import coord, launcher
from ripples_jax.distributed.launcher import describe, launch
from tests.fakes import FakeKV, exited

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE = "tests.test_launcher"


def real_args(workdir, n, steps=100000):
  return [
    f"--config=configs/default.py:executor=async,num_workers={n},algorithm=allreduce,model=mlp",
    "--config.runtime.step_time=0.05",
    f"--config.num_steps={steps}",
    f"--workdir={workdir}",
    "--config.runtime.heartbeat_timeout=5",
    "--config.runtime.checkpoint_every=0",
    "--config.log_every=1000",
    "--config.eval_every=100000",
  ]


def kill_all(pids):
  for p in pids:
    try:
      os.killpg(p, signal.SIGKILL)
    except ProcessLookupError:
      pass


class Out(io.TextIOBase):
  """The launcher's output (written by one thread per worker), with waits for a line."""

  def __init__(self):
    self.lines, self._cv = [], threading.Condition()

  def write(self, text):
    with self._cv:
      self.lines.extend(text.splitlines())
      self._cv.notify_all()
    return len(text)

  def text(self):
    with self._cv:
      return "\n".join(self.lines)

  def wait_for(self, pattern, timeout_s):
    deadline = time.monotonic() + timeout_s
    with self._cv:
      while not any(re.search(pattern, l) for l in self.lines):
        if not self._cv.wait(deadline - time.monotonic()) and time.monotonic() > deadline:
          pytest.fail(f"no line matching {pattern!r} in {timeout_s} s:\n" + "\n".join(self.lines[-40:]))
      return next(l for l in self.lines if re.search(pattern, l))


def launch_thread(n, args, timeout_s=60, **kwargs):
  """launch() in a thread: (out, pids, finish), finish() -> exit code; on timeout everything is killed
  by PID and the test fails."""
  out, pids, result, started = Out(), [], {}, threading.Event()

  def on_start(p):
    pids.extend(p)
    started.set()

  kwargs.setdefault("cwd", ROOT)
  kwargs.setdefault("coordinator", needs_coordinator(kwargs.get("module", "experiments.train"), args))
  t = threading.Thread(
    target=lambda: result.setdefault("code", launch(n, args, out=out, on_start=on_start, **kwargs)),
    daemon=True,
  )
  t.start()
  assert started.wait(30), out.text()
  deadline = time.monotonic() + timeout_s

  def finish():
    t.join(max(0.0, deadline - time.monotonic()))
    if t.is_alive():
      kill_all(pids)
      pytest.fail(f"launch did not finish in {timeout_s} s:\n{out.text()[-3000:]}")
    return result["code"]

  return out, pids, finish


def cli(n, args, grace_s=5, extra=(), prefix=()):
  """experiments.launch as a subprocess (run by the command `prefix`, if any): (process, pids, coordinator
  port) once it has reported its workers."""
  proc = subprocess.Popen(
    [
      *prefix,
      sys.executable,
      "-m",
      "experiments.launch",
      f"--num_processes={n}",
      f"--grace_s={grace_s}",
      *extra,
      "--",
      *args,
    ],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  for line in proc.stdout:
    if "pids [" in line:
      return proc, json.loads(line.split("pids ")[1]), int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
  proc.kill()
  pytest.fail(f"the launcher did not report its workers: exit code {proc.wait()}")


def read_until(proc, pattern, timeout_s):
  """Lines of proc.stdout up to the first matching `pattern` (fails after timeout_s)."""
  seen, deadline = [], time.monotonic() + timeout_s
  timer = threading.Timer(timeout_s, proc.kill)
  timer.start()
  try:
    for line in proc.stdout:
      seen.append(line)
      if re.search(pattern, line):
        return seen
      if time.monotonic() > deadline:
        break
  finally:
    timer.cancel()
  pytest.fail(f"no line matching {pattern!r} in {timeout_s} s:\n" + "".join(seen[-40:]))


# -- the stand-in worker ----------------------------------------------------------------------------


def fake_worker(argv):
  """--fake=I:ACTION,...  ACTION: exit:CODE:SECONDS, ignore (SIGTERM), default: wait for SIGTERM."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--process_id", type=int)
  parser.add_argument("--fake", default="")
  parser.add_argument("--gloo_lines", type=int, default=0)  # lines as gloo prints them per connection
  a, _ = parser.parse_known_args(argv)
  for k in range(a.gloo_lines):
    print(
      f"[Gloo] Rank {a.process_id} is connected to 1 peer ranks. Expected number of connected peer ranks is : {k}"
    )
  plan = dict(item.split(":", 1) for item in a.fake.split(",") if item)
  action = plan.get(str(a.process_id), "wait")
  if action == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  else:  # the workers' own SIGTERM path (and the launcher's death as a SIGTERM)

    def say(line):  # the launcher may be gone (SIGKILL): its end of the pipe is closed
      try:
        print(line, flush=True)
      except OSError:
        pass

    def exit_fn(code):
      if a.process_id:  # a peer takes a while: process 0 must still go after it
        time.sleep(0.5)
      say(f"fake {a.process_id} exits at {time.time():.3f}")
      os._exit(code)

    coord.SigtermStop(a.process_id, lambda m: say(f"{m} at {time.time():.3f}"), exit_fn).install()
  print(f"fake {a.process_id} ready", flush=True)
  if action.startswith("exit:"):
    _, code, seconds = action.split(":")
    time.sleep(float(seconds))
    sys.exit(int(code))
  while True:
    time.sleep(0.1)


def stop_time(out: str, worker: int) -> float:
  return float(re.search(rf"worker {worker}: received SIGTERM.* at ([0-9.]+)", out).group(1))


def exit_time(out: str, worker: int) -> float:
  return float(re.search(rf"fake {worker} exits at ([0-9.]+)", out).group(1))


# -- fast: pieces -----------------------------------------------------------------------------------


def test_launch_rejects_fewer_than_one_process():
  with pytest.raises(ValueError, match="at least 1 process"):
    launch(0, [])


def test_launch_refuses_a_taken_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    with pytest.raises(ValueError, match="is taken"):
      launch(1, [], port=s.getsockname()[1])


def test_bind_address_follows_the_coordinator_address():
  assert coord.bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
  assert coord.bind_address("localhost:1234") == "127.0.0.1:1234"
  assert coord.bind_address("[::1]:1234") == "[::1]:1234"
  assert coord.bind_address("10.0.0.7:1234") == "10.0.0.7:1234"
  assert coord.bind_address("node-017:1234") is None  # a host name: JAX's default, every interface


def test_port_problem_names_a_taken_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    assert coord.port_problem(f"127.0.0.1:{port}") == errno.EADDRINUSE
    assert coord.port_problem(f"[::]:{port}") == errno.EADDRINUSE  # every interface includes it
  assert coord.port_problem(f"127.0.0.1:{port}") is None
  assert coord.port_problem(f"192.0.2.1:{port}") == errno.EADDRNOTAVAIL  # not this host's address


def test_describe_exit_codes():
  assert describe(-9) == "-9 (SIGKILL)"
  assert describe(coord.EXIT_LOST) == "75 (it lost a peer)"
  assert describe(coord.EXIT_TERM) == "143 (it was stopped by SIGTERM)"
  assert describe(1) == "1"


BAD_ARGUMENTS = [
  (dict(cpu_devices=0), "--cpu_devices=0 is not allowed: at least 1 CPU device per process"),
  (dict(cpu_devices=-2), "--cpu_devices=-2 is not allowed: at least 1 CPU device per process"),
  (dict(port=70000), "--port=70000 is not allowed: 0 (a free one) or 1..65535"),
  (dict(port=-1), "--port=-1 is not allowed: 0 (a free one) or 1..65535"),
  (dict(grace_s=float("nan")), "--grace_s=nan is not allowed: a finite number of seconds >= 0"),
  (dict(grace_s=float("inf")), "--grace_s=inf is not allowed: a finite number of seconds >= 0"),
  (dict(grace_s=-1.0), "--grace_s=-1.0 is not allowed: a finite number of seconds >= 0"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS, ids=[m.split(" ")[0] for _, m in BAD_ARGUMENTS])
def test_launch_refuses_arguments_that_cannot_run(kwargs, message):
  with pytest.raises(ValueError) as e:
    launch(2, [], **kwargs)
  assert str(e.value) == message


def test_a_privileged_port_is_refused_with_its_real_cause(monkeypatch):
  # As root every port binds; a non-root user gets EACCES below 1024, which is not "taken".
  monkeypatch.setattr(coord, "port_problem", lambda bind: errno.EACCES)
  with pytest.raises(ValueError) as e:
    launch(1, [], port=1)
  assert str(e.value) == (
    "--port=1 is not allowed: 127.0.0.1:1 cannot be bound: Permission denied (a privileged "
    "port: it needs root or CAP_NET_BIND_SERVICE); pick another, or 0 for a free one"
  )
  monkeypatch.setattr(coord, "port_problem", lambda bind: errno.EADDRNOTAVAIL)
  with pytest.raises(ValueError, match=r"127\.0\.0\.1:1 cannot be bound: Cannot assign requested address;"):
    launch(1, [], port=1)


def test_gloo_binds_loopback_exactly_when_the_coordinator_is_loopback():
  assert coord.collectives_host("127.0.0.1:1234") == "127.0.0.1"
  assert coord.collectives_host("localhost:1234") == "127.0.0.1"
  assert coord.collectives_host("[::1]:1234") == "::1"
  assert coord.collectives_host("127.0.1.1:1234") == "127.0.1.1"  # Debian's own-name address: loopback too
  assert coord.collectives_host("10.0.0.7:1234") is None  # a cluster: JAX's default, reachable by the others
  assert coord.collectives_host("node-017:1234") is None


def test_a_node_address_decides_where_gloo_binds(monkeypatch):
  """A node launcher's --node_address reaches its workers (start_worker's env) and wins over the
  coordinator's rule; without it the rule stands."""
  from ripples_jax.distributed import addresses
  from ripples_jax.distributed.launcher import child_env

  monkeypatch.setenv(addresses.COLLECTIVES_HOST_ENV, "127.0.0.2")
  assert coord.collectives_host("127.0.0.1:1234") == "127.0.0.2"
  assert coord.collectives_host("10.0.0.7:1234") == "127.0.0.2"
  monkeypatch.delenv(addresses.COLLECTIVES_HOST_ENV)
  assert addresses.COLLECTIVES_HOST_ENV not in child_env(1, "cpu")
  assert coord.collectives_host("127.0.0.1:1234") == "127.0.0.1"


def test_node_roles_number_every_process_of_the_job_once():
  """Two nodes of 3 workers each, with a coordinator: node 0 starts the coordinator (process 0) and
  workers 0..2 (processes 1..3), node 1 workers 3..5 (processes 4..6); each names and finds only its
  own. Without a coordinator, node 1's processes are 3..5 and are workers 3..5."""
  from ripples_jax.distributed.launcher import Node, Roles

  head, other = (Roles(3, True, Node(2, r, "127.0.0.1:9")) for r in (0, 1))
  assert head.total == other.total == 7 and (head.local, other.local) == (4, 3)
  assert [head.process_id(i) for i in range(4)] == [0, 1, 2, 3]
  assert [other.process_id(i) for i in range(3)] == [4, 5, 6]
  assert [head.name(i) for i in range(4)] == ["coordinator", "worker 0", "worker 1", "worker 2"]
  assert [other.prefix(i) for i in range(3)] == ["[w3]", "[w4]", "[w5]"]
  assert [other.local_worker(i) for i in range(3)] == [0, 1, 2]  # its GPUs
  assert [head.local_worker(i) for i in range(1, 4)] == [0, 1, 2]
  assert [other.process(w) for w in (2, 3, 5, 6, coord.COORDINATOR)] == [None, 0, 2, None, None]
  assert head.process(coord.COORDINATOR) == 0 and head.process(3) is None
  assert other.codes([0, 0, 75]) == "workers 3..5: [0, 0, 75]"
  plain = Roles(3, False, Node(2, 1, "127.0.0.1:9"))
  assert plain.total == 6 and [plain.process_id(i) for i in range(3)] == [3, 4, 5]
  assert [plain.worker(i) for i in range(3)] == [3, 4, 5]
  assert Roles(2, True).codes([0, 0, 0]) == "coordinator 0, workers [0, 0]"  # one node: as before


@pytest.mark.parametrize(
  "node,message",
  [
    ((0, 0, ""), "--nnodes=0 is not allowed: at least 1 node"),
    ((2, 2, "127.0.0.1:9"), "--node_rank=2 is not allowed: 0..1 (--nnodes=2)"),
    ((2, 1, ""), "--nnodes=2 needs --coordinator_address=HOST:PORT"),
    ((2, 1, "head"), "--coordinator_address=head is not allowed: HOST:PORT"),
    ((2, 1, "head:0"), "--coordinator_address=head:0 is not allowed: a port in 1..65535"),
  ],
)
def test_a_node_that_cannot_run_is_one_line_before_anything_starts(node, message):
  from ripples_jax.distributed.launcher import Node, launch

  with pytest.raises(ValueError) as e:
    launch(1, [], node=Node(*node))
  assert str(e.value).startswith(message), str(e.value)
  with pytest.raises(ValueError, match="--port=5 is not allowed with --coordinator_address"):
    launch(1, [], port=5, node=Node(2, 1, "head:9"))


@pytest.mark.parametrize(
  "address,process_id", [("127.0.0.1:1234", 0), ("10.0.0.7:1234", 0), ("10.0.0.7:1234", 1)]
)
def test_place_collectives_binds_loopback_or_names_the_address(monkeypatch, address, process_id):
  from absl import logging
  from jax._src import distributed

  from ripples_jax.distributed import host as platform

  bound, said = [], []
  monkeypatch.setattr(distributed.global_state, "coordinator_address", address)
  monkeypatch.setattr(distributed.global_state, "process_id", process_id)
  monkeypatch.setattr(platform, "bind_collectives", bound.append)
  monkeypatch.setattr(logging, "info", lambda msg, *args: said.append(msg % args))
  platform.place_collectives()
  if address.startswith("127."):
    assert bound == ["127.0.0.1"] and said == []
  else:  # a cluster: unchanged, and process 0 says where gloo listens, once
    assert bound == []
    assert len(said) == (process_id == 0)
    assert all(f"listens on {platform.default_collectives_address()}," in s for s in said), said


def beat(dogs, now):
  for d in dogs:
    d.check(now)


def test_the_watchdogs_lines_name_the_lost_worker():
  """Real exit lines of coord.Watchdog (the launcher reads them), on a clock of their own."""
  kv, logs, exits = FakeKV(), [], []
  dogs = [
    coord.Watchdog(kv, w, 3, lambda w=w: (w, 1, False), 1.0, 5.0, 1000.0, logs.append, exits.append)
    for w in range(3)
  ]
  beat(dogs, 1.0)
  beat(dogs, 1.5)  # everybody has seen everybody
  beat([dogs[0]], 6.0)  # worker 1 stopped beating at 1.5
  beat([dogs[2]], 7.0)
  assert exits == [coord.EXIT_LOST] and coord.lost_named(logs[0]) == [1], logs
  kv, logs = FakeKV(), []
  dogs = [
    coord.Watchdog(kv, w, 2, lambda: (5, 1, False), 1.0, 1000.0, 30.0, logs.append, exits.append)
    for w in range(2)
  ]
  beat(dogs, 1.0)
  beat([dogs[1]], 40.0)  # heartbeats go on, nobody completes anything
  assert "stalled first" in logs[0] and coord.lost_named(logs[0]) == [0], logs
  assert coord.lost_named("worker 1: received SIGTERM (stopped by the launcher); last completed step") == []


# What the workers printed when a third process registered at the coordinator as task 1 (jax 0.10.2).
INTRUDER_LINES = [
  "E1201 08:27:25.767973    7131 coordination_service.cc:518] [9396492722223678445] 1 unexpectedly tried to "
  "connect with a different incarnation. It has likely restarted.",
  "F1201 08:27:25.769545    7220 client.h:80] Terminating process because the JAX distributed service detected "
  "fatal errors. This most likely indicates that another task died; see the other task logs for more details. "
  "Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: ABORTED: "
  "1 unexpectedly tried to connect with a different incarnation. It has likely restarted.",
]


def test_an_unknown_registration_is_read_from_the_coordination_service_error():
  assert [coord.intruder_task(line) for line in INTRUDER_LINES] == [1, 1]
  assert (
    coord.intruder_task("F1201 client.h:80] Terminating process ... absl::Status: DEADLINE_EXCEEDED") is None
  )


class _Proc:
  def __init__(self, code=None):
    self.returncode = code

  def poll(self):
    return self.returncode


def test_the_failure_line_names_the_cause_the_workers_printed():
  from ripples_jax.distributed.launcher import _Clues, failure_line

  procs = [_Proc(coord.EXIT_LOST), _Proc(None), _Proc(coord.EXIT_LOST)]
  clues = _Clues()
  clues.read(2, "worker 2: worker(s) [1] lost: no heartbeat for 5 s; last completed step per worker: w0:3")
  assert failure_line((2, coord.EXIT_LOST), procs, clues, "127.0.0.1:5") == (
    "worker 1 (still running: stalled) is lost: worker 2's watchdog named it, then worker 2 exited with 75 "
    "(it lost a peer)"
  )
  assert failure_line((2, 1), procs, clues, "127.0.0.1:5") == "worker 2 exited with 1"  # a crash: itself
  for line in INTRUDER_LINES:
    clues.read(0, line)
  assert failure_line((0, -6), procs, clues, "127.0.0.1:5").startswith(
    "an unknown process registered at the coordinator 127.0.0.1:5 as task 1 (not a worker of this launcher"
  )


def test_with_a_coordinator_the_lines_name_workers_by_their_index_not_their_process():
  """An async run: process 0 is the coordinator, process i worker i - 1. Its watchdog beats nothing,
  watches every worker and names them; a worker that loses the coordinator's service names it."""
  from ripples_jax.distributed.launcher import Roles, _Clues, failure_line

  kv, logs, exits = FakeKV(), [], []
  dogs = [
    coord.Watchdog(kv, w, 2, lambda w=w: (w, 1, False), 1.0, 5.0, 1000.0, logs.append, exits.append)
    for w in range(2)
  ]
  boss = coord.Watchdog(kv, None, 2, lambda: (0, 0, False), 1.0, 5.0, 1000.0, logs.append, exits.append)
  beat([*dogs, boss], 1.0)
  beat([dogs[0], boss], 1.5)
  beat([boss], 6.2)  # worker 1 stopped beating at 1.0 (worker 0 at 1.5: still within 5 s)
  assert exits == [coord.EXIT_LOST] and logs[0].startswith("coordinator: worker(s) [1] lost"), logs
  assert "hb/None" not in str(kv.store) and coord.lost_named(logs[0]) == [1]
  lost_service = (
    "worker 0: lost contact with the coordination service (hosted by the coordinator's process): gone; "
    "last completed step per worker: w0:1 w1:1; exiting"
  )
  assert coord.lost_named(lost_service) == [coord.COORDINATOR]
  roles = Roles(2, coordinator=True)
  assert [roles.name(i) for i in range(3)] == ["coordinator", "worker 0", "worker 1"]
  assert [roles.prefix(i) for i in range(3)] == ["[c]", "[w0]", "[w1]"]
  procs = [_Proc(coord.EXIT_LOST), _Proc(coord.EXIT_LOST), _Proc(None)]
  clues = _Clues()
  clues.read(0, logs[0])
  assert failure_line((0, coord.EXIT_LOST), procs, clues, "127.0.0.1:5", roles) == (
    "worker 1 (still running: stalled) is lost: coordinator's watchdog named it, then coordinator "
    "exited with 75 (it lost a peer)"
  )
  clues.read(1, lost_service)
  procs[0] = _Proc(-9)
  assert failure_line((1, coord.EXIT_LOST), procs, clues, "127.0.0.1:5", roles) == (
    "coordinator (exited with -9 (SIGKILL)) is lost: worker 0's watchdog named it, then worker 0 "
    "exited with 75 (it lost a peer)"
  )
  assert roles.codes([0, 143, -9]) == "coordinator 0, workers [143, -9]"


def test_sigterm_stops_a_worker_once_with_one_line():
  logs, exits = [], []
  stop = coord.SigtermStop(1, logs.append, exits.append)
  stop.stop("received SIGTERM")
  stop.stop("received SIGTERM")
  assert exits == [coord.EXIT_TERM] and len(logs) == 1 and "worker 1: received SIGTERM" in logs[0]
  assert "during start-up" in logs[0]
  # Once the watchdog runs: its path, with every worker's last completed step.
  kv, logs, exits = FakeKV(), [], []
  dogs = [
    coord.Watchdog(kv, w, 2, lambda w=w: (7 + w, 3, False), 1.0, 5.0, 30.0, logs.append, exits.append)
    for w in range(2)
  ]
  for d in dogs:
    d.check(1.0)
  stop = coord.SigtermStop(1, logs.append, exits.append)
  stop.watchdog = dogs[1]
  stop.stop("received SIGTERM")
  dogs[1].check(100.0)  # the watchdog would now name worker 0 as lost: it has already exited
  assert exits == [coord.EXIT_TERM] and len(logs) == 1
  assert "worker 1: received SIGTERM" in logs[0] and "last completed step per worker: w0:7 w1:8" in logs[0]


# -- the launcher's logic, with stand-in workers ----------------------------------------------------


@pytest.mark.slow
def test_the_first_failing_worker_is_named_and_the_others_stopped_process_0_last():
  out, pids, finish = launch_thread(3, ["--fake=2:exit:3:1.0"], module=FAKE, grace_s=10, timeout_s=30)
  t0 = time.monotonic()
  code = finish()
  text = out.text()
  assert code == 3, text
  assert time.monotonic() - t0 < 8, text  # 1 s, then the stop: not the 10 s grace period
  assert "[launch] worker 2 exited with 3; stopping the others" in text, text
  assert "exit codes: [143, 143, 3]" in text, text
  # Process 0 hosts the coordination service: it is stopped once its peers have gone.
  assert stop_time(text, 0) >= exit_time(text, 1) > stop_time(text, 1), text
  assert all(exited(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True])
def test_a_full_disk_restarts_nothing_and_ends_every_process_with_74(elastic):
  """A worker whose disk refused a write exits 74: with restarts to spare, neither the whole job
  (plain) nor the worker alone (elastic) is restarted; every process is stopped; the job ends 74 with
  the line that says what to do."""
  kw = dict(module=FAKE, grace_s=5, timeout_s=30, max_restarts=2)
  kw.update(elastic=True, coordinator=True) if elastic else None
  out, pids, finish = launch_thread(2, ["--fake=1:exit:74:1.0"], **kw)
  code = finish()
  text = out.text()
  assert code == coord.EXIT_STORAGE, text
  assert "restarting" not in text and "rejoins" not in text, text
  if elastic:
    assert "exited with 74 (the disk refused a write); stopping every process" in text, text
  assert "the disk refused a write: nothing restarted; free space" in text, text
  assert all(exited(p) for p in pids)
  assert not launcher.coordinator_died(coord.EXIT_STORAGE)


@pytest.mark.slow
@pytest.mark.nightly
def test_a_worker_that_ignores_sigterm_is_killed_at_the_end_of_the_grace_period():
  out, pids, finish = launch_thread(3, ["--fake=1:ignore,2:exit:1:0.5"], module=FAKE, grace_s=3, timeout_s=30)
  t0 = time.monotonic()
  code = finish()
  text = out.text()
  assert code == 1 and "exit codes: [143, -9, 1]" in text, text
  assert time.monotonic() - t0 < 0.5 + 3 + 2, text
  assert all(exited(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize(
  "sig",
  [
    signal.SIGTERM,
    pytest.param(signal.SIGHUP, marks=pytest.mark.nightly),
    pytest.param(signal.SIGINT, marks=pytest.mark.nightly),
  ],
  ids=lambda s: s.name,
)
def test_a_signal_to_the_launcher_stops_every_worker(sig):
  proc, pids, port = cli(3, ["--fake="], extra=[f"--module={FAKE}"])  # --module: any entry point
  try:
    read_until(proc, r"fake \d ready", 30)
    time.sleep(0.5)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
    kill_all(pids)
  assert proc.returncode == 128 + sig, rest
  assert f"[launch] received {signal.Signals(sig).name}; stopping the workers" in rest, rest
  assert all(exited(p) for p in pids), rest


@pytest.mark.slow
@pytest.mark.nightly
def test_workers_stop_when_the_launcher_is_killed():
  proc, pids, port = cli(2, ["--fake="], extra=[f"--module={FAKE}"])
  try:
    read_until(proc, r"fake \d ready", 30)
    read_until(proc, r"fake \d ready", 30)
    proc.kill()  # SIGKILL: no handler runs; the kernel sends each worker SIGTERM (PR_SET_PDEATHSIG)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(exited(p) for p in pids):
      time.sleep(0.1)
    assert all(exited(p) for p in pids), [p for p in pids if not exited(p)]
  finally:
    kill_all(pids)


@pytest.mark.slow
@pytest.mark.nightly
def test_more_workers_than_cores_is_one_warning_and_the_job_runs(monkeypatch):
  from ripples_jax.distributed import launcher

  args = ["--fake=0:exit:0:0,1:exit:0:0"]
  monkeypatch.setattr(launcher, "usable_cores", lambda: 1)
  out = Out()
  assert launch(2, args, module=FAKE, out=out, cwd=ROOT, grace_s=5) == 0, out.text()
  assert [l for l in out.lines if "warning" in l] == [
    "[launch] warning: --num_processes=2 exceeds the 1 CPU core this launcher may use: the workers share them "
    "(each runs slower); running anyway"
  ], out.text()
  assert "exit codes: [0, 0]" in out.text()
  monkeypatch.setattr(launcher, "usable_cores", lambda: 2)
  out = Out()
  assert launch(2, args, module=FAKE, out=out, cwd=ROOT, grace_s=5) == 0, out.text()
  assert not [l for l in out.lines if "warning" in l], out.text()


def test_each_workers_first_gloo_line_shows_and_the_rest_are_counted():
  from ripples_jax.distributed.launcher import _LibraryLines

  shown = _LibraryLines(verbose=False)
  lines = [(w, f"[Gloo] Rank {w} is connected to 1 peer ranks.\n") for _ in range(3) for w in (0, 1)]
  assert [shown.show(w, t) for w, t in lines] == [True, True, False, False, False, False]
  assert shown.hidden == 4 and shown.show(0, "step 10/100\n") and shown.show(1, "[w] [Gloo] quoted\n")
  loud = _LibraryLines(verbose=True)
  assert all(loud.show(w, t) for w, t in lines) and loud.hidden == 0


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("verbose", [False, True])
def test_gloo_connection_lines_are_hidden_unless_verbose_libraries(verbose):
  args = ["--fake=0:exit:0:0,1:exit:0:0", "--gloo_lines=5"] + (["--verbose_libraries"] if verbose else [])
  out = Out()
  assert launch(2, args, module=FAKE, out=out, cwd=ROOT, grace_s=5) == 0, out.text()
  gloo = [l for l in out.lines if "[Gloo]" in l]
  hidden = [l for l in out.lines if "gloo connection lines hidden" in l]
  if verbose:
    assert len(gloo) == 10 and not hidden, out.text()
  else:
    assert sorted(l.split()[0] for l in gloo) == ["[w0]", "[w1]"] and all(
      "peer ranks is : 0" in l for l in gloo
    )
    assert hidden == ["[launch] 8 more gloo connection lines hidden (--verbose_libraries shows them)"]


OWN_FLAGS = "--num_processes, --cpu_devices, --platform, --grace_s, --module, --port, --max_restarts"
LAUNCHER_BAD_FLAGS = [
  ("--num_processes=abc", "--num_processes=abc is not allowed: an integer"),
  ("--grace_s=x", "--grace_s=x is not allowed: a number"),
  ("--grace_s=nan", "--grace_s=nan is not allowed: a finite number of seconds >= 0"),
  ("--grace_s=-1", "--grace_s=-1.0 is not allowed: a finite number of seconds >= 0"),
  ("--port=70000", "--port=70000 is not allowed: 0 (a free one) or 1..65535"),
  ("--port=-1", "--port=-1 is not allowed: 0 (a free one) or 1..65535"),
  ("--cpu_devices=0", "--cpu_devices=0 is not allowed: at least 1 CPU device per process"),
  ("--cpu_devices=-2", "--cpu_devices=-2 is not allowed: at least 1 CPU device per process"),
  (
    "--config=configs/default.py",  # the entry point's flag before --
    f"Unknown command line flag 'config' (the launcher's flags: {OWN_FLAGS}; the entry point's go after --)",
  ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
  "flag,message",
  [pytest.param(*c, marks=() if k == 0 else pytest.mark.nightly) for k, c in enumerate(LAUNCHER_BAD_FLAGS)],
  ids=[f for f, _ in LAUNCHER_BAD_FLAGS],
)
def test_launcher_bad_flags_are_one_line_and_exit_2(flag, message):
  r = subprocess.run(
    [sys.executable, "-m", "experiments.launch", flag, "--", "--x"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert r.returncode == 2 and r.stdout == "", r
  assert r.stderr.splitlines() == [f"error: {message}"]


@pytest.mark.slow
@pytest.mark.nightly
def test_launcher_help_still_prints_the_flags():
  r = subprocess.run(
    [sys.executable, "-m", "experiments.launch", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert "--num_processes: Worker processes to start." in r.stdout and "error:" not in r.stderr, r
  assert r.returncode == 0, r


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize(
  "module,config", [("experiments.train", "configs/default.py"), ("experiments.train_dsp", "configs/dsp.py")]
)
def test_entry_point_help_lists_its_flags_and_every_config_field(module, config):
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      module,
      "--help",
      "--config.num_steps=7" if "dsp" not in module else "--config.delay=2",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0 and "error:" not in r.stderr, r
  assert "--workdir: Output folder" in r.stdout and "--jax_distributed: " in r.stdout, r.stdout
  assert f"(default: {config})" in r.stdout
  # Every field, with the value this command line gives it.
  # ... and what the validator allows (config_doc), after it.
  want = (
    "--config.num_steps=7  (a positive integer)"
    if "dsp" not in module
    else "--config.delay=2  (an integer number of ticks in [0, 64])"
  )
  assert f"  {want}" in r.stdout.splitlines(), r.stdout
  assert "  --config.optimizer.lr=" in r.stdout


@pytest.mark.slow
@pytest.mark.nightly
def test_launcher_rejects_zero_processes_with_one_line():
  r = subprocess.run(
    [sys.executable, "-m", "experiments.launch", "--num_processes=0", "--", "--x"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert r.returncode == 2 and r.stdout == "", r
  assert r.stderr.splitlines() == ["error: --num_processes=0 is not allowed: at least 1 process is needed"]


# -- real workers -----------------------------------------------------------------------------------


def listening_sockets() -> list:
  """(address, port, inode) of every listening TCP socket, from /proc/net/tcp and tcp6."""
  got = []
  for path in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
      rows = open(path).read().splitlines()[1:]
    except FileNotFoundError:
      continue
    for row in rows:
      fields = row.split()
      host, p = fields[1].split(":")
      if fields[3] == "0A":  # 0A: LISTEN
        raw = bytes.fromhex(host)  # 32-bit words in host byte order
        words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
        ip = ipaddress.ip_address(b"".join(w[::-1] if sys.byteorder == "little" else w for w in words))
        got.append((ip, int(p, 16), fields[9]))
  return got


def listening(port: int) -> list:
  """The addresses a socket listens on at `port`."""
  return [ip for ip, p, _ in listening_sockets() if p == port]


def listeners_of(pid: int) -> list:
  """(address, port) of every listening TCP socket process `pid` holds (its fds' socket inodes)."""
  inodes = set()
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:  # closed meanwhile
      continue
    if link.startswith("socket:["):
      inodes.add(link[len("socket:[") : -1])
  return [(ip, p) for ip, p, inode in listening_sockets() if inode in inodes]


def is_loopback(ip) -> bool:
  return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.slow
@pytest.mark.nightly
def test_worker_lost_during_start_up_is_named(tmp_path):
  """Worker 1 is killed once jax.distributed has connected, before any heartbeat: worker 0 would wait
  for it (topology exchange, first collective); the launcher names worker 1 and stops worker 0 and
  the coordinator (process 0: pids[0]; worker w is pids[w + 1])."""
  out, pids, finish = launch_thread(2, real_args(tmp_path / "run", 2), grace_s=10, timeout_s=90)
  try:
    out.wait_for(r"^\[w1\] \[Gloo\] Rank 1 is connected", 60)  # printed (C++) once connected
    os.kill(pids[1 + 1], signal.SIGKILL)
    killed = time.monotonic()
    named = out.wait_for(r"^\[launch\] worker \d exited", 60)
    assert time.monotonic() - killed < 60
    code = finish()
  finally:
    kill_all(pids)
  text = out.text()
  assert named.startswith("[launch] worker 1 exited with -9 (SIGKILL); stopping the others"), text
  # Worker 0 stops on the launcher's SIGTERM: with one line (143) once in the worker loop's set-up,
  # by the signal's default action (-15) before it.
  assert code == 128 + signal.SIGKILL, text
  assert re.search(r"exit codes: coordinator (143|-15), workers \[(143|-15), -9\]", text), text
  assert all(exited(p) for p in pids)


@pytest.mark.slow
def test_sigterm_to_the_launcher_leaves_no_worker_and_the_coordinator_is_on_loopback(tmp_path):
  proc, pids, port = cli(2, real_args(tmp_path / "run", 2))
  try:
    read_until(proc, r"\[Gloo\]", 90)  # the workers are in their first collective
    addresses = listening(port)
    time.sleep(2)  # past the start barrier: in the worker loop
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
    kill_all(pids)
  assert addresses and all(is_loopback(a) for a in addresses), (port, addresses)
  assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
  stopped = [l for l in rest.splitlines() if "received SIGTERM (stopped by the launcher" in l]
  assert len(stopped) == 3 and "exit codes: coordinator 143, workers [143, 143]" in rest, rest[-3000:]
  assert all(exited(p) for p in pids), rest[-3000:]


def network_address():
  """An IPv4 address of this host that is not loopback (its default route's source), or None."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect(("198.51.100.1", 9))  # TEST-NET-2; nothing is sent: the route picks the source address
    except OSError:
      return None
    ip = s.getsockname()[0]
  return None if ipaddress.ip_address(ip).is_loopback else ip


def renamed_host(name):
  """A command prefix running its command where this host's name is `name` (a UTS namespace of its own),
  or None where unshare cannot make one (no root, no user namespaces)."""
  for unshare in (["unshare", "--uts"], ["unshare", "--user", "--map-root-user", "--uts"]):
    prefix = [*unshare, "sh", "-c", 'hostname "$0" && exec "$@"', name]
    try:
      if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
        return prefix
    except (OSError, subprocess.SubprocessError):
      pass
  return None


@pytest.mark.slow
@pytest.mark.nightly
def test_no_worker_listens_off_loopback_where_the_host_name_resolves_to_a_network_address(tmp_path):
  """Every listener of the local launcher's workers is on loopback: the coordination service and gloo's
  (the CPU collectives), which JAX would put on what the host name resolves to, here a network address."""
  ip = network_address()
  prefix = renamed_host(ip) if ip else None
  if prefix is None:
    pytest.skip("needs a non-loopback address and unshare --uts (root or user namespaces)")
  where = subprocess.run(
    [
      *prefix,
      sys.executable,
      "-c",
      "from ripples_jax.distributed import host as platform; print(platform.default_collectives_address())",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert where.stdout.strip() == ip, where  # JAX's default: gloo on the network address
  proc, pids, port = cli(2, real_args(tmp_path / "run", 2), prefix=prefix)
  try:
    read_until(proc, r"\[Gloo\] Rank \d is connected", 90)  # both ranks listen, and have connected
    held = {pid: listeners_of(pid) for pid in pids}
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
    kill_all(pids)
  assert all(held.values()), held  # gloo's listener in each
  assert port in [p for _, p in held[pids[0]]], held  # the coordination service, in the coordinator
  assert all(is_loopback(a) for sockets in held.values() for a, _ in sockets), held
  assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]


@pytest.mark.slow
def test_a_stalled_worker_is_named_not_the_peers_that_gave_up_on_it(tmp_path):
  """Worker 1 is SIGSTOPped mid-run: its peers' watchdogs name it and exit with EXIT_LOST (75) while it
  still runs; the launcher's line names worker 1, not the first peer to exit."""
  out, pids, finish = launch_thread(3, real_args(tmp_path / "run", 3), grace_s=10, timeout_s=180)
  try:
    out.wait_for(r"\[Gloo\] Rank \d is connected", 120)
    time.sleep(3)  # past the start barrier: the watchdogs beat
    os.kill(pids[1 + 1], signal.SIGSTOP)  # worker 1 (pids[0] is the coordinator)
    code = finish()
  finally:
    for p in pids:
      try:
        os.kill(p, signal.SIGCONT)
      except ProcessLookupError:
        pass
    kill_all(pids)
  text = out.text()
  line = out.wait_for(r"^\[launch\] .*; stopping the others", 1)
  assert re.match(
    r"\[launch\] worker 1 \(still running: stalled\) is lost: worker ([02])'s watchdog named it, "
    r"then worker \1 exited with 75 \(it lost a peer\); stopping the others",
    line,
  ), text[-3000:]
  assert code == coord.EXIT_LOST, text[-3000:]
  assert all(exited(p) for p in pids)


# A process nobody started as a worker registers at the coordinator as task sys.argv[2].
INTRUDER = (
  "import sys\nfrom jax._src.lib import _jax\n"
  "_jax.get_distributed_runtime_client(sys.argv[1], int(sys.argv[2]), init_timeout=20).connect()\n"
)


@pytest.mark.slow
@pytest.mark.nightly
def test_an_unknown_process_registering_at_the_coordinator_is_named_not_worker_0(tmp_path):
  """Any local user can connect to the (unauthenticated) coordination service and register as one of the
  tasks; the service then aborts every worker, worker 0 among the first. The launcher's line says so."""
  out, pids, finish = launch_thread(2, real_args(tmp_path / "run", 2), grace_s=10, timeout_s=120)
  started = out.wait_for(r"^\[launch\] 2 workers and a coordinator on", 5)
  address = re.search(r" on (127\.0\.0\.1:\d+)", started).group(1)
  intruder = None
  try:
    out.wait_for(r"\[Gloo\] Rank \d is connected", 90)
    intruder = subprocess.Popen(
      [sys.executable, "-c", INTRUDER, address, "1"],
      cwd=ROOT,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      start_new_session=True,
    )
    code = finish()
  finally:
    if intruder is not None:
      intruder.kill()
      intruder.wait()
    kill_all(pids)
  line = out.wait_for(r"^\[launch\] .*; stopping the others", 1)
  assert line.startswith(
    f"[launch] an unknown process registered at the coordinator {address} as task 1 (not "
    f"a worker of this launcher"
  ), out.text()[-3000:]
  assert code != 0 and all(exited(p) for p in pids)


@pytest.mark.slow
@pytest.mark.nightly
def test_sigterm_to_a_worker_is_one_line_and_stops_the_job(tmp_path):
  out, pids, finish = launch_thread(2, real_args(tmp_path / "run", 2), grace_s=10, timeout_s=120)
  try:
    out.wait_for(r"\[Gloo\]", 90)
    time.sleep(2)  # past the start barrier: the watchdog beats
    os.kill(pids[1 + 1], signal.SIGTERM)  # worker 1
    code = finish()
  finally:
    kill_all(pids)
  text = out.text()
  line = [l for l in text.splitlines() if "worker 1: received SIGTERM" in l]
  assert len(line) == 1 and "last completed step per worker: w0:" in line[0], text[-3000:]
  assert "[launch] worker 1 exited with 143 (it was stopped by SIGTERM)" in text, text[-3000:]
  assert code == coord.EXIT_TERM and "exit codes: coordinator 143, workers [143, 143]" in text, text[-3000:]
  assert all(exited(p) for p in pids)


# Nightly (23 s): the launcher naming a lost worker stays in the README's tier; this is the path without it.
@pytest.mark.slow
@pytest.mark.nightly
def test_without_the_launcher_the_survivors_name_the_lost_worker(tmp_path):
  """As on a cluster (one process per host, nobody stopping the others): worker 2 dies mid-run; each
  survivor's watchdog names it within runtime.heartbeat_timeout (5 s), the coordinator (process 0)
  exiting last."""
  from ripples_jax.distributed.launcher import child_env, free_port

  n, port = 3, free_port()  # 3 workers: processes 1..3
  env = child_env(1, "cpu")
  del env[coord.LAUNCHER_PID_ENV]
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "experiments.train",
        "--jax_distributed",
        f"--coordinator_address=127.0.0.1:{port}",
        f"--num_processes={n + 1}",
        f"--process_id={i}",
        "--cpu_devices=1",
        *real_args(tmp_path / "run", n),
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
    )
    for i in range(n + 1)
  ]
  outs = [[] for _ in procs]
  readers = [
    threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout), daemon=True) for p, o in zip(procs, outs)
  ]
  for t in readers:
    t.start()
  try:
    deadline = time.monotonic() + 90
    while not any("[Gloo]" in l for l in outs[3]) and time.monotonic() < deadline:
      time.sleep(0.1)
    time.sleep(3)  # past the start barrier: the watchdogs beat
    procs[3].kill()  # worker 2
    killed = time.monotonic()
    codes = [p.wait(timeout=60) for p in procs]
    elapsed = time.monotonic() - killed
  finally:
    kill_all([p.pid for p in procs])
  for t in readers:
    t.join(5)
  text = ["".join(o) for o in outs]
  assert codes == [coord.EXIT_LOST] * 3 + [-9], (codes, text[0][-2000:], text[1][-2000:])
  assert elapsed < 30, elapsed
  for who, out in zip(("coordinator", "worker 0", "worker 1"), text):
    assert re.search(rf"{who}: worker\(s\) \[2\] lost: no heartbeat for 5 s; last completed step", out), out


@pytest.mark.slow
@pytest.mark.nightly
def test_a_taken_port_is_one_line_not_a_hang(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    # Process 0 (on a cluster, or a port taken after the launcher picked it).
    t0 = time.monotonic()
    r = subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.train",
        "--jax_distributed",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--process_id=0",
        "--cpu_devices=1",
        *real_args(tmp_path / "run", 2),
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert time.monotonic() - t0 < 30
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert errors == [
      f"error: coordinator port {port} (127.0.0.1:{port}) is not free: Address already in use; "
      "pick another port in --coordinator_address"
    ], r.stderr[-3000:]
    # The launcher, asked for that port: one line, nothing started.
    r = subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.launch",
        "--num_processes=2",
        f"--port={port}",
        "--",
        *real_args(tmp_path / "run", 2),
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=60,
    )
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [
      f"error: --port={port} is not allowed: 127.0.0.1:{port} is taken (a process "
      f"listens there); pick another, or 0 for a free one"
    ]


if __name__ == "__main__":
  fake_worker(sys.argv[1:])


def test_the_platform_is_detected_and_each_gpu_worker_gets_its_own_gpu(monkeypatch):
  from ripples_jax.distributed.launcher import child_env, resolve_platform

  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the launcher's own choice wins (conftest forces cpu)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
  assert resolve_platform("auto") == "cpu"
  monkeypatch.delenv("JAX_PLATFORMS")
  assert resolve_platform("auto") == "cuda"
  assert [child_env(1, "cuda", i)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["3", "5", "3"]
  assert child_env(1, "cuda", 1)["JAX_PLATFORMS"] == "cuda"
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
  assert resolve_platform("auto") == "cpu"
  assert resolve_platform("tpu") == "tpu"
  env = child_env(4, "cpu", 0)
  assert env["JAX_PLATFORMS"] == "cpu" and "--xla_force_host_platform_device_count=4" in env["XLA_FLAGS"]


def test_several_workers_on_one_gpu_and_elastic_on_gpus_are_refused_before_anything_starts(monkeypatch):
  from ripples_jax.distributed.launcher import check_platform, launch

  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
  check_platform(2, "cuda")
  check_platform(3, "cpu", elastic=True)
  with pytest.raises(ValueError) as e:
    launch(3, ["--x"], platform="cuda")  # refused before any process starts
  assert str(e.value).startswith("--num_processes=3 is not allowed on platform cuda: at most the 2 GPUs")
  assert "Duplicate GPU detected" in str(e.value)
  with pytest.raises(
    ValueError, match=r"^--config.runtime.elastic=True is not allowed on platform cuda: .*NCCL"
  ):
    launch(2, ["--x"], platform="cuda", elastic=True)


def test_an_entry_point_outside_a_checkout_is_the_shipped_one(monkeypatch):
  import importlib.util

  from ripples_jax.distributed import launcher as launcher_lib

  assert launcher_lib.resolve_module("experiments.train_dsp") == "experiments.train_dsp"  # a checkout
  # As installed: no top-level experiments package; ripples_jax.experiments ships the entry points.
  shipped = {"ripples_jax.experiments.train_dsp"}
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in shipped else None)
  assert launcher_lib.resolve_module("experiments.train_dsp") == "ripples_jax.experiments.train_dsp"
  assert launcher_lib.resolve_module("my_project.train") == "my_project.train"


def test_tuned_malloc_reaches_the_children_and_a_bad_value_is_one_line(monkeypatch):
  """--malloc=tuned: every child starts with ripples_jax.allocator's tunables (glibc reads them at
  process start only), kept after the caller's own; default: the caller's environment as it is."""
  from ripples_jax import allocator
  from ripples_jax.distributed.launcher import child_env, launch

  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
  tuned, plain = child_env(1, "cpu", malloc="tuned"), child_env(1, "cpu")
  assert allocator.tuned(tuned) and tuned["GLIBC_TUNABLES"].startswith("glibc.malloc.tcache_count=0:")
  assert not allocator.tuned(plain) and plain["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
  with pytest.raises(ValueError, match=r"^--malloc=jemalloc is not allowed: one of default, tuned$"):
    launch(1, [], malloc="jemalloc")
