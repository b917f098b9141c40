"""The algorithm registry (ripples_jax/algorithms.py): one record per algorithm, and everything that
used to keep its own list derived from it: the validator, the executors' lists, the hybrid's."""

import numpy as np
import pytest

from configs import default as default_config
from configs import dsp as dsp_config
from ripples_jax import algorithms, timeline
from ripples_jax import config as config_lib
from ripples_jax.config import ConfigError, validate_dsp_config
from ripples_jax.config import validate_train_config as validate_config
from ripples_jax.hybrid import clock as clock_lib
from ripples_jax.hybrid import sim as hybrid
from ripples_jax.schedule import group_gen
from ripples_jax.schedule.static import grid_layouts

CLOCKS = (algorithms.SYNC, algorithms.DILOCO, algorithms.ADPSGD, algorithms.PS_ASYNC, algorithms.GROUP_BUFFER)


def test_records_are_unique_and_well_formed():
  assert len(algorithms.BY_NAME) == len(algorithms.REGISTRY)
  for a in algorithms.REGISTRY:
    assert a.clock in CLOCKS and set(a.executors) <= {"sim", "spmd", "async"} and "sim" in a.executors
    assert (a.runtime is not None) == ("async" in a.executors)
    assert not (a.generator and a.layouts)  # a generator or a fixed schedule, never both
    if "spmd" in a.executors:
      assert a.layouts is not None  # the lockstep executor runs periodic layouts
  assert algorithms.names("spmd") == ("allreduce", "ripples_static")


@pytest.mark.parametrize("executor", ["sim", "spmd", "async"])
def test_the_validator_allows_what_the_registry_says(executor):
  """Each executor accepts exactly the algorithms whose records name it; another's is refused with one
  line naming the executor it needs."""
  assert config_lib.ALGORITHMS_OF[executor] == algorithms.names(executor)
  for a in algorithms.REGISTRY:
    c = default_config.get_config(f"executor={executor},num_workers=8,algorithm={a.name}")
    kw = {"num_devices": 8, "num_processes": 9 if executor == "async" else 1}
    if executor in a.executors:
      validate_config(c, **kw)
    else:
      with pytest.raises(
        ConfigError, match=rf"config.algorithm: '{a.name}' is not allowed: .*needs executor="
      ):
        validate_config(c, **kw)


def test_the_keys_a_record_names_are_checked():
  """A bad value of a key the algorithm's record names is refused; the same value under another
  algorithm, which does not read it, is not."""
  c = default_config.get_config("executor=sim,num_workers=8,algorithm=ripples_random")
  c.schedule.group_size = 99
  with pytest.raises(ConfigError, match=r"config.schedule.group_size: 99 is not allowed"):
    validate_config(c, num_devices=8)
  c.algorithm = "allreduce"
  validate_config(c, num_devices=8)
  c = default_config.get_config("executor=sim,num_workers=8,algorithm=adpsgd")
  c.num_workers = 1
  with pytest.raises(ConfigError, match=r"config.num_workers: 1 is not allowed: at least 2 for adpsgd"):
    validate_config(c, num_devices=8)


def test_the_clock_runs_each_record_by_its_protocol():
  """timeline.simulate dispatches on the record's clock: a leave plan is refused exactly where the
  record gives a reason."""
  for a in algorithms.REGISTRY:
    c = default_config.get_config(f"executor=sim,num_workers=4,algorithm={a.name},steps=5")
    c.hetero.leave = ((1, 0.1, -1.0),)
    if a.no_leave:
      with pytest.raises(ValueError, match=f"leave/join is not allowed with {a.name}"):
        timeline.simulate(_spec(c))
    else:
      assert timeline.simulate(_spec(c)).end_time > 0


def _spec(c):
  from ripples_jax import sim

  speed, net = sim.build_clock(c, 4e5, 0.01)
  gg = algorithms.make_group_generator(c, np.random.default_rng(0))
  leave = sim.leave_plan(c)
  return timeline.ClockSpec(c.algorithm, speed, net, c.num_steps * c.num_workers, gg=gg, leave=leave)


def hybrid_config(algorithm: str, R: int = 4):
  c = dsp_config.get_config("method=dsp,num_stages=2,dataset=synthetic,model=mlp,epochs=4")
  c.replicas.update(count=R, algorithm=algorithm, group_size=3, workers_per_node=2, stage_s=(0.01, 0.01))
  return c


def test_the_hybrid_allows_every_algorithm_with_groups():
  assert config_lib.HYBRID_ALGORITHMS == algorithms.hybrid_names()
  assert set(algorithms.hybrid_names()) >= {
    "allreduce",
    "ripples_static",
    "ripples_random",
    "ripples_division",
    "ripples_smart",
    "moshpit",
    "none",
  }
  for name in algorithms.hybrid_names():
    validate_dsp_config(hybrid_config(name))
  with pytest.raises(
    ConfigError, match=r"config.replicas.algorithm: 'adpsgd' is not allowed: one of allreduce"
  ):
    validate_dsp_config(hybrid_config("adpsgd"))
  c = hybrid_config("moshpit")
  c.replicas.grid = (3, 2)
  with pytest.raises(ConfigError, match=r"config.replicas.grid: \(3, 2\) is not allowed: .*replicas.count=4"):
    validate_dsp_config(c)


@pytest.mark.parametrize(
  "name,window",
  [pytest.param(n, 0.0, id=n) for n in algorithms.hybrid_names()]
  + [pytest.param("moshpit", 0.004, id="moshpit-window")],  # replicas.window chooses its generator
)
def test_every_group_generator_runs_in_the_hybrid(name, window):
  """The hybrid's generator is the registry's on a replica-sized view: the simulator's generator over R
  workers. Its clock forms groups of it (Division's cover every replica; Moshpit's are its grid's
  lines, with a window some of a line), and the member sets and group sizes the devices and processes
  prepare hold every group."""
  R = 6
  c = hybrid_config(name, R)
  c.replicas.window = window
  validate_dsp_config(c)
  gen = hybrid.make_generator(c)
  trace = clock_lib.simulate_replicas(
    clock_lib.Spec((0.1, 0.12), (4e5, 4e5), R, 300, gen, jitter=0.05, slow=(1, 0))
  )
  groups = [ev[2] for ev in trace.events if ev[1] == clock_lib.AVG]
  if name == "none":
    assert gen is None and not groups and hybrid.member_sets(c, 0) == [] and not hybrid.replica_group_sizes(c)
    return
  assert len(groups) > 10
  sizes = hybrid.replica_group_sizes(c)
  for g in groups:
    assert len(g) in sizes and all(g in hybrid.member_sets(c, m) for m in g)
  if name == "ripples_division":
    assert isinstance(gen, group_gen.division_gg) and gen.n == R
  lines = {tuple(sorted(g)) for layout in grid_layouts((2, 3)) for g in layout}
  if name == "moshpit" and window:
    assert isinstance(gen, group_gen.moshpit_window_gg) and set(groups) - lines  # some of a line
    assert all(any(set(g) <= set(line) for line in lines) for g in groups)
  elif name == "moshpit":
    assert set(groups) <= lines and len(set(groups)) > 2
  if name == "allreduce":
    assert set(groups) == {tuple(range(R))}
