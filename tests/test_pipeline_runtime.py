"""The pipeline's alignment (each stage's gradient is the scheduled batch's) and the multi-process
runtime (pipeline/per_process.py) against the single-process tick: numerics, a killed stage, resume."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ripples_jax.pipeline import tick as tick_lib
from ripples_jax.pipeline.baselines import compose
from tests.fakes import start_directly
from tests.test_pipeline_dsp import B, mlp_stages
from tests.test_runtime import launch_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recorder():
  """An optax 'optimizer' that applies nothing and keeps the last gradient it was given: with the
  parameters fixed, every stage's gradient at any tick must be BP's gradient of one batch."""
  return optax.GradientTransformation(
    init=lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
    update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
  )


ALIGNED = [("dsp", mode, delay) for mode in ("recompute", "stash") for delay in (1, 2)] + [
  ("pipedream", None, 1),
  ("pipemare", None, 1),
]


@pytest.mark.parametrize(
  "method,mode,delay",
  [a if a == ("dsp", "recompute", 1) else pytest.param(*a, marks=pytest.mark.slow) for a in ALIGNED],
)
def test_each_stage_gets_the_bp_gradient_of_its_scheduled_batch(method, mode, delay):
  K, n = 3, 12
  stages = mlp_stages(K)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(n, B, 8)).astype(np.float32)
  ys = rng.integers(0, 4, size=(n, B)).astype(np.int32)
  # pipemare: with nothing applied its moving average stays 0, so the corrected weights are the
  # forward's and its gradients must be BP's too (its correction is checked in test_pipeline_dsp).
  schedule = tick_lib.method_schedule(method, K, delay, mode, lr_anneal=5)
  state = tick_lib.init_pipeline(stages, recorder(), schedule, jax.random.key(0), xs[0])
  params_K = jax.tree.map(np.array, [st["params"] for st in state])  # the tick donates its state
  ms_K = jax.tree.map(np.array, [st["model_state"] for st in state])

  def bp_grads(i):
    def loss(params):
      logits, _ = compose(stages, params, ms_K, xs[i], train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, ys[i]).mean()

    return jax.grad(loss)(params_K)

  step = tick_lib.make_tick(stages, recorder(), schedule, n)
  offset = schedule.offsets[-1]
  checked = 0
  for t in range(n + schedule.drain_ticks()):
    x_t = xs[t] if t < n else np.zeros_like(xs[0])
    state, _ = step(state, x_t, ys[max(t - offset, 0) % n], t)
    for k, (_, bwd) in enumerate(schedule.batches(t)):
      if 0 <= bwd < n:  # this tick's backward at stage k was of batch `bwd`: BP's gradient of it
        want = bp_grads(bwd)[k]
        got = state[k]["opt_state"]["g"]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        checked += 1
  assert checked == K * n


# ---------------------------------------------------------------------------------------------------
# The multi-process runtime: 2 processes, one stage each.


def pipeline_config(method, mode="recompute", delay=1, epochs=1, extra=()):
  return [
    f"--config=configs/dsp.py:method={method},num_stages=2,mode={mode},delay={delay},epochs={epochs}",
    "--config.placement=per_process",
    "--config.runtime.heartbeat_timeout=5",
    "--config.runtime.stall_timeout=30",
    "--config.log_every=31",
    "--config.eval_every=62",
    "--config.checkpoint_every=0",
    *extra,
  ]


def single_process_params(method, mode, delay, epochs=1, split_of=None):
  """Every stage's flat parameters after the run of the same config in one process (the tick), on
  the split the run in workdir `split_of` used (its split.json: a split balances each method's own
  work, so a residual-mode run and its stash-mode reference may split apart otherwise).

  It runs in a process of its own without this one's forced device count: with 8 forced CPU devices
  XLA compiles the tick to other float orders (a few 1e-9), and at link delay 2 one ReLU that flips
  at tick 18 of the residual run grows that to 4e-3 by the end. The stage processes match a plain
  process bit for bit."""
  code = (
    "import sys, numpy as np\n"
    "from jax.flatten_util import ravel_pytree\n"
    "from configs import dsp as dsp_config\n"
    "from ripples_jax.pipeline import train as pipeline_train\n"
    "from ripples_jax.pipeline.baselines import schedule_of\n"
    f"config = dsp_config.get_config('method={method},num_stages=2,mode={mode},delay={delay},epochs={epochs}')\n"
    "stages, state, run = pipeline_train._setup(config, sys.argv[2])\n"
    "sch = schedule_of(config)\n"
    "drain, offset = (sch.drain_ticks(), sch.offsets[-1]) if sch else (0, 0)\n"
    "for t in range(run['num_batches'] + drain):\n"
    "  state, _ = run['step'](state, run['feed'].x(t), run['feed'].labels(t - offset), t)\n"
    "np.savez(sys.argv[1], *[np.asarray(ravel_pytree(st['params'])[0]) for st in state])\n"
  )
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "params.npz")
    if split_of is not None:
      shutil.copy(os.path.join(split_of, "split.json"), tmp)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
      [sys.executable, "-c", code, path, tmp], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with np.load(path) as z:
      return [z[f"arr_{k}"] for k in range(len(z.files))]


def launch_pipeline(args, timeout_s=300):
  return launch_bounded(2, args, timeout_s=timeout_s, module="experiments.train_dsp")


def final_params(workdir):
  return [np.load(os.path.join(workdir, "snapshots", f"final-{k}.npy")) for k in range(2)]


# (method, runtime mode, delay, the single-process run it must equal: method, mode)
NIGHTLY = (pytest.mark.slow, pytest.mark.nightly)  # each its own two-process launch: nightly tier
# The slow tier keeps one case each of link delay 2 with slack, stashed residuals, and a flush (GPipe).
CASES = [
  pytest.param("dsp", "recompute", 1, ("dsp", "recompute"), id="dsp-recompute", marks=NIGHTLY),
  # Delay 2's slack (a transfer waited for a tick late) has its unit test (fake_stage); the run: nightly.
  pytest.param("dsp", "recompute", 2, ("dsp", "recompute"), id="dsp-recompute-d2", marks=NIGHTLY),
  pytest.param("dsp", "fused", 1, ("dsp", "recompute"), id="dsp-fused", marks=NIGHTLY),
  pytest.param("dsp", "fused", 2, ("dsp", "recompute"), id="dsp-fused-d2", marks=NIGHTLY),
  pytest.param("dsp", "residuals", 1, ("dsp", "stash"), id="dsp-residuals", marks=pytest.mark.slow),
  pytest.param("dsp", "residuals", 2, ("dsp", "stash"), id="dsp-residuals-d2", marks=NIGHTLY),
  pytest.param("fr", "recompute", 1, ("fr", "recompute"), id="fr", marks=NIGHTLY),
  pytest.param("ddg", "recompute", 1, ("ddg", "recompute"), id="ddg", marks=NIGHTLY),
  pytest.param("pipedream", "recompute", 1, ("pipedream", "recompute"), id="pipedream", marks=NIGHTLY),
  pytest.param("pipemare", "recompute", 1, ("pipemare", "recompute"), id="pipemare", marks=NIGHTLY),
  pytest.param("bp", "recompute", 1, ("bp", "recompute"), id="bp", marks=NIGHTLY),
  pytest.param("gpipe", "recompute", 1, ("gpipe", "recompute"), id="gpipe", marks=pytest.mark.slow),
]


def fake_stage(schedule, k: int, slack: bool = True):
  """Links' logic alone (no devices, no processes): a stand-in whose link threads hand out
  futures that the test resolves, and whose clock records every wait for one."""
  import concurrent.futures
  import types

  from ripples_jax.pipeline import per_process

  posted, waits = [], []

  class Thread:
    def post(self, kind, x=None):
      posted.append((kind, concurrent.futures.Future()))
      return posted[-1][1]

  run = lambda kind, fn, *a: (waits.append(kind), fn(*a))[1]  # noqa: E731
  stage = types.SimpleNamespace(
    schedule=schedule,
    k=k,
    last=k == schedule.num_stages - 1,
    lower_t=Thread() if k > 0 else None,
    upper_t=Thread() if k < schedule.num_stages - 1 else None,
    clock=types.SimpleNamespace(run=run),
    slack=slack,
  )
  for name in ("post", "wait", "slot", "load_slots", "advance"):
    setattr(stage, name, getattr(per_process.Links, name).__get__(stage))
  return stage, posted, waits


def test_with_link_delay_2_a_tick_waits_only_for_the_transfer_of_two_ticks_before():
  """Slack: each FIFO slot holds the transfer that fills it until a tick reads it. With delay 2, tick
  t reads tick t - 2's transfer, so the transfer of tick t - 1 may still be in flight (the neighbour
  a tick behind) and nothing is waited for when a tick's output is posted."""
  schedule = tick_lib.method_schedule("dsp", 2, 2, "recompute")
  stage, posted, waits = fake_stage(schedule, 0)
  stage.load_slots({"bwd_fifo": jnp.stack([jnp.zeros(2), jnp.ones(2)])})
  stage.advance(jnp.full(2, 5.0), None)  # end of tick 0: its output goes up, a gradient comes
  assert [kind for kind, _ in posted] == ["swap"] and not waits  # posted, not waited for
  np.testing.assert_array_equal(stage.slot(stage.bwd_slots), jnp.ones(2))  # tick 1 reads the FIFO's
  assert not waits
  stage.advance(jnp.full(2, 6.0), None)  # end of tick 1
  posted[0][1].set_result(jnp.full(2, 7.0))  # tick 0's transfer lands; tick 1's is still in flight
  np.testing.assert_array_equal(stage.slot(stage.bwd_slots), jnp.full(2, 7.0))  # tick 2 reads tick 0's
  assert waits == ["link"] and not posted[1][1].done()
  # Without slack (runtime.slack=False: lockstep) every transfer is waited for as it is posted.
  stage, posted, waits = fake_stage(schedule, 1, slack=False)
  stage.load_slots({"fwd_fifo": jnp.stack([jnp.zeros(2), jnp.ones(2)])})
  stage.lower_t.post = lambda kind, x=None, f=stage.lower_t.post: (f(kind, x), posted[-1][1].set_result(x))[0]
  stage.advance(None, jnp.full(2, 3.0))
  assert [kind for kind, _ in posted] == ["swap"] and waits == ["link"]


