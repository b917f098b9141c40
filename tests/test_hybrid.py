"""The hybrid (R pipeline replicas x K stages, averaging stage by stage in groups) against references:
R=1 is the pipeline's tick, K=1 is Ripples' numerics over the clock's events, stages never mix, the
clock's rules."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import dsp as dsp_config
from ripples_jax import collectives as C
from ripples_jax import data as data_lib
from ripples_jax import engine
from ripples_jax import run as run_lib
from ripples_jax.config import ConfigError, validate_dsp_config
from ripples_jax.hybrid import clock as clock_lib
from ripples_jax.hybrid import sim as hybrid
from ripples_jax.pipeline import baselines
from ripples_jax.pipeline import inputs as pipeline_inputs
from ripples_jax.schedule import group_gen
from ripples_jax.schedule.static import allreduce_layouts


def hybrid_config(method="dsp", stages=2, replicas=4, epochs=4, **kw):
  """The synthetic set's 32 batches x `epochs` over the replicas together (4 replicas: ~34 ticks each)."""
  c = dsp_config.get_config(
    f"method={method},num_stages={stages},dataset=synthetic,model=mlp,epochs={epochs}"
  )
  c.batch_size, c.log_every, c.eval_every, c.checkpoint_every = 16, 8, 16, 0
  c.optimizer.update(lr_schedule="constant", warmup_steps=0, lr=0.05)
  c.replicas.update(**{"count": replicas, "stage_s": (0.01,) * stages, **kw})
  return c


def reference_replay(config, trace):
  """The clock's events one at a time: replica r's own (unvmapped) step on its batch, then a group's
  every stage averaged in numpy; what the hybrid's packed, vmapped rounds must equal."""
  R, h = config.replicas.count, hybrid.build_replicas(config)
  p, one, schedule = h.p, h.one, h.schedule
  step = h.step_fn(p.stages, p.optimizer, config, h.total)
  offset = schedule.offsets[-1] if schedule else 0
  shards = data_lib.shard_indices(p.data["y_train"], R, "iid", seed=config.seed)
  states = [jax.tree.map(jnp.array, one) for _ in range(R)]
  for ev in trace.events:
    if ev[1] == clock_lib.TICK_END:
      _, _, r, t = ev
      idx = lambda i: data_lib.batch_indices([shards[r]], config.batch_size, config.seed, i, workers=[r])[0]
      x, y = p.data["x_train"][idx(t)], p.data["y_train"][idx(max(t - offset, 0))]
      states[r], _ = step(states[r], x, y, t)
    else:
      members = list(ev[2])
      for k in range(config.num_stages):
        for key in hybrid.AVERAGED:
          mean = jax.tree.map(lambda *a: np.mean(np.stack(a), 0), *[states[m][k][key] for m in members])
          for m in members:
            states[m][k] = dict(states[m][k], **{key: mean})
  return states


def replica(state, r):
  return jax.tree.map(lambda a: np.asarray(a[r]), state)


def close(a, b, rtol=2e-5, atol=2e-6):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("method", ["dsp", pytest.param("ddg", marks=pytest.mark.nightly)])
def test_one_replica_is_the_pipeline(tmp_path, method):
  """R=1: the pipeline's tick over batch t of the one stream, tick after tick (no group ever forms)."""
  config = hybrid_config(method, replicas=1, epochs=1)
  summary, state, trace = hybrid.simulate_replicas_and_train(config, str(tmp_path / "h"))
  assert summary["groups"] == 0 and len(trace.events) == trace.worker_steps[0]
  # The reference walks the pipeline's own feed (setup.Feed: the whole set, one stream).
  p = pipeline_inputs.build_pipeline(config)
  init_fn, step_fn = baselines.METHODS[method]
  ref = init_fn(p.stages, p.optimizer, config, jax.random.key(0), p.feed.sample, p.data["num_classes"])
  schedule = baselines.schedule_of(config)
  n = p.num_batches + schedule.drain_ticks()
  step = step_fn(p.stages, p.optimizer, config, n)
  for t in range(n):
    x = p.data["x_train"][p.feed.indices(t)]
    ref, _ = step(ref, x, p.feed.labels(t - schedule.offsets[-1]), t)
  close(replica(state, 0), jax.tree.map(np.asarray, ref))


