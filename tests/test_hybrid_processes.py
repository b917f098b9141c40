"""The hybrid with a process per (replica, stage) (hybrid/processes.py): the Group Generator service's rules
(markers at a consistent cut, the budget, STOP), the config's lines, and a killed run resumed whose two
lives replay to its parameters."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.config_args import needs_coordinator
from ripples_jax import data as data_lib
from ripples_jax import run as run_lib
from ripples_jax.config import ConfigError, validate_dsp_config
from ripples_jax.hybrid import processes
from ripples_jax.hybrid import sim as hybrid
from tests.test_hybrid import hybrid_config
from tests.test_runtime import launch_bounded


def service(algorithm, R=4, total=24, eval_every=2, checkpoint_every=0, **kw):
  c = hybrid_config(replicas=R, algorithm=algorithm, **kw)
  c.eval_every, c.checkpoint_every = eval_every, checkpoint_every
  saved = {}
  svc = processes.SyncPoints(c, None, total // R, total, lambda: 0.0, lambda m, st: saved.setdefault(m, st))
  return svc, saved


def play(svc, R: int, seed: int = 0) -> list:
  """The protocol without processes: a replica asks at each sync point and executes its entry's items
  in order, waiting at a group until every member has reached it; who moves next is drawn at random.
  Returns each replica's executed items and how many times it asked (once per tick: sync_every=1)."""
  rng = np.random.default_rng(seed)
  done = [[] for _ in range(R)]
  todo, sync, last = [[] for _ in range(R)], [0] * R, [-1] * R
  stopped = set()
  while len(stopped) < R:
    r = int(rng.choice([w for w in range(R) if w not in stopped]))
    if not todo[r]:
      todo[r] = svc.answer(r, sync[r], 0.1, last[r])
      steps = [it for it in todo[r] if it[0] in "GN"]  # one group or NONE, unless it is the end
      assert len(steps) == 1 or todo[r][-1] == ("S",), todo[r]
      sync[r] += 1
    item = todo[r][0]
    ready = lambda it: all(todo[m] and todo[m][0] == it for m in it[2])  # noqa: E731
    if item[0] == "G":
      members = item[2]
      if not ready(item):
        movable = [w for w in range(R) if w not in stopped and not (todo[w] and todo[w][0][0] == "G")]
        movable += [w for w in range(R) if todo[w] and todo[w][0][0] == "G" and ready(todo[w][0])]
        assert movable, f"no replica can move: {todo}"  # a cycle of waits
        continue
      for m in members:
        done[m].append(todo[m].pop(0))
        last[m] = max(last[m], item[1])
      continue
    done[r].append(todo[r].pop(0))
    if item[0] == "S":
      stopped.add(r)
  return done, sync


def consistent(done: list) -> None:
  """Every marker cuts every group on the same side for all its members (a fixed schedule's group is
  the same item at every index: its n-th occurrence is one group)."""
  for items in done:
    marks = {it[2]: i for i, it in enumerate(items) if it[0] == "M"}
    for i, it in enumerate(items):
      if it[0] != "G":
        continue
      nth = items[:i].count(it)
      for m in it[2]:
        pos = [j for j, x in enumerate(done[m]) if x == it][nth]
        other = {x[2]: j for j, x in enumerate(done[m]) if x[0] == "M"}
        for c in set(marks) & set(other):
          assert (i < marks[c]) == (pos < other[c]), f"group {it} cut by marker {c} on one side only"