@pytest.mark.parametrize("method,mode,delay,reference", CASES)
def test_two_process_pipeline_equals_the_single_process_tick(tmp_path, method, mode, delay, reference):
  workdir = str(tmp_path / "run")
  code, out = launch_pipeline(pipeline_config(method, mode, delay) + [f"--workdir={workdir}"])
  assert code == 0, out[-3000:]
  want = single_process_params(reference[0], reference[1], delay, split_of=workdir)
  for k, (got, ref) in enumerate(zip(final_params(workdir), want)):
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=f"stage {k}")


def start_stages_directly(args):
  """Both stage processes without the launcher (as on a cluster), so that nothing but the survivor's
  own watchdog can stop it; returns the Popen objects, stderr merged into stdout."""
  return start_directly(2, "experiments.train_dsp", args)


# Nightly (36 s): a killed stage process and its resume stay in the README's tier through
# tests/test_hybrid_processes.py's killed run, whose stages are this runtime's Stage.
@pytest.mark.slow
@pytest.mark.nightly
def test_killed_stage_is_named_and_the_rerun_resumes_the_same_numerics(tmp_path):
  workdir = str(tmp_path / "run")
  args = pipeline_config("dsp", "recompute", 1, epochs=2, extra=["--config.checkpoint_every=31"]) + [
    f"--workdir={workdir}"
  ]
  # Stage 1 SIGKILLs itself before tick 70, once its checkpoint of batch 62 has committed.
  procs = start_stages_directly(args + ["--config.runtime.fail_stage=1", "--config.runtime.fail_tick=70"])
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert procs[1].returncode == -signal.SIGKILL, outs[1][-3000:]
  assert "kills itself at local step 70" in outs[1], outs[1][-3000:]
  named = [l for l in outs[0].splitlines() if "stage(s) [1] lost" in l]
  assert procs[0].returncode == 75 and len(named) == 1, outs[0][-3000:]
  assert not os.path.exists(os.path.join(workdir, "snapshots", "final-0.npy"))
  # The same command again: every stage resumes after batch 62 (tick 64: drain 2), and ends bit for bit
  # where an uninterrupted run of the same processes does.
  code, out = launch_pipeline(args)
  assert code == 0, out[-3000:]
  assert "resuming at tick 64" in out, out[-3000:]
  whole = str(tmp_path / "whole")
  code, out = launch_pipeline([a for a in args if not a.startswith("--workdir")] + [f"--workdir={whole}"])
  assert code == 0, out[-3000:]
  for k, (got, ref) in enumerate(zip(final_params(workdir), final_params(whole))):
    np.testing.assert_array_equal(got, ref, err_msg=f"stage {k}")