def test_one_stage_is_ripples_over_the_same_events(tmp_path):
  """K=1: every replica is one worker's SGD step; the hybrid's packed rounds equal Ripples' worker
  loop (step, then the group's average) replayed event by event; a 5x straggler makes the groups
  uneven."""
  config = hybrid_config(stages=1, algorithm="ripples_random", group_size=2, slow=(1, 0), slowdown=5.0)
  _, state, trace = hybrid.simulate_replicas_and_train(config, str(tmp_path / "h"))
  assert (
    clock_lib.averages(trace) > 10 and trace.worker_steps[1] < trace.worker_steps[0]
  )  # the slow one lagged
  ref = reference_replay(config, trace)
  for r in range(config.replicas.count):
    close(replica(state, r)[0]["params"], ref[r][0]["params"])


def test_two_stages_smart_replay(tmp_path):
  """K=2 with Smart GG and a moving straggler: the packed rounds equal the event-by-event replay; every
  evaluation's deployable model is charged the All-Reduce of every stage across the replicas."""
  config = hybrid_config(algorithm="ripples_smart", slow=(0, 1), slowdown=5.0, rotate_every=0.1)
  summary, state, trace = hybrid.simulate_replicas_and_train(config, str(tmp_path / "h"))
  charge = summary["consensus_charge"]
  assert charge == max(C.ring_allreduce_time(4, b, 5e-6, 1.25e9) for b in summary["stage_bytes"]) > 0
  records = [json.loads(line) for line in open(tmp_path / "h" / "metrics.jsonl")]
  assert all(r["consensus_time"] == r["time"] + charge for r in records if "test_accuracy" in r)
  # The replicas' own models: the last record's median and worst replica are the final state's.
  h = hybrid.build_replicas(config)
  evaluate, k = baselines.make_eval(h.p.stages), engine.WORKER_EVAL_EXAMPLES
  own = [
    float(evaluate(m, h.p.data["x_test"][:k], h.p.data["y_test"][:k])[0])
    for m in hybrid.replica_models(config, state)
  ]
  last = [r for r in records if "test_accuracy" in r][-1]
  assert len(set(own)) > 1  # the replicas differ (Smart GG averages in groups)
  assert last["worker_median_test_accuracy"] == pytest.approx(float(np.median(own)), abs=1e-6)
  assert last["worker_min_test_accuracy"] == pytest.approx(min(own), abs=1e-6)
  spec = lambda c: hybrid.clock_spec(c, (0.1, 0.1), (4e6, 4e6), 100)  # noqa: E731
  for name, want in (("allreduce", 0.0), ("none", None)):
    c = hybrid_config(algorithm=name)
    assert hybrid.replica_consensus_charge(c, spec(c)) == want
  c = hybrid_config(algorithm="allreduce", sync_every=2)  # between its syncs no replica holds the mean
  assert hybrid.replica_consensus_charge(c, spec(c)) > 0
  assert clock_lib.averages(trace) > 10
  ref = reference_replay(config, trace)
  for r in range(config.replicas.count):
    close([st["params"] for st in replica(state, r)], [st["params"] for st in ref[r]])


def test_stages_never_mix():
  """A round's averages: stage k's rows become their group's mean of stage k's rows; nothing else
  (another stage's, a ring) moves."""
  R = 4
  rng = np.random.default_rng(0)
  state = [
    {
      "params": {"w": jnp.asarray(rng.normal(size=(R, 3)))},
      "model_state": {},
      "in_ring": jnp.asarray(rng.normal(size=(R, 2))),
    }
    for _ in range(2)
  ]
  before = jax.tree.map(np.asarray, state)
  idle = lambda st, x, y, t: (st, (jnp.float32(0), jnp.float32(0)))
  gid = np.array([0, 3, 2, 3])  # {0}, {1, 3}, {2}
  out, _ = hybrid.make_replica_round_fn(idle)(
    state, np.zeros((R, 1)), np.zeros((R, 1)), np.zeros(R, np.int32), np.zeros(R, bool), gid
  )
  for k in range(2):
    w = before[k]["params"]["w"]
    want = w.copy()
    want[[1, 3]] = w[[1, 3]].mean(0)
    np.testing.assert_allclose(out[k]["params"]["w"], want, rtol=1e-12)
    np.testing.assert_array_equal(out[k]["in_ring"], before[k]["in_ring"])