@pytest.mark.parametrize("algorithm", ["ripples_random", "ripples_smart"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_markers_cut_every_group_on_one_side_and_the_budget_is_spent(algorithm, seed):
  R, total = 4, 40
  svc, _ = service(algorithm, R=R, total=total, group_size=3)
  done, ticks = play(svc, R, seed)
  consistent(done)
  assert sum(ticks) == total  # the budget, spent exactly (a tick before each ask)
  assert all(items[-1] == ("S",) for items in done)
  marks = [[it[2] for it in items if it[0] == "M"] for items in done]
  assert marks[0] and all(m == marks[0] for m in marks)  # every replica passes every marker, in order
  assert sum(it[0] == "G" for items in done for it in items) > 5


def test_fixed_schedule_markers_come_at_one_index_before_its_group():
  """All-Reduce: every replica's marker at the same sync index, before that index's group; every
  replica stops after its share of the ticks, without a group."""
  R, total = 4, 24
  svc, _ = service("allreduce", R=R, total=total)
  done, ticks = play(svc, R, 3)
  consistent(done)
  assert ticks == [total // R] * R
  for items in done:  # a group at every sync point but the last, where the replica stops instead
    assert items[-1] == ("S",) and sum(it[0] == "G" for it in items) == total // R - 1
  # a marker's place: the groups before it (one per sync index here), the same for every replica
  at = [[sum(x[0] == "G" for x in items[:i]) for i, it in enumerate(items) if it[0] == "M"] for items in done]
  assert at[0] and all(a == at[0] for a in at)


def test_checkpoint_markers_save_the_service_first():
  svc, saved = service("ripples_random", R=3, total=30, checkpoint_every=4, group_size=2)
  done, _ = play(svc, 3)
  marks = [it[2] for it in done[0] if it[0] == "M"]
  assert len(marks) >= 4 and sorted(saved) == [m for m in marks if m % 2 == 0]  # 2 evaluations a checkpoint
  assert all(st["next_mark"] == m + 1 for m, st in saved.items())
  assert all((it[1] == "ckpt") == (it[2] % 2 == 0) for it in done[0] if it[0] == "M")


def test_config_lines():
  c = hybrid_config(replicas=4)
  c.placement = "per_process"
  with pytest.raises(ConfigError, match=r"config.placement: 'per_process' is not allowed: .* = 9 processes"):
    validate_dsp_config(c, num_processes=8)
  validate_dsp_config(c, num_processes=9)
  assert run_lib.executor_of(c) == "hybrid/per_process"
  c.method = "gpipe"
  with pytest.raises(ConfigError, match=r"config.method: 'gpipe' is not allowed"):
    validate_dsp_config(c, num_processes=9)
  args = ["--config=configs/dsp.py", "--config.placement=per_process", "--config.replicas.count=4"]
  assert needs_coordinator("experiments.train_dsp", args)
  assert not needs_coordinator("experiments.train_dsp", args[:2])


def replay_final(workdir: str) -> tuple:
  """Both lives' traces through the simulator's numerics: (each stage's final flat parameters, the
  replay's, the budget)."""
  import ml_collections

  config = ml_collections.ConfigDict(json.load(open(os.path.join(workdir, "config.json"))))
  R, K = config.replicas.count, config.num_stages
  events = processes.events_of(processes.read_traces(workdir, R, K), R)
  h = hybrid.build_replicas(config)
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (R,) + a.shape).copy(), h.one)
  round_fn = hybrid.make_replica_round_fn(h.step_fn(h.p.stages, h.p.optimizer, config, h.total))
  shards = data_lib.shard_indices(h.p.data["y_train"], R, "iid", seed=config.seed)
  for rd in hybrid.replica_rounds(events, R):
    x, y = hybrid.replica_batches(config, h.p.data, shards, rd, h.schedule.offsets[-1])
    state, _ = round_fn(state, x, y, rd["t"], rd["tick"], rd["gid"])
  got = [[np.load(processes.stage_snapshot_path(workdir, "final", r, k)) for k in range(K)] for r in range(R)]
  ref = [
    [np.asarray(processes.flat_of(jax.tree.map(lambda a: a[r], state[k]))[0]) for k in range(K)]
    for r in range(R)
  ]
  return got, ref, h.total


@pytest.mark.slow
def test_a_killed_run_resumes_and_both_lives_replay_to_its_parameters(tmp_path):
  """3 replicas x 2 stages (6 stage processes and the coordinator), Random GG in pairs, a 3x slow device,
  checkpoints every 16 steps: replica 0's stage 1 SIGKILLs itself at tick 30; the same command resumes
  every stage from the newest marker all saved. No tick is redone, the budget is spent exactly, the
  records are in order, and the traces of both lives, replayed through the simulator's numerics, give
  every stage's parameters (the stages' averages never mixed)."""
  workdir = str(tmp_path / "run")
  args = [
    "--config=configs/dsp.py:method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=3",
    "--config.placement=per_process",
    "--config.batch_size=16",
    "--config.log_every=8",
    "--config.eval_every=8",
    "--config.checkpoint_every=16",
    "--config.optimizer.lr_schedule=constant",
    "--config.optimizer.warmup_steps=0",
    "--config.optimizer.lr=0.05",
    "--config.replicas.count=3",
    "--config.replicas.algorithm=ripples_random",
    "--config.replicas.group_size=2",
    "--config.replicas.pad_s=0.01",
    "--config.replicas.slow=(1,0)",
    "--config.replicas.slowdown=3.0",
    "--config.runtime.stall_timeout=40",
    "--config.runtime.fail_stage=1",
    "--config.runtime.fail_tick=30",
    f"--workdir={workdir}",
  ]
  code, out = launch_bounded(6, args, timeout_s=240, module="experiments.train_dsp")
  assert code != 0 and "replica 0 stage 1 kills itself at tick 30" in out, out[-3000:]
  code, out = launch_bounded(6, args, timeout_s=240, module="experiments.train_dsp")
  assert code == 0, out[-3000:]
  assert "the hybrid resumes at marker" in out, out[-3000:]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  got, ref, total = replay_final(workdir)
  assert sum(summary["worker_steps"]) == total and summary["groups"] > 10
  for r in range(3):
    events = [json.loads(line) for line in open(os.path.join(workdir, f"trace-{r}-0.jsonl"))]
    ticks = [e["i"] for e in events if e["k"] == "tick"]
    assert ticks == list(range(summary["worker_steps"][r]))  # each replica goes on at its next batch
    for k in range(2):
      np.testing.assert_allclose(got[r][k], ref[r][k], rtol=1e-6, atol=1e-7, err_msg=f"replica {r} stage {k}")
  steps = [json.loads(l)["step"] for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert steps == sorted(set(steps)) and summary["final_test_accuracy"] > 0.5
