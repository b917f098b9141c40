"""train_and_evaluate(config, workdir): validates, then hands the run to its executor (EXECUTORS).

  spmd                  lockstep rounds on the device mesh (spmd.py)
  sim                   the discrete-event clock, then exact numerics (sim.py)
  async                 one process per worker on jax.distributed: Ripples (runtime/worker.py)
  async/adpsgd          the same runtime, AD-PSGD's active and passive workers (runtime/adpsgd.py)
  async/ps              the same runtime, a parameter server's workers (runtime/ps.py)
  async/coordinator     process 0 of any of them: hosts the service and the authority (PS: the
                        server), trains nothing else (runtime/coordinator.py)
  pipeline              DSP and its baselines in one process (pipeline/train.py)
  pipeline/per_process  one process per stage (pipeline/per_process.py)
  hybrid                R replicas of a pipeline averaging stage by stage in groups, simulated
                        (hybrid/sim.py; a pipeline config with replicas.count > 0)
  hybrid/devices        the same on R x K devices of this process, a thread per replica (hybrid/devices.py)
  hybrid/per_process    the same with a process per (replica, stage) and the coordinator, process 0
                        (hybrid/processes.py)
Executors are peers: none imports another; each writes its files through runlog.RunLog and builds its
inputs with workload.py. A Ripples config (configs/default.py) names its executor; a pipeline config
(configs/dsp.py) has a method and a placement.
"""

import copy
import importlib
import json
import os
import shutil

import jax

from ripples_jax import algorithms
from ripples_jax.errors import ConfigError

# executor -> (module, function(config, workdir) -> summary), imported when a run uses it.
EXECUTORS = {
  "spmd": ("ripples_jax.spmd", "train"),
  "sim": ("ripples_jax.sim", "run"),
  "async": ("ripples_jax.runtime.worker", "run"),
  "async/adpsgd": ("ripples_jax.runtime.adpsgd", "run"),
  "async/ps": ("ripples_jax.runtime.ps", "run"),
  "async/coordinator": ("ripples_jax.runtime.coordinator", "run"),
  "pipeline": ("ripples_jax.pipeline.train", "run"),
  "pipeline/per_process": ("ripples_jax.pipeline.per_process", "run"),
  "hybrid": ("ripples_jax.hybrid.sim", "run"),
  "hybrid/devices": ("ripples_jax.hybrid.devices", "run"),
  "hybrid/per_process": ("ripples_jax.hybrid.processes", "run"),
}


def executor_of(config) -> str:
  """The EXECUTORS key of a config's workers (an async run's process 0 is its coordinator:
  process_executor)."""
  if "method" in config:  # configs/dsp.py
    if config.get("replicas") and config.replicas.count:
      return {"devices": "hybrid/devices", "per_process": "hybrid/per_process"}.get(
        config.placement, "hybrid"
      )
    return "pipeline/per_process" if config.placement == "per_process" else "pipeline"
  role = algorithms.get(config.algorithm).runtime
  if config.executor == "async" and role != algorithms.GROUPS:
    return {algorithms.PAIRS: "async/adpsgd", algorithms.SERVER: "async/ps"}[role]
  return config.executor


def process_executor(config) -> str:
  """The EXECUTORS key this process runs: executor_of, but async/coordinator on an async run's process 0."""
  name = executor_of(config)
  return "async/coordinator" if name.startswith("async") and jax.process_index() == 0 else name


def validate(config) -> None:
  """The config's one-line checks (config.py), before anything loads or compiles."""
  from ripples_jax.config import validate_dsp_config, validate_train_config

  if "method" in config:
    validate_dsp_config(config, num_processes=jax.process_count())
  else:
    validate_train_config(
      config, jax.device_count(), jax.process_count(), jax.local_device_count(), jax.default_backend()
    )


def train_and_evaluate(config, workdir: str | None = None, return_state: bool = False):
  """Runs the config; returns its summary (summary.json's dict) on process 0.

  With `return_state` (Ripples executors), returns (summary, model): the final state as `load(workdir)`
  gives it (per-worker and averaged params and model state, the config), read back from the run's final
  checkpoint (an async run: its final state files), so what is returned is exactly what a later `load`
  returns.
  """
  validate(config)
  name = process_executor(config)
  if return_state and name.startswith("pipeline"):
    raise ConfigError(
      "return_state=True is not allowed with a pipeline config: load() reads Ripples runs "
      "(spmd, sim, async); the pipeline's final parameters are in WORKDIR/snapshots or ckpt"
    )
  if return_state and not name.startswith("async") and not config.checkpoint_every:
    raise ConfigError(
      f"config.checkpoint_every: {config.checkpoint_every} is not allowed with "
      "return_state=True: a positive number of steps (the state comes back from the final "
      "checkpoint)"
    )
  module, fn = EXECUTORS[name]
  summary = getattr(importlib.import_module(module), fn)(config, workdir)
  if not return_state:
    return summary
  return summary, load(summary["workdir"]) if jax.process_index() == 0 else None