def test_replica_rounds_keep_each_replicas_order():
  """Ticks run before averages in a round: a replica that averaged ticks in the next round; each tick
  keeps its own index (replica 2 resumed at tick 7)."""
  T, A = clock_lib.TICK_END, clock_lib.AVG
  events = [(1.0, T, 0, 0), (1.1, T, 1, 0), (1.2, A, (0, 1), None), (1.3, T, 2, 7), (2.0, T, 0, 1)]
  rounds = hybrid.replica_rounds(events, 3)
  assert [r["tick"].tolist() for r in rounds] == [[True, True, True], [True, False, False]]
  assert rounds[0]["gid"].tolist() == [0, 0, 2] and rounds[0]["t"].tolist() == [0, 0, 7]
  assert rounds[1]["t"][0] == 1


def spec(gen, R=4, **kw):
  return clock_lib.Spec((0.1, 0.12), (4e6, 4e6), R, 400, gen, jitter=0.05, **kw)


def test_clock_rules():
  """All-Reduce: every replica every tick, so a 5x slow device paces all of them; no averaging: each
  replica at its own pace; a group's members all finished the tick before it."""
  ar = group_gen.Fixed(allreduce_layouts(4))
  t = clock_lib.simulate_replicas(spec(ar, slow=(1, 0), slowdown=5.0))
  ticks = t.worker_steps
  assert ticks.max() - ticks.min() == 0 and clock_lib.averages(t) == ticks.min() - (ticks.sum() == 400)
  alone = clock_lib.simulate_replicas(spec(None, slow=(1, 0), slowdown=5.0))
  assert clock_lib.averages(alone) == 0 and alone.worker_steps[1] * 3 < alone.worker_steps[0]
  assert alone.end_time * 2.5 < t.end_time  # the others did not wait
  split = t.time_split()  # every replica's time: its ticks, its waits and its averages, to the end
  assert np.allclose(split["compute"] + split["wait"] + split["comm"], t.end_time, rtol=0.02)
  smart = clock_lib.simulate_replicas(spec(group_gen.smart_gg(4, 2), slow=(1, 0), slowdown=5.0))
  done = np.zeros(4, int)  # each replica's ticks so far: a group may only hold replicas between ticks
  last_avg = np.full(4, -1)
  for ev in smart.events:
    if ev[1] == clock_lib.TICK_END:
      done[ev[2]] += 1
    else:
      for m in ev[2]:
        assert done[m] > last_avg[m]  # at most one group per sync point
        last_avg[m] = done[m]


def test_config_errors_name_the_key():
  c = hybrid_config(slow=(4, 0))
  with pytest.raises(ConfigError, match=r"config.replicas.slow: \(4, 0\) is not allowed"):
    validate_dsp_config(c)
  c = hybrid_config(algorithm="gossip")
  with pytest.raises(ConfigError, match="config.replicas.algorithm"):
    validate_dsp_config(c)
  c = hybrid_config(stage_s=(0.1,))
  with pytest.raises(ConfigError, match="config.replicas.stage_s"):
    validate_dsp_config(c)
  assert run_lib.executor_of(hybrid_config()) == "hybrid"
  assert run_lib.executor_of(hybrid_config(replicas=0)) == "pipeline"


@pytest.mark.slow  # 4-7 s: the fast tier's 2 minutes (WORKSPACE.md section 41)
def test_resume_equals_the_uninterrupted_run(tmp_path):
  """A hybrid run cut back to an early checkpoint and rerun: the clock is re-run, the executed rounds
  skipped; the records come out byte for byte and the final state equal."""
  import os
  import shutil

  config = hybrid_config(algorithm="ripples_smart", slow=(1, 0), slowdown=3.0)
  config.checkpoint_every, config.checkpoint_keep = 16, 5
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  _, state, _ = hybrid.simulate_replicas_and_train(config, whole)
  shutil.copytree(whole, cut)
  later = [d for d in os.listdir(os.path.join(cut, "ckpt")) if d.isdigit() and int(d) > 16]
  assert later
  for d in later:
    shutil.rmtree(os.path.join(cut, "ckpt", d))
  _, resumed, _ = hybrid.simulate_replicas_and_train(config, cut)
  assert (
    open(os.path.join(cut, "metrics.jsonl"), "rb").read()
    == open(os.path.join(whole, "metrics.jsonl"), "rb").read()
  )
  jax.tree.map(
    np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed), jax.tree.map(np.asarray, state)
  )