CHUNKED = [  # (method, runtime mode, the single-process run it must equal: method, mode)
  ("dsp", "residuals", ("dsp", "stash")),
  ("dsp", "recompute", ("dsp", "recompute")),
  ("fr", "recompute", ("fr", "recompute")),
  ("pipemare", "recompute", ("pipemare", "recompute")),
]


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("method,mode,reference", CHUNKED, ids=[f"{m}-{mode}" for m, mode, _ in CHUNKED])
def test_chunked_calls_keep_the_numerics(tmp_path, method, mode, reference):
  """chunks=4: every stage's calls over four chunks of the batch (residuals: each chunk's vjp;
  recompute: each chunk's recompute and vjp; pipemare: each chunk's kept activations and backward);
  the parameters still equal the unchunked single-process tick's (the same gradients, summed in
  another order; rtol 2e-4, atol 2e-5 as the unchunked runs)."""
  workdir = str(tmp_path / "run")
  code, out = launch_pipeline(
    pipeline_config(method, mode, 1, extra=["--config.chunks=4"]) + [f"--workdir={workdir}"]
  )
  assert code == 0, out[-3000:]
  for k, (got, ref) in enumerate(
    zip(final_params(workdir), single_process_params(*reference, 1, split_of=workdir))
  ):
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=f"stage {k}")


