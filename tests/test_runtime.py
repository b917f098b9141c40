"""The asynchronous multi-process runtime: watchdog, trace merge, and real 2- and 4-process runs."""

import io
import json
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from configs import default as default_config
from experiments.config_args import needs_coordinator, runs_elastic
from ripples_jax import timeline
from ripples_jax.distributed import coord
from ripples_jax.distributed.launcher import launch
from ripples_jax.runtime import trace as trace_lib
from ripples_jax.runtime.replay import merged_events, replay
from tests.fakes import FakeKV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The real runs train an MLP with GELU: along a smooth trajectory the runtime's and the engine's rounding
# differences stay ~1e-7, while with ReLU one pre-activation that sits within rounding of 0 flips the
# kink in one of them and momentum amplifies the ~1e-4 jump to ~1e-2 by the end (WORKSPACE.md, "replay").
MODEL = "mlp_gelu"


def make_config(algorithm, n=4, steps=40, model="mlp", **overrides):
  config = default_config.get_config(f"algorithm={algorithm},executor=async,num_workers={n},model={model}")
  config.num_steps = steps
  config.schedule.group_size = min(3, n)
  config.update_from_flattened_dict(overrides)
  return config


# -- watchdog ---------------------------------------------------------------------------------------


def test_watchdog_names_the_silent_worker_and_the_last_steps():
  kv, logs, exits = FakeKV(), [], []
  dogs = [
    coord.Watchdog(kv, w, 3, lambda w=w: (10 + w, 5, False), 1.0, 5.0, 30.0, logs.append, exits.append)
    for w in range(3)
  ]
  for t in range(4):
    for d in dogs:
      d.check(100.0 + t)
  assert not exits
  for t in range(4, 12):  # worker 2 stops beating
    for d in dogs[:2]:
      d.check(100.0 + t)
  assert exits == [coord.EXIT_LOST, coord.EXIT_LOST]
  assert "worker(s) [2] lost" in logs[0] and "w0:10 w1:11 w2:12" in logs[0]


def test_watchdog_reports_a_run_where_nothing_moves():
  kv, logs, exits = FakeKV(), [], []
  dogs = [
    coord.Watchdog(kv, w, 2, lambda: (3, 7, False), 1.0, 5.0, 8.0, logs.append, exits.append)
    for w in range(2)
  ]
  for t in range(12):  # beating, but no worker completes anything
    for d in dogs:
      d.check(float(t))
  assert exits and "no progress for 8 s" in logs[0]