@pytest.mark.slow
def test_the_study_runs_end_to_end(tmp_path):
  """experiments.hybrid_study's main on a one-epoch study, in a process of its own (its absl flags are
  its own): tuning, the runs, the tables; every reported run is in runs.json under its key, at the
  chosen step size."""
  import json
  import subprocess
  import sys

  from experiments import hybrid_study

  out = tmp_path / "study"
  flags = [
    "--studies=4x2",
    "--seeds=1",
    "--first_seed=3",
    "--scenarios=5x device",
    "--algorithms=ripples_smart,allreduce_drop",
    "--workers=1",
  ]
  script = (
    "from absl import app\n"
    "from experiments import hybrid_study as h\n"
    "h.STUDIES['4x2'] = (4, 2, 1, 0.2, (0.05, 0.1), 64)\n"  # one epoch, a grid of two
    "h.define_flags()\n"
    f"app.run(h.main, argv={['x', f'--out={out}', *flags]!r})\n"
  )
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  study = json.load(open(out / "study_4x2.json"))
  runs = json.load(open(out / "runs.json"))
  assert set(study["chosen"]) == {"allreduce", "ripples_smart", "allreduce_drop"}
  assert study["chosen"]["allreduce_drop"] == study["chosen"]["allreduce"]  # no tuning runs of its own
  assert not any("allreduce_drop" in k for k in runs if k.endswith(f"seed={hybrid_study.TUNE_SEEDS[0]}"))
  lr = study["chosen"]["ripples_smart"]
  assert hybrid_study.run_key("4x2", "5x device", "ripples_smart", lr, 3, own=True) in runs
  got = study["out"]["5x device"]
  # Both deployable models of every averaging run, the consensus charged on its clock (Smart GG's
  # replicas hold no common model: its All-Reduce costs time; All-Reduce's is free).
  smart = runs[hybrid_study.run_key("4x2", "5x device", "ripples_smart", lr, 3, own=True)]["curve"]
  assert all(c > t for c, t in zip(smart["ctime"], smart["time"]))
  ar = runs[hybrid_study.run_key("4x2", "5x device", "allreduce", study["chosen"]["allreduce"], 3, own=True)]
  assert ar["curve"]["ctime"] == ar["curve"]["time"]
  assert set(got["ripples_smart"]["own"]) >= {"time", "end", "final"} and got["ripples_smart"]["worst_final"]
  # The dropped replica: 3 replicas, no slow device, its ticks at full speed.
  assert got["allreduce_drop"]["end"][0] < got["allreduce"]["end"][0] / 2
  assert "| 5x device | All-Reduce, slow replica dropped |" in (out / "study_4x2.md").read_text()
  # All-Reduce waits for the 5x device every tick; Smart GG's replicas do not: more ticks, same clock.
  assert got["allreduce"]["ticks"] == got["ripples_smart"]["ticks"]  # the same budget of ticks
  assert got["ripples_smart"]["end"][0] < got["allreduce"]["end"][0] / 2
  assert "| 5x device | Smart GG |" in (out / "study_4x2.md").read_text()
  assert hybrid_study.router_limit("4x2", "5x device") == pytest.approx(5 * 3.2 / 4)


def test_no_averaging_evaluates_each_replica():
  """algorithm=none: R independent pipelines, each evaluated on its own; otherwise the one averaged model."""
  state = [{"params": {"w": jnp.arange(6.0).reshape(3, 2)}, "model_state": {}, "in_ring": jnp.zeros((3, 1))}]
  models = hybrid.run_models(hybrid_config(stages=1, replicas=3, algorithm="none"), state)
  assert [np.asarray(m[0]["params"]["w"]).tolist() for m in models] == [[0, 1], [2, 3], [4, 5]]
  (avg,) = hybrid.run_models(hybrid_config(stages=1, replicas=3), state)
  assert np.asarray(avg[0]["params"]["w"]).tolist() == [2, 3] and set(avg[0]) == {"params", "model_state"}