def test_a_slow_stage_pads_each_compute_call_inside_its_time(monkeypatch):
  """Stragglers inside compute: on a slow tick each compute call sleeps (s - 1) times its own length
  before it returns, so the padding is in the call's recorded time and before anything is sent; link
  waits are not padded. The draw is a function of (seed, tick, stage) only: every method alike."""
  import types

  from ripples_jax.pipeline import per_process

  now, slept = [0.0], []

  def sleep(d):
    slept.append(d)
    now[0] += d

  monkeypatch.setattr(per_process, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep))
  clock = per_process.Clock()
  clock.memory["forward"] = clock.memory["link"] = None  # no ahead-of-time compile here

  def call(seconds):
    now[0] += seconds
    return jnp.zeros(1)

  clock.slow = 3.0
  clock.run("forward", call, 0.5)
  clock.run("link", call, 0.25)
  assert slept == [1.0] and clock.calls["forward"] == [1.5] and clock.calls["link"] == [0.25]
  c = types.SimpleNamespace(slowdown=3.0, straggler_stage=1, straggler_p=0.0, seed=0)
  assert [per_process.slow_factor(c, k, 7) for k in range(3)] == [1.0, 3.0, 1.0]
  c.straggler_p = 0.2
  hits = [per_process.slow_factor(c, k, t) == 3.0 for t in range(2000) for k in range(2)]
  assert 0.17 < np.mean(hits) < 0.23
  assert hits == [per_process.slow_factor(c, k, t) == 3.0 for t in range(2000) for k in range(2)]