def run_fresh(base, out_dir: str, name: str, **overrides):
  """(summary, metrics records) of a fresh run of `base` with dotted-key overrides in out_dir/name (an
  earlier run there is deleted); a diverged run (the NaN stop) is a result, its summary marked
  `diverged` with NaN figures. For experiments that run many configs."""
  config = copy.deepcopy(base)
  config.unlock()
  for k, v in overrides.items():
    node = config
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  workdir = os.path.join(out_dir, name)
  shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
  try:
    summary = train_and_evaluate(config, workdir)
  except FloatingPointError as e:  # a diverged run is a result, not the end of the experiment
    summary = json.load(open(os.path.join(workdir, "config.json")))
    summary.update(
      diverged=str(e), final_test_accuracy=float("nan"), final_train_loss=float("nan"), time=float("nan")
    )
    if "method" in config:  # the pipeline's own figures
      summary.update(
        modeled_speedup_vs_bp=float("nan"),
        stage_forward_s=None,
        stage_backward_s=None,
        stored_bytes=None,
        staleness=None,
      )
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return summary, records


def load(workdir: str, step: int | None = None) -> dict:
  """The trained model back from a run's folder, on this process's first device (any device count).

  Returns {"config", "step", "executor", "params" (per worker, leading worker axis), "params_avg" (the
  workers' average: the model the run evaluates), "model_state" (per worker), "model_state_avg",
  "apply" (x, worker=None) -> logits, "evaluate" (x, y, worker=None) -> {"accuracy", "loss"}}; a
  simulated parameter server's model is its server slot. `step` picks a checkpoint (default: the
  newest that reads back and matches its fingerprint). Ripples executors only (spmd, sim, async).
  """
  import json
  import os

  import ml_collections

  from ripples_jax import checkpoint

  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  if config.executor == "async":
    return _load_async(config, workdir, step)
  mgr = checkpoint.manager(os.path.abspath(os.path.join(workdir, "ckpt")), create=False)
  steps = [step] if step is not None else checkpoint.restorable_steps(mgr)
  if not steps:
    raise FileNotFoundError(f"{workdir}/ckpt: no checkpoint to load")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for s in steps:
    meta = mgr.item_metadata(s)["state"]
    like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    try:
      state, saved = checkpoint.restore(mgr, s, like)
      if saved.get("sums") is not None and checkpoint.fingerprint(state)[0] != saved["sums"]:
        raise checkpoint.CheckpointMismatch("fingerprint mismatch")
      break
    except Exception:  # noqa: BLE001  not usable: the previous one, unless a step was asked for
      if step is not None or s == steps[-1]:
        raise
  mgr.close()
  n = config.num_workers
  has_server = algorithms.get(config.algorithm).clock == algorithms.PS_ASYNC  # the server's slot, n
  rows = slice(n, n + 1) if has_server else slice(0, n)
  params = jax.tree.map(lambda a: a[rows], state["params"])
  model_state = jax.tree.map(lambda a: a[rows], state["model_state"])
  return _model(config, s, params, model_state)


def _model(config, step, params, model_state) -> dict:
  params_avg = jax.tree.map(lambda a: a.mean(0), params)
  model_state_avg = jax.tree.map(lambda a: a.mean(0), model_state)
  module = {}  # the flax module, built on the first call (it needs the dataset's class count)

  def apply(x, worker: int | None = None):
    """Logits of the averaged model (the one the run evaluates), or of one worker's, on a batch x."""
    from ripples_jax import data as data_lib
    from ripples_jax.models import apply_model, build_model

    if not module:
      num_classes = data_lib.load_dataset(config.dataset, data_dir=config.data_dir or None, seed=config.seed)
      module["m"] = build_model(config.model, num_classes["num_classes"])
    p, ms = (
      (params_avg, model_state_avg)
      if worker is None
      else jax.tree.map(lambda a: a[worker], (params, model_state))
    )
    return apply_model(module["m"], p, ms, jax.numpy.asarray(x), train=False)[0]

  def evaluate(x, y, worker: int | None = None) -> dict:
    """{"accuracy", "loss"} of that model on (x, y)."""
    from ripples_jax import losses

    logits = apply(x, worker)
    y = jax.numpy.asarray(y)
    return {"accuracy": float(losses.accuracy(logits, y)), "loss": float(losses.cross_entropy(logits, y))}

  return {
    "config": config,
    "step": step,
    "executor": config.executor,
    "params": params,
    "params_avg": params_avg,
    "model_state": model_state,
    "model_state_avg": model_state_avg,
    "apply": apply,
    "evaluate": evaluate,
  }


def _load_async(config, workdir: str, step) -> dict:
  """An async run's model: each worker's final state (snapshots/final-<w>.npy, what its final marker
  checkpoint holds). Its marker checkpoints are one orbax checkpoint per worker, each writing only its
  own row of (workers, ...) arrays; orbax reads them back inside a run of as many processes (resume),
  not in one process, so `step` is refused here."""
  import os

  import jax.numpy as jnp
  import numpy as np
  from jax.flatten_util import ravel_pytree

  from ripples_jax import workload
  from ripples_jax.models import init_model

  if step is not None:
    raise ValueError(f"load(step={step}): an executor=async run gives back its final state only (step=None)")
  s_ = workload.build(config)
  params, model_state = init_model(s_.model, jax.random.key(config.seed), s_.data["x_train"][:1])
  _, unravel = ravel_pytree({"params": params, "model_state": model_state})
  paths = [os.path.join(workdir, "snapshots", f"final-{w}.npy") for w in range(config.num_workers)]
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise FileNotFoundError(f"{missing[0]}: the run has not finished (no final state)")
  trees = [unravel(jnp.asarray(np.load(p))) for p in paths]
  state = jax.tree.map(lambda *a: jnp.stack(a), *trees)
  return _model(config, None, state["params"], state["model_state"])