def test_watchdog_counts_the_last_worker_finishing_as_progress():
  """DiLoCo behind a straggler: the fast workers wait 128 s in the outer all-reduce while the slow one
  steps; it joins, finishes and beats `done` a beat before the others' beats show them out of the
  collective. That finish is progress: nobody is reported stalled until stall_timeout after it."""
  kv, logs, exits = FakeKV(), [], []
  state = {0: [64, 1, False], 1: [64, 1, False], 2: [0, 0, False]}
  dogs = [
    coord.Watchdog(kv, w, 3, lambda w=w: tuple(state[w]), 1.0, 5.0, 40.0, logs.append, exits.append)
    for w in range(3)
  ]
  for t in range(160):  # workers 0 and 1 blocked in the collective; worker 2 steps
    state[2][:2] = [t // 2, t // 2]
    for d in dogs:
      d.check(float(t))
  state[2][2] = True  # worker 2 done (beating at the end barrier); 0 and 1 still show the collective
  for t in range(160, 199):
    for d in dogs:
      d.check(float(t))
  assert not exits
  for t in range(199, 203):  # nothing moves 40 s after the last finish: stalled
    for d in dogs:
      d.check(float(t))
  assert exits and "no progress for 40 s" in logs[0]


# -- trace merge ----------------------------------------------------------------------------------


def test_merged_events_respect_each_worker_and_the_group_order():
  step = lambda b, s: {"k": "step", "c": b, "s": s, "t0": 0, "t1": 1, "loss": 0.0}
  group = lambda b, g, m: {"k": "group", "c": b, "g": g, "m": m, "t0": 1, "t1": 2}
  traces = {
    0: [step(0, 0), group(0, 0, [0, 1]), step(0, 1), group(0, 1, [0, 2])],
    1: [step(0, 0), step(0, 1), group(0, 0, [0, 1])],
    2: [step(0, 0), group(0, 1, [0, 2]), step(0, 1)],
  }
  events = merged_events(traces, 3)
  kinds = [(k, a) for _, k, a, _ in events]
  avg01, avg02 = kinds.index((timeline.AVG, (0, 1))), kinds.index((timeline.AVG, (0, 2)))
  assert avg01 < avg02
  assert sum(k == (timeline.APPLY, 1) for k in kinds[:avg01]) == 2  # both of worker 1's steps first
  assert sum(k == (timeline.APPLY, 0) for k in kinds[:avg02]) == 2
  assert sum(k == (timeline.APPLY, 2) for k in kinds[avg02:]) == 1
  broken = {0: traces[0], 1: traces[1], 2: [step(0, 0), group(0, 0, [0, 2])]}
  with pytest.raises(ValueError, match="one global order"):
    merged_events({**broken, 0: [step(0, 0), group(0, 1, [0, 2]), group(0, 0, [0, 1])]}, 3)


def test_trace_intervals_split_wait_from_comm():
  traces = {
    0: [{"k": "group", "c": 0, "g": 0, "m": [0, 1], "t0": 1.0, "t1": 3.5}],
    1: [{"k": "group", "c": 0, "g": 0, "m": [0, 1], "t0": 3.0, "t1": 3.5}],
  }
  got = sorted(trace_lib.intervals(traces))
  assert got == [(0, "comm", 3.0, 3.5), (0, "wait", 1.0, 3.0), (1, "comm", 3.0, 3.5)]


def test_a_write_through_trace_keeps_every_event_two_threads_add(tmp_path):
  """AD-PSGD's passive side adds its averages from its serving thread while the main thread adds its
  steps: every event of both reaches the file, each thread's in its own order."""
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race shows at once
  try:
    writer = trace_lib.TraceWriter(str(tmp_path), 0, write_through=True)

    def add(who):
      for i in range(3000):
        writer.add(k="step", who=who, i=i)

    threads = [threading.Thread(target=add, args=(who,)) for who in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  finally:
    sys.setswitchinterval(interval)
  events = trace_lib.read_trace(trace_lib.trace_path(str(tmp_path), 0))
  for who in range(2):
    assert [e["i"] for e in events if e["who"] == who] == list(range(3000))


# -- real runs ------------------------------------------------------------------------------------


def run_args(workdir, algorithm, n, steps, extra=()):
  return [
    f"--config=configs/default.py:executor=async,num_workers={n},algorithm={algorithm},model={MODEL}",
    f"--workdir={workdir}",
    f"--config.num_steps={steps}",
    "--config.runtime.checkpoint_every=8",
    "--config.runtime.heartbeat_timeout=5",
    "--config.runtime.stall_timeout=20",
    "--config.eval_every=8",
    "--config.log_every=1000",
    f"--config.schedule.group_size={min(3, n)}",
    *extra,
  ]


def launch_bounded(
  n, args, timeout_s=240, on_pids=None, grace_s=10, module="experiments.train", max_restarts=0
):
  """launch() in a thread; on timeout every child is SIGKILLed by PID and the test fails."""
  out, pids, result = io.StringIO(), [], {}

  def started(p):
    pids.extend(p)
    if on_pids:
      on_pids(p)

  t = threading.Thread(
    target=lambda: result.setdefault(
      "code",
      launch(
        n,
        args,
        module=module,
        out=out,
        on_start=started,
        cwd=ROOT,
        grace_s=grace_s,
        coordinator=needs_coordinator(module, args),  # as experiments.launch does
        max_restarts=max_restarts,
        elastic=runs_elastic(module, args),
      ),
    ),
    daemon=True,
  )
  t.start()
  t.join(timeout_s)
  if t.is_alive():
    for p in pids:
      try:
        os.killpg(p, signal.SIGKILL)
      except ProcessLookupError:
        pass
    pytest.fail(f"launch did not finish in {timeout_s} s:\n{out.getvalue()[-3000:]}")
  return result["code"], out.getvalue()


def replay_error(config, workdir, traces_dir=None, workers=None):
  """Relative L2 distance per worker between the runtime's final state and the engine's replay."""
  want = replay(config, traces_dir or workdir)
  out = []
  for w in range(config.num_workers) if workers is None else workers:
    got = np.load(os.path.join(workdir, "snapshots", f"final-{w}.npy"))
    tree = {
      "params": jax.tree.map(lambda a: a[w], want["params"]),
      "model_state": jax.tree.map(lambda a: a[w], want["model_state"]),
    }
    out.append(float(np.linalg.norm(got - ravel_pytree(tree)[0]) / np.linalg.norm(got)))
  return out


def assert_replay_matches(config, workdir, tmp_path):
  # The engine (vmapped, start and apply apart) and the runtime's step round differently: ~1e-7 per
  # step, ~5e-7 after 120 steps of the smooth model.
  err = replay_error(config, workdir)
  assert max(err) < 1e-5, err
  # A control: the same traces with one early step moved past its worker's next group are a different
  # order, and the replay must see it (the tolerance is not loose enough to hide an ordering bug).
  traces = trace_lib.load_traces(workdir)
  toks = traces[0]
  swaps = [j for j in range(1, len(toks)) if toks[j]["k"] == "group" and toks[j - 1]["k"] == "step"]
  j = swaps[min(3, len(swaps) - 1)]
  toks[j - 1], toks[j] = toks[j], toks[j - 1]
  other = tmp_path / "swapped"
  other.mkdir()
  for w, events in traces.items():
    (other / f"trace-{w}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  swapped = replay_error(config, workdir, str(other))
  print("replay error", max(err), "swapped", min(swapped))
  assert min(swapped) > 10 * max(err) and min(swapped) > 1e-5, (err, swapped)


@pytest.mark.slow
def test_two_process_run_and_replay_through_the_engine(tmp_path):
  workdir = str(tmp_path / "run")
  code, out = launch_bounded(
    2,
    run_args(
      workdir,
      "ripples_smart",
      2,
      24,
      [
        "--config.hetero.slow_workers=(1,)",
        "--config.hetero.slowdown=3",
        "--config.runtime.step_time=0.01",
        "--config.runtime.consensus_allreduce=True",
      ],
    ),
  )
  assert code == 0, out[-3000:]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert sum(summary["worker_steps"]) >= 48 and summary["worker_steps"][0] > summary["worker_steps"][1]
  # The deployable model (Smart GG's: the workers' mean) is charged the All-Reduce the workers timed
  # after their last step (the slowest's); its result is dropped: the replay below still lands.
  charge = summary["consensus_charge"]
  ends = [e for w in range(2) for e in trace_lib.load_traces(workdir)[w] if e["k"] == "end"]
  assert charge == max(e["consensus_s"] for e in ends) > 0
  evals = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl")) if "test_accuracy" in l]
  assert len(evals) >= 3
  for r in evals:
    assert r["consensus_time"] == r["time"] + charge and r["consensus_accuracy"] == r["test_accuracy"]
    assert r["worker_min_test_accuracy"] <= r["worker_median_test_accuracy"]
  for f in ("gantt.png", "metrics.jsonl", "trace-0.jsonl", "trace-1.jsonl"):
    assert os.path.exists(os.path.join(workdir, f))
  assert "[w0]" in out and "[w1]" in out  # the launcher prefixes each worker's log
  # Process 0 is the coordinator: it trains nothing and holds no checkpoint; the run's files are the
  # two workers' (by worker index), its summary and the Group Generator's snapshots are the coordinator's.
  lines = out.splitlines()
  assert any(l.startswith("[c] ") and "ripples_smart" in l for l in lines), out[-3000:]  # its summary table
  assert not any(l.startswith("[c] ") and "local steps" in l for l in lines), out[-3000:]
  assert sorted(os.listdir(os.path.join(workdir, "ckpt"))) == ["0", "1"]
  assert sorted(f for f in os.listdir(workdir) if f.startswith("trace-")) == [
    "trace-0.jsonl",
    "trace-1.jsonl",
  ]
  assert len(summary["worker_steps"]) == 2 and summary["authority"]["requests"] > 0
  assert os.listdir(os.path.join(workdir, "authority"))
  assert_replay_matches(make_config("ripples_smart", 2, 24, MODEL), workdir, tmp_path)
  # The run ends with a loadable checkpoint: each worker's final state, on this single process.
  from ripples_jax import run

  model = run.load(workdir)
  assert model["executor"] == "async"
  for w in range(2):
    tree = {
      "params": jax.tree.map(lambda a: a[w], model["params"]),
      "model_state": jax.tree.map(lambda a: a[w], model["model_state"]),
    }
    np.testing.assert_array_equal(
      ravel_pytree(tree)[0], np.load(os.path.join(workdir, "snapshots", f"final-{w}.npy"))
    )


@pytest.mark.slow
@pytest.mark.nightly
def test_pairwise_preduce_replays_through_the_engine_with_bounded_programs(tmp_path):
  """runtime.preduce=pairs: groups of 3 averaged by pairwise exchanges compute what the engine's group
  mean computes, with at most n-1 pair programs per worker, compiled before the run."""
  workdir, n, steps = str(tmp_path / "run"), 4, 24
  extra = ["--config.runtime.preduce=pairs", "--config.runtime.step_time=0.01"]
  code, out = launch_bounded(n, run_args(workdir, "ripples_random", n, steps, extra))
  assert code == 0, out[-3000:]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["preduce"] == "pairs" and all(c <= n - 1 for c in summary["group_compiles"]), summary
  assert "3 pair programs compiled ahead" in out and "connected in" in out
  assert all(s == 0.0 for s in summary["group_setup_s"])  # compiled and connected before the run
  sizes = {
    len(e["m"]) for events in trace_lib.load_traces(workdir).values() for e in events if e["k"] == "group"
  }
  assert 3 in sizes  # groups of three, not only pairs
  assert (
    summary["authority"]["requests"] > 0
    and summary["authority"]["p99_ms"] >= summary["authority"]["median_ms"]
  )
  assert_replay_matches(make_config("ripples_random", n, steps, MODEL), workdir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["concurrent", pytest.param("blocking", marks=pytest.mark.nightly)])
def test_adpsgd_passive_side_replays_through_the_engine(tmp_path, mode):
  """AD-PSGD as published: the passive worker's averages land while it computes (between a step's
  start and its apply), and the engine's AD-PSGD semantics reproduce the parameters from the traces."""
  workdir = str(tmp_path / "run")
  code, out = launch_bounded(
    2,
    run_args(
      workdir, "adpsgd", 2, 20, ["--config.runtime.step_time=0.03", f"--config.runtime.adpsgd_passive={mode}"]
    ),
  )
  assert code == 0, out[-3000:]
  traces = trace_lib.load_traces(workdir)
  passive = [e for e in traces[0] if e["k"] == "group"]
  during = sum("during" in e for e in passive)
  assert len(passive) == 20 and (during > 5 if mode == "concurrent" else during == 0), passive
  # The active side in Lian et al.'s order: each step's average is "during" it, started with the step
  # (overlapping the gradient) and done before the step ends (the gradient goes to the average).
  steps = {e["s"]: e for e in traces[1] if e["k"] == "step"}
  own = [e for e in traces[1] if e["k"] == "group"]
  assert len(own) == 20 and all(e.get("own") and e["during"] in steps for e in own), own
  assert all(steps[e["during"]]["t0"] <= e["t0"] and e["t1"] <= steps[e["during"]]["t1"] for e in own)
  config = make_config("adpsgd", 2, 20, MODEL)
  err = replay_error(config, workdir)
  assert max(err) < 1e-5, err
  # A control: the same traces read in the other order (the active worker's gradient applied before
  # its average) are another computation, which the replay tells apart.
  after = {e.pop("during"): e for e in own if e.pop("own")}
  traces[1] = [
    x for e in traces[1] if e not in own for x in ([e, after[e["s"]]] if e["k"] == "step" else [e])
  ]
  other = tmp_path / "apply_first"
  other.mkdir()
  for w, events in traces.items():
    (other / f"trace-{w}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  first = replay_error(config, workdir, str(other))
  assert min(first) > 10 * max(err) and min(first) > 1e-5, (err, first)


@pytest.mark.slow
@pytest.mark.nightly
def test_launcher_leaves_no_process_behind_on_ctrl_c(tmp_path):
  import subprocess
  import sys

  cmd = [
    sys.executable,
    "-m",
    "experiments.launch",
    "--num_processes=2",
    "--grace_s=5",
    "--",
    *run_args(str(tmp_path / "run"), "allreduce", 2, 10000, ["--config.runtime.step_time=0.05"]),
  ]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pids = None
  try:
    deadline = time.monotonic() + 120
    for line in proc.stdout:
      if "pids [" in line:
        pids = json.loads(line.split("pids ")[1])
      if (pids and "[Gloo]" in line) or time.monotonic() > deadline:
        break  # the workers are in their first collective
    assert pids, "the launcher did not report its workers"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, rest[-2000:]
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def test_the_coordinators_progress_counts_the_runs_steps():
  """The coordinator's progress line: every worker's steps / n (the authority's count of started steps
  with a dynamic generator, the heartbeats' completed steps otherwise), capped at num_steps."""
  import types

  from ripples_jax.runtime import coordinator

  class Once:  # follow's stop event: one round, then stop
    def __init__(self):
      self.calls = 0

    def wait(self, _):
      self.calls += 1
      return self.calls > 1

  shown = []
  log = types.SimpleNamespace(progress=lambda step, **kw: shown.append(step))
  watchdog = types.SimpleNamespace(n=4, steps={0: 10, 1: 20, 2: 30, 3: 41})
  coordinator.follow(log, watchdog, None, 300, Once())
  authority = types.SimpleNamespace(service=types.SimpleNamespace(steps=np.array([100, 200, 300, 400])))
  coordinator.follow(log, watchdog, authority, 300, Once())
  authority.service.steps[3] = 1000
  coordinator.follow(log, watchdog, authority, 300, Once())
  assert shown == [25, 250, 300]


def test_the_coordinators_authority_snapshots_are_whole_and_bounded(tmp_path):
  """authority/<c>.json is written whole (no temporary file left), read back as saved, and removed
  once every worker has passed marker c + checkpoint_keep; a missing one is one clear error."""
  from ripples_jax.runtime import coordinator

  workdir = str(tmp_path)
  for c in range(1, 8):
    coordinator.save_snapshot(workdir, c, {"gid": 10 * c, "marks": {"ckpt": c}})
  assert coordinator.load_snapshot(workdir, 3) == {"gid": 30, "marks": {"ckpt": 3}}
  coordinator.trim_snapshots(workdir, epochs=[6, 5, 7], keep=2)  # the slowest passed 5: 3.. resumable
  assert sorted(os.listdir(tmp_path / "authority")) == [f"{c}.json" for c in range(3, 8)]
  coordinator.save_snapshot(workdir, "final", {"gid": 99})
  coordinator.trim_snapshots(workdir, epochs=[9, 9, 9], keep=2)
  assert sorted(os.listdir(tmp_path / "authority")) == ["7.json", "final.json"]
  with pytest.raises(FileNotFoundError, match=r"authority/3.json: the Group Generator's state at checkpoint"):
    coordinator.load_snapshot(workdir, 3)


def test_the_coordinator_waits_out_a_run_longer_than_its_end_timeout(tmp_path):
  """A fixed schedule (no authority): the coordinator waits for the workers however long the run
  takes (the watchdog guards a lost or stalled one); the end timeout runs only from the first
  worker's end, and then names workers that never finish."""
  import types

  from ripples_jax.runtime import coordinator

  watchdog = types.SimpleNamespace(done={0: False, 1: False})

  def finish():
    time.sleep(0.5)  # the run goes on well past the 0.1 s end timeout
    watchdog.done[0] = watchdog.done[1] = True

  t = threading.Thread(target=finish)
  t.start()
  coordinator.await_workers(watchdog, None, str(tmp_path), timeout_s=0.1)  # no TimeoutError
  t.join()
  watchdog.done = {0: True, 1: False}  # one worker ended, the other never does
  with pytest.raises(TimeoutError, match="did not finish within 0 s of the run's end"):
    coordinator.await_workers(watchdog, None, str(tmp_path), timeout_s=0.2)


def test_adpsgd_passive_serving_counts_as_heartbeat_progress(monkeypatch):
  """A passive worker done with its own steps serves a straggler's requests until its DONE: each
  request served, and the DONE, move its heartbeat's events (without them its beats stood still past
  stall_timeout, and once the straggler was done its peers' watchdogs ended a finishing run: exit 75
  with 4 processes, worker 3 5x slower, 100 steps)."""
  import queue
  import threading
  import types

  from ripples_jax.runtime import adpsgd

  monkeypatch.setattr(adpsgd, "exchange", lambda *a: {"k": "group", "c": 0, "g": "x", "m": [0, 1]})
  p = object.__new__(adpsgd.Passive)
  p.worker = types.SimpleNamespace(me=0, now=lambda: 0.0, config=types.SimpleNamespace(num_workers=2))
  p.loop, p.log, p.view, p.lock, p.computing, p.applied = None, None, None, threading.Lock(), None, 20
  p.trace, p.done, p.served = types.SimpleNamespace(add=lambda **e: None), set(), 0
  p.progress, p.inbox = {"steps": 20, "events": 20, "done": False}, queue.Queue()
  for r, value in enumerate([adpsgd.AVG, adpsgd.AVG, adpsgd.DONE]):
    p.inbox.put((1, 0, r, value))
  assert [p.serve_one(block=False) for _ in range(4)] == [True, True, True, False]
  assert p.progress["events"] == 23 and p.served == 2 and p.done == {(1, 0)}


def test_the_summary_scores_all_reduces_workers_on_the_model_they_hold(tmp_path):
  """A marker falls between a worker's step and its All-Reduce: All-Reduce's workers' own models are
  the mean the All-Reduce makes (every worker holds it), a Group Generator's are their snapshots."""
  from ripples_jax import workload
  from ripples_jax.models import init_model
  from ripples_jax.runtime import summary as summary_lib

  snap = tmp_path / "snapshots"
  snap.mkdir()
  for algorithm in ("allreduce", "ripples_smart"):
    config = default_config.get_config(
      f"algorithm={algorithm},executor=async,num_workers=2,model=mlp,dataset=synthetic"
    )
    s = workload.build(config)
    params, state = init_model(s.model, jax.random.key(0), s.data["x_train"][:1])
    flat, unravel = ravel_pytree({"params": params, "model_state": state})
    rng = np.random.default_rng(0)
    for w in range(2):  # two models far apart: their own accuracies are not their mean's
      np.save(snap / f"eval0-{w}.npy", np.asarray(flat) + rng.normal(0, 3.0, flat.shape).astype(np.float32))
    (r,) = summary_lib._evaluate(config, str(snap), s, unravel, [("eval0", 1.0, 2, None, [0, 1])], 0.0)
    same = r["worker_median_test_accuracy"] == r["worker_min_test_accuracy"] == r["test_accuracy"]
    assert same == (algorithm == "allreduce"), r