def replay(config, events):
  """The simulator's numerics (packed rounds, vmapped one_device ticks) over an event log."""
  R, h = config.replicas.count, hybrid.build_replicas(config)
  p, schedule, total = h.p, h.schedule, h.total
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (R,) + a.shape).copy(), h.one)
  round_fn = hybrid.make_replica_round_fn(h.step_fn(p.stages, p.optimizer, config, total))
  shards = data_lib.shard_indices(p.data["y_train"], R, "iid", seed=config.seed)
  for r in hybrid.replica_rounds(events, R):
    x, y = hybrid.replica_batches(config, p.data, shards, r, schedule.offsets[-1])
    state, _ = round_fn(state, x, y, r["t"], r["tick"], r["gid"])
  return state, total


@pytest.mark.slow
def test_devices_run_replays_to_its_parameters(tmp_path):
  """placement=devices: 4 replicas x 2 stages on 8 devices, a thread per replica, Smart GG, a 5x slow
  device; the run's event log, replayed through the simulator's numerics, gives the run's parameters
  (the device ticks are one_device's bit for bit, the means in the members' order); the budget of
  ticks is spent exactly and the slow replica ticked least."""
  from ripples_jax.hybrid import devices as hybrid_devices

  config = hybrid_config(algorithm="ripples_smart", slow=(1, 0), slowdown=5.0, pad_s=0.01)
  config.placement = "devices"
  validate_dsp_config(config)
  summary, state, events = hybrid_devices.train_replicas(config, str(tmp_path / "d"))
  ref, total = replay(config, events)
  assert sum(summary["worker_steps"]) == total and summary["groups"] > 5
  assert np.argmin(summary["worker_steps"]) == 1
  close(
    [st["params"] for st in state],
    [st["params"] for st in jax.tree.map(np.asarray, ref)],
    rtol=1e-6,
    atol=1e-7,
  )
  assert summary["final_test_accuracy"] > 0.5


def bare_shared(R: int = 4):
  """hybrid/devices' shared state of R replicas without states or a buffer: for the lock's rules."""
  import threading

  from ripples_jax.hybrid import devices as hybrid_devices

  return hybrid_devices.Shared(
    threading.Condition(), None, [None] * R, 10, *(np.zeros(R),) * 3, np.zeros(R, int)
  )


def test_a_cut_waits_for_a_member_woken_from_a_finished_group():
  """A replica still listed as waiting in a group its last member has averaged is not stopped for a cut
  (the cut would record it waiting in a group that no longer exists, and on resume its thread would
  wait for what never comes: the hang of the devices cut test); one waiting in an unfinished group is."""

  from ripples_jax.hybrid import devices as hybrid_devices

  sh = bare_shared()
  sh.paused, sh.gone, sh.waiting = {0}, {3}, {1: (7, (1, 2)), 2: (7, (1, 2))}
  assert hybrid_devices.stopped(sh) == {0, 1, 2, 3}
  sh.finished.add(7)  # 2 arrived last and averaged; 1 has not woken yet
  del sh.waiting[2]
  assert hybrid_devices.stopped(sh) == {0, 3}


def test_a_resumed_replica_rejoins_a_group_whose_last_member_came_first():
  """Resumed inside group 16 with replica 0: 0's thread may arrive (and take the group out of `reached`)
  before 3's thread starts; 3 then waits for the averages and goes on (its KeyError there hung the
  devices cut test). A group a member left is abandoned: 3 leaves too."""
  import threading
  import time

  from ripples_jax.hybrid import devices as hybrid_devices

  sh = bare_shared()
  sh.waiting = {3: (16, (0, 3))}
  out = []
  t = threading.Thread(target=lambda: out.append(hybrid_devices.rejoin_group(3, sh)), daemon=True)
  t.start()
  time.sleep(0.05)
  assert t.is_alive() and not out  # 0's averages are not done yet
  with sh.cond:
    sh.finished.add(16)
    sh.cond.notify_all()
  t.join(10)
  assert out == [True] and sh.waiting == {}
  sh.waiting, sh.reached, sh.gone = {3: (17, (1, 3))}, {17: {3}}, {1}
  assert not hybrid_devices.rejoin_group(3, sh) and 3 in sh.gone


@pytest.mark.slow
def test_a_replica_thread_that_raises_ends_the_run(tmp_path, monkeypatch):
  """placement=devices: a replica's tick raising at its third tick ends the run with that error (the
  replicas waiting in its groups leave), instead of leaving them waiting on a thread that is gone."""
  from ripples_jax.hybrid import devices as hybrid_devices

  made = hybrid_devices.replica_tick

  def make_tick(p, config, schedule, num_batches, devs):
    tick = made(p, config, schedule, num_batches, devs)
    if devs[0] != hybrid_devices.replica_devices(config)[1][0]:
      return tick

    def failing(state, x, y, i):
      if i == 3:
        raise ValueError("a device fault")
      return tick(state, x, y, i)

    return failing

  monkeypatch.setattr(hybrid_devices, "replica_tick", make_tick)
  config = hybrid_config(algorithm="ripples_random", group_size=2, pad_s=0.005)
  config.placement = "devices"
  with pytest.raises(RuntimeError, match=r"replica 1's thread failed \(ValueError: a device fault\)"):
    hybrid_devices.train_replicas(config, str(tmp_path / "d"))


def test_devices_placement_needs_a_device_per_stage_of_every_replica():
  c = hybrid_config(replicas=5)
  c.placement = "devices"
  with pytest.raises(
    ConfigError, match=r"config.replicas.count: 5 is not allowed: at most 4 with placement=devices"
  ):
    validate_dsp_config(c, local_devices=8)
  assert run_lib.executor_of(c) == "hybrid/devices"


@pytest.mark.slow
def test_devices_cut_and_resume(tmp_path):
  """placement=devices with a consistent cut every 8 steps: the run cut back to its first cut and rerun
  goes on from it (each replica at its own tick, the buffer's pending groups, the clock's time); its
  records up to the cut are the whole run's, byte for byte, and the log of both lives replays to the
  resumed run's parameters."""
  import os
  import shutil

  from ripples_jax.hybrid import devices as hybrid_devices

  config = hybrid_config(algorithm="ripples_random", group_size=2, slow=(1, 0), slowdown=3.0, pad_s=0.005)
  config.placement, config.checkpoint_every, config.checkpoint_keep = "devices", 8, 10
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  _, _, _ = hybrid_devices.train_replicas(config, whole)
  cuts = sorted(int(d) for d in os.listdir(os.path.join(whole, "ckpt")) if d.isdigit())
  assert len(cuts) >= 3
  shutil.copytree(whole, cut)
  for d in cuts[1:]:
    shutil.rmtree(os.path.join(cut, "ckpt", str(d)))
  summary, state, events = hybrid_devices.train_replicas(config, cut)
  lines = lambda w: open(os.path.join(w, "metrics.jsonl")).read().splitlines()
  upto = [line for line in lines(whole) if json.loads(line)["step"] <= cuts[0]]
  assert lines(cut)[: len(upto)] == upto
  steps = [json.loads(line)["step"] for line in lines(cut)]
  assert steps == sorted(set(steps))  # nothing recorded twice
  for r in range(config.replicas.count):  # each replica goes on at its next batch: no tick redone
    own = [e[3] for e in events if e[1] == clock_lib.TICK_END and e[2] == r]
    assert own == list(range(summary["worker_steps"][r]))
  ref, total = replay(config, events)
  assert sum(summary["worker_steps"]) == total
  close(
    [st["params"] for st in state],
    [st["params"] for st in jax.tree.map(np.asarray, ref)],
    rtol=1e-6,
    atol=1e-7,
  )


@pytest.mark.parametrize(
  "algorithm,golden",
  [
    ("ripples_random", "a548a1edf468ef99"),
    ("ripples_smart", "cee0919695df9074"),
    ("ripples_static", "caa3f140bb33715e"),
  ],
)
def test_the_clock_is_the_golden_one(algorithm, golden):
  """A canary: the hybrid's clock (R=4, K=2, a rotating 3x device, jitter, sync every 2 ticks) makes
  the events it made before it drove schedule/online.Service and recorded timeline.Trace (the hashes
  of the fourth pass's first commit, b08d98f, its events as ("tick" | "avg") tuples)."""
  import hashlib

  c = dsp_config.get_config("method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=4")
  c.replicas.update(count=4, algorithm=algorithm, group_size=3, workers_per_node=2, slow=(0, 1), slowdown=3.0)
  c.replicas.update(rotate_every=0.5, jitter=0.05, sync_every=2)
  trace = clock_lib.simulate_replicas(hybrid.clock_spec(c, (0.1, 0.12), (4e6, 4e6), 400))
  events = [
    (e[0], "tick", e[2], e[3]) if e[1] == clock_lib.TICK_END else (e[0], "avg", e[2]) for e in trace.events
  ]
  assert hashlib.sha256(repr(events).encode()).hexdigest()[:16] == golden
