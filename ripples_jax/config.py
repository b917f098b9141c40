"""Configs: the `:k=v` variant parser, and the one place that checks a run's config before anything
is loaded or compiled.

Every problem is reported as one line: `config.<key>: <value> is not allowed: <what is>`. The allowed
values are imported from the modules that own them (a new model, dataset or method is allowed as soon
as its owner lists it); this module adds only the cross-field rules.
"""

import ast
import math

import ml_collections

from ripples_jax import algorithms
from ripples_jax.algorithms import STATIC_LAYOUTS
from ripples_jax.data import DATASET_NAMES as DATASETS
from ripples_jax.data import SHARD_MODES as DATA_SHARDINGS
from ripples_jax.distributed.host import collective_timeout_s
from ripples_jax.engine import PREDUCE_IMPLS
from ripples_jax.errors import ON_CONFIG_CHANGE, ConfigError  # noqa: F401  (re-exported)
from ripples_jax.models import MODEL_NAMES
from ripples_jax.models.split import SPLIT_COSTS
from ripples_jax.optim import LR_SCHEDULES, OPTIMIZERS
from ripples_jax.pipeline import methods
from ripples_jax.pipeline.methods import PLACEMENTS
from ripples_jax.pipeline.tick import MODES
from ripples_jax.schedule.online import ADPSGD_PASSIVE, PREDUCE_MODES
from ripples_jax.timeline.ps_async import STALENESS

EXECUTORS = ("spmd", "sim", "async")  # a Ripples config's executor (run.EXECUTORS holds them all)
# The heterogeneity settings with their "off" values; only the clocked executors (sim, async) use them.
_HETERO_OFF = {"slow_workers": (), "slowdown": 1.0, "random_p": 0.0, "jitter": 0.0, "rotate_every": 0.0}


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k=v,k2=v2' (the part after ':' in --config=configs/x.py:k=v) into typed fields.

  Values are parsed as python literals where possible and otherwise kept as strings; keys must be among
  `defaults`, and each value must have its default's type (an int where a float goes is fine). A bad
  item raises ConfigError naming it: `config:<key>: <value> is not allowed: <what is>`.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  keys = ", ".join(sorted(defaults))
  for item in arg.split(","):
    if not item:
      continue
    if "=" not in item:
      raise ConfigError(f"config:{item}: {item!r} is not allowed: a variant key=value, keys {keys}")
    key, text = item.split("=", 1)
    if key not in defaults:
      raise ConfigError(f"config:{key}: {key!r} is not allowed: a variant key, one of {keys}")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
      value = text
    default = defaults[key]
    kind = type(default)
    if not (type(value) is kind or (kind is float and type(value) is int)):
      raise ConfigError(
        f"config:{key}: {value!r} is not allowed: {_TYPE_NAMES.get(kind, kind.__name__)} "
        f"like its default {default!r}"
      )
    out[key] = value
  return out


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}

# While not None, every check a validator makes on a key is noted here as (key, allowed): the config
# reference (config_doc) is read off the validators themselves, so it lists what they enforce.
_notes: list | None = None


def noting_checks(validate, config, *args, **kwargs) -> list:
  """Runs `validate(config, ...)` and returns the (key, allowed) of every check it made, in order."""
  global _notes
  _notes = []
  try:
    validate(config, *args, **kwargs)
    return _notes
  finally:
    _notes = None


def _note(key, allowed):
  if _notes is not None:
    _notes.append((key, allowed))


def _fail(key, value, allowed):
  raise ConfigError(f"config.{key}: {value!r} is not allowed: {allowed}")


def _bool(config, key):
  _note(key, "True or False")
  if not isinstance(_get(config, key), bool):
    _fail(key, _get(config, key), "True or False")


def _one_of(config, key, allowed):
  _note(key, "one of " + ", ".join(map(str, allowed)))
  value = _get(config, key)
  if value not in allowed:
    _fail(key, value, "one of " + ", ".join(map(str, allowed)))


def _get(config, key):
  for part in key.split("."):
    config = config[part]
  return config


def _positive_int(config, key):
  _note(key, "a positive integer")
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    _fail(key, value, "a positive integer")


def validate_train_config(
  config, num_devices: int, num_processes: int = 1, local_devices: int | None = None, platform: str = "cpu"
) -> None:
  """Raises ConfigError naming the first bad key of an experiments.train config (`platform`: the
  devices' platform, jax.default_backend())."""
  _one_of(config, "executor", EXECUTORS)
  _note("profile_steps", "'' or 'a:b' with 0 <= a < b (steps [a, b) traced; executor=spmd)")
  _note("data_dir", "a path; dataset=cifar10 needs the directory holding data_batch_1..5 and test_batch")
  if config.get("profile_steps"):
    from ripples_jax.profiling import parse

    try:
      parse(config.profile_steps)
    except ValueError:
      _fail("profile_steps", config.profile_steps, "'a:b' with 0 <= a < b (steps [a, b) are traced), or ''")
    if config.executor != "spmd":
      _fail("profile_steps", config.profile_steps, f"'' with executor={config.executor} (profiling: spmd)")
  _check_algorithm(config)
  _one_of(config, "dataset", DATASETS)
  if "mnist1d_samples" in config:
    _int_in(config, "mnist1d_samples", 100, 10**8, "an integer number of examples in [100, 1e8]")
  _one_of(config, "model", MODEL_NAMES)
  _one_of(config, "data_sharding", DATA_SHARDINGS)
  _one_of(config, "preduce_impl", PREDUCE_IMPLS)
  for key in ("num_workers", "batch_size", "num_steps", "log_every", "eval_every", "checkpoint_keep"):
    _positive_int(config, key)
  _int_in(config, "checkpoint_every", 0, 10**9, "an integer number of steps >= 0 (0: no checkpoints)")
  _int_in(config, "seed", 0, 2**32 - 1, "an integer in [0, 2**32)")
  if "stuck_timeout_s" in config:  # the collective guard stays under XLA's own 40 s abort to speak first
    _number(config, "stuck_timeout_s", lambda v: v == 0 or 0 < v < 40, "seconds in (0, 40), or 0 (off)")
  n = config.num_workers
  if config.executor == "spmd" and n > num_devices and n % num_devices:  # the simulator uses one device
    _fail("num_workers", n, f"at most the {num_devices} devices or a multiple of {num_devices}")
  if config.preduce_impl == "collective" and n > num_devices:
    _fail("preduce_impl", "collective", f"needs one device per worker ({n} workers, {num_devices} devices)")
  if config.dataset == "cifar10" and not config.data_dir:
    _fail("data_dir", config.data_dir, "cifar10 needs the directory holding data_batch_1..5 and test_batch")

  if config.executor == "async":
    if n != num_processes - 1:
      _fail(
        "num_workers",
        n,
        f"the number of worker processes ({num_processes - 1} of {num_processes}: process 0 is the "
        "coordinator) with executor=async (one process per worker and a coordinator: "
        "experiments.launch --num_processes=<workers> starts both; on a cluster, --jax_distributed "
        "with num_workers + 1 processes)",
      )
    # elastic: a worker's life runs on one of its process's devices (runtime/membership.py)
    local = 1 if config.runtime.get("elastic") is True else (local_devices or 1)
    if config.batch_size % local:
      _fail("batch_size", config.batch_size, f"a multiple of the {local} devices of each worker")
    _check_runtime(config)
    if config.runtime.get("elastic") is True and platform != "cpu":
      _fail("runtime.elastic", True, f"False on platform {platform}: {ELASTIC_CPU_ONLY}")
  elif config.get("runtime") is not None and config.runtime.get("elastic"):
    _fail(
      "runtime.elastic",
      config.runtime.elastic,
      f"False with executor={config.executor} (elastic membership is the runtime's, executor=async; the "
      "simulator's is hetero.leave)",
    )

  _check_optimizer(config)
  if "on_config_change" in config:
    _one_of(config, "on_config_change", ON_CONFIG_CHANGE)
  _check_schedule(config, n)


# Which executors run which algorithm: an algorithm another executor runs is named with that executor.
ALGORITHMS_OF = {e: algorithms.names(e) for e in ("sim", "spmd", "async")}


def _check_algorithm(config):
  here, value = ALGORITHMS_OF[config.executor], config.algorithm
  _note("algorithm", "one of " + ", ".join(here))
  if value in here:
    return
  elsewhere = [e for e, algs in ALGORITHMS_OF.items() if value in algs]
  if elsewhere:
    needs = " or ".join(f"executor={e}" for e in elsewhere)
    _fail(
      "algorithm", value, f"one of {', '.join(here)} with executor={config.executor}; {value} needs {needs}"
    )
  _fail("algorithm", value, "one of " + ", ".join(here))


def _check_runtime(config):
  rt = config.runtime
  for key in ("checkpoint_keep", "cache_size", "warmup_steps"):
    _positive_int(config, f"runtime.{key}")
  _int_in(config, "runtime.checkpoint_every", 0, 10**9, "an integer >= 0")
  _int_in(
    config,
    "runtime.fail_worker",
    -1,
    config.num_workers - 1,
    f"-1 (none) or a worker id < num_workers={config.num_workers}",
  )
  _int_in(config, "runtime.fail_step", 0, 10**9, "an integer >= 0")
  _one_of(config, "runtime.fail_where", FAIL_WHERE)
  _check_elastic(config)
  _one_of(config, "runtime.adpsgd_passive", ADPSGD_PASSIVE)
  _one_of(config, "runtime.preduce", PREDUCE_MODES)
  _number(config, "runtime.step_time", lambda v: v >= 0, "seconds >= 0 (0: no padding)")
  _number(config, "runtime.heartbeat_s", lambda v: v > 0, "seconds > 0")
  _number(config, "runtime.heartbeat_timeout", lambda v: v > 0, "seconds > 0")
  _number(config, "runtime.stall_timeout", lambda v: v > 0, "seconds > 0")
  if not rt.heartbeat_timeout > 2 * rt.heartbeat_s:
    _fail(
      "runtime.heartbeat_timeout", rt.heartbeat_timeout, f"seconds > 2 x runtime.heartbeat_s={rt.heartbeat_s}"
    )
  if not rt.stall_timeout > rt.heartbeat_timeout:
    _fail(
      "runtime.stall_timeout", rt.stall_timeout, f"seconds > runtime.heartbeat_timeout={rt.heartbeat_timeout}"
    )
  # Elastic: an exchange with a stalled worker fails only after the collective timeout (2 x
  # heartbeat_timeout: host.recoverable), and the survivors complete nothing while they wait in it; a
  # shorter stall_timeout ends the whole run as stuck before the exchange can fail.
  if rt.get("elastic") is True and not rt.stall_timeout > collective_timeout_s(rt):
    _fail(
      "runtime.stall_timeout",
      rt.stall_timeout,
      f"seconds > 2 x runtime.heartbeat_timeout={rt.heartbeat_timeout} with runtime.elastic (the collective "
      "timeout: the survivors wait that long in an exchange with a stalled worker)",
    )
  _check_timeout_fits_steps(config)


def _check_timeout_fits_steps(config) -> None:
  """Elastic: a live worker waits in an exchange for its partner's step to end, up to one step of the
  slowest worker (runtime.step_time x hetero.slowdown, the padded step a run declares); a collective
  timeout (2 x heartbeat_timeout) that is not twice that would break pairs of live workers for good.
  Unpadded steps (step_time 0) are checked against the measured warm-up step (runtime/process.py)."""
  rt, h = config.runtime, config.get("hetero")
  if rt.get("elastic") is not True or not rt.step_time:
    return
  slow = h is not None and (tuple(h.get("slow_workers", ())) or h.get("random_p", 0.0) > 0)
  factor = float(h.get("slowdown", 1.0)) if slow else 1.0
  slowest = rt.step_time * factor
  if not collective_timeout_s(rt) > 2 * slowest:
    _fail(
      "runtime.heartbeat_timeout",
      rt.heartbeat_timeout,
      f"seconds > {slowest:g} with runtime.elastic: its collective timeout (2 x it) must exceed twice the "
      f"slowest worker's step (runtime.step_time={rt.step_time:g} x hetero.slowdown={factor:g}), or a live "
      "worker's partner times out waiting for it",
    )


# Why elastic runs on the CPU only (docs/design.md 3.12).
ELASTIC_CPU_ONLY = (
  "elastic membership needs a collective with a dead member to fail and be cancelled, which the CPU's "
  "gloo does (jax_enable_recoverability) and NCCL does not here: the survivors would hang in it; run it "
  "with JAX_PLATFORMS=cpu, or use the launcher's --max_restarts without elastic"
)
FAIL_WHERE = ("step", "preduce", "slow")


def _check_elastic(config):
  rt = config.runtime
  if "elastic" not in rt:
    return
  _bool(config, "runtime.elastic")
  if "consensus_allreduce" in rt:
    _bool(config, "runtime.consensus_allreduce")
    if rt.consensus_allreduce and rt.elastic:
      _fail(
        "runtime.consensus_allreduce",
        True,
        "False with runtime.elastic (an elastic run's last members are not known before its end)",
      )
  if rt.fail_where in ("preduce", "slow") and not rt.elastic:
    _fail(
      "runtime.fail_where",
      rt.fail_where,
      f"step without runtime.elastic ({rt.fail_where} needs runtime.elastic=True)",
    )
  if not rt.elastic:
    return
  if rt.fail_where == "slow" and config.algorithm == "adpsgd":
    _fail(
      "runtime.fail_where", "slow", "step or preduce with algorithm=adpsgd (slow: the authority's groups)"
    )
  why = algorithms.get(config.algorithm).no_elastic  # docs/design.md 3.12
  if why:
    _fail("runtime.elastic", True, f"False with algorithm={config.algorithm}: {why}")
  if rt.preduce == "group":
    _fail(
      "runtime.preduce",
      rt.preduce,
      "pairs or auto with runtime.elastic (pairs are connected before the run, so an exchange with a "
      "dead worker fails at once; a group's first use waits 30 s for it)",
    )


def _check_optimizer(config):
  _one_of(config, "optimizer.name", OPTIMIZERS)
  _one_of(config, "optimizer.lr_schedule", LR_SCHEDULES)
  _number(config, "optimizer.lr", lambda v: v > 0, "a finite number > 0")
  _number(config, "optimizer.momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
  _number(config, "optimizer.weight_decay", lambda v: v >= 0, "a number >= 0")
  _int_in(config, "optimizer.warmup_steps", 0, 10**9, "an integer >= 0")
  for key in ("b1", "b2"):  # absent from a DSP config: optim.ADAM_DEFAULTS
    if key in config.optimizer:
      _number(config, f"optimizer.{key}", lambda v: 0 <= v < 1, "a number in [0, 1)")
  if "eps" in config.optimizer:
    _number(config, "optimizer.eps", lambda v: v > 0, "a finite number > 0")
  if "schedule_steps" in config.optimizer:
    _int_in(config, "optimizer.schedule_steps", 0, 10**12, "an integer >= 0 (0: num_steps)")


def _check_schedule(config, n):
  """Raises ConfigError at the first bad key that depends on the algorithm or the executor: the
  algorithm's schedule, the clock's keys (or, without a clock, hetero.* off), hetero.leave, and how a
  run ends. The order of the checks is the order of the errors and of the notes."""
  _check_schedule_keys(config, n)
  if config.executor in ("sim", "async"):
    _check_hetero(config, n)
    _check_timeline(config)
    _number(config, "time_budget", lambda v: v >= 0, "seconds >= 0 (0: no budget)")
    _number(config, "target_accuracy", lambda v: 0 <= v <= 1, "a fraction in [0, 1] (0: none)")
  else:  # the lockstep executor has no clock: heterogeneity would be silently ignored
    _check_hetero_off(config)
  _check_leave(config, n)
  _check_run_end(config)


def _check_schedule_keys(config, n):
  """Raises ConfigError for a bad schedule.* key of the configured algorithm (the group layout or
  size, the smart schedule's bounds), or too few workers for adpsgd / ps_async."""
  a = algorithms.get(config.algorithm)
  for key in a.keys:  # the keys the algorithm's record says it reads
    _KEY_CHECKS[key](config, n)
  if n < a.min_workers:
    _fail("num_workers", n, f"at least {a.min_workers} for {config.algorithm}")


def _check_layout(config, n):
  s = config.schedule
  _one_of(config, "schedule.layout", STATIC_LAYOUTS)
  if s.layout == "node":
    _int_in(config, "schedule.workers_per_node", 1, n, f"an integer group size in [1, num_workers={n}]")
    return
  g = s.hypercube_group_size
  _int_in(config, "schedule.hypercube_group_size", 2, n, f"an integer group size in [2, num_workers={n}]")
  m = 1
  while m < n:
    m *= g
  if m != n:
    _fail("num_workers", n, f"a power of schedule.hypercube_group_size={g} for the hypercube layout")


_TOLERANCE = "a number > 0 (a fraction of a step time)"
# How each key an algorithm's record names is checked, (config, num_workers) -> None or ConfigError.
_KEY_CHECKS = {
  "schedule.layout": _check_layout,
  "schedule.group_size": lambda c, n: _int_in(
    c, "schedule.group_size", 2, n, f"an integer group size in [2, num_workers={n}]"
  ),
  "schedule.request_ahead": lambda c, n: _bool(c, "schedule.request_ahead"),
  "schedule.smart_tolerance": lambda c, n: _number(
    c, "schedule.smart_tolerance", lambda v: v > 0, _TOLERANCE
  ),
  "schedule.smart_max_gap": lambda c, n: _int_in(c, "schedule.smart_max_gap", 0, 10**9, "an integer >= 0"),
  "schedule.smart_fresh": lambda c, n: _bool(c, "schedule.smart_fresh"),
  "diloco.inner_steps": lambda c, n: _positive_int(c, "diloco.inner_steps"),
  "diloco.outer_lr": lambda c, n: _number(c, "diloco.outer_lr", lambda v: v > 0, "a finite number > 0"),
  "diloco.outer_momentum": lambda c, n: _number(
    c, "diloco.outer_momentum", lambda v: 0 <= v < 1, "a number in [0, 1)"
  ),
  "moshpit.grid": lambda c, n: _check_grid(c, n),
  "moshpit.window": lambda c, n: _number(c, "moshpit.window", lambda v: v >= 0, "seconds >= 0 (0: lockstep)"),
  "moshpit.max_gap": lambda c, n: _int_in(c, "moshpit.max_gap", 0, 10**9, "an integer >= 0"),
  "ps.staleness": lambda c, n: _check_staleness(c),
  "ps.server_momentum": lambda c, n: _number(
    c, "ps.server_momentum", lambda v: 0 <= v < 1, "a number in [0, 1)"
  ),
}

_SGD = ("sgd", "momentum", "nesterov")


def _check_staleness(config):
  """ps.staleness: one of STALENESS; divide scales each gradient, which an SGD optimizer turns into its
  step (adam's normalization would undo most of it)."""
  _one_of(config, "ps.staleness", STALENESS)
  if config.ps.staleness == "divide" and config.optimizer.name not in _SGD:
    _fail(
      "ps.staleness",
      "divide",
      f"none with optimizer.name={config.optimizer.name} (divide scales a gradient, which only an SGD "
      f"optimizer's step keeps: {', '.join(_SGD)})",
    )


def _check_grid(config, n):
  """moshpit.grid: a tuple of integers >= 2 whose product is num_workers (every worker on the grid)."""
  allowed = f"a tuple of integers >= 2 whose product is num_workers={n}, e.g. (2, 4) for 8"
  _note("moshpit.grid", allowed)
  grid = config.moshpit.grid
  if not isinstance(grid, (tuple, list)) or not grid:
    _fail("moshpit.grid", grid, allowed)
  if any(isinstance(g, bool) or not isinstance(g, int) or g < 2 for g in grid) or math.prod(grid) != n:
    _fail("moshpit.grid", grid, allowed)


def _check_hetero(config, n):
  """Raises ConfigError for a bad hetero.* key of a clocked executor (sim or async): slow worker ids
  below num_workers, a slowdown >= 1, a probability, a jitter and a rotation period >= 0."""
  h = config.hetero
  ids = tuple(h.slow_workers)
  for w in ids:
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n:
      _fail("hetero.slow_workers", ids, f"worker ids in [0, num_workers={n})")
  _number(config, "hetero.slowdown", lambda v: v >= 1, "a factor >= 1")
  _number(config, "hetero.random_p", lambda v: 0 <= v <= 1, "a probability in [0, 1]")
  _number(config, "hetero.jitter", lambda v: v >= 0, "a lognormal sigma >= 0")
  _number(config, "hetero.rotate_every", lambda v: v >= 0, "seconds >= 0 (0: the slow workers stay)")


def _check_timeline(config):
  """Raises ConfigError for a bad timeline.* key of a clocked executor: the simulated costs (seconds,
  bytes, bandwidths) and switches, and a detection delay only where a Group Buffer is modelled."""
  _number(config, "timeline.request_rtt", lambda v: v >= 0, "seconds >= 0")
  _number(config, "timeline.authority_service", lambda v: v >= 0, "seconds >= 0")
  _number(config, "timeline.group_setup", lambda v: v >= 0, "seconds >= 0")
  _one_of(config, "timeline.setup_unit", ("group", "pair"))
  if "detect_s" in config.timeline:
    _number(config, "timeline.detect_s", lambda v: v >= 0, "seconds >= 0")
    if config.timeline.detect_s and config.algorithm in ("adpsgd", "ps_async"):
      _fail(
        "timeline.detect_s",
        config.timeline.detect_s,
        f"0 with algorithm={config.algorithm} (it models the Group Buffer's removal)",
      )
  _number(config, "timeline.adpsgd_fixed_cost", lambda v: v >= 0, "seconds >= 0")
  _number(config, "timeline.adpsgd_hidden", lambda v: 0 <= v <= 1, "a share in [0, 1]")
  for key in ("adpsgd_serial", "adpsgd_passive_blocks"):
    _bool(config, f"timeline.{key}")
  _number(config, "timeline.compute_time", lambda v: v >= 0, "seconds >= 0 (0: measure the real jitted step)")
  for key in ("alpha", "model_bytes"):
    _number(config, f"timeline.{key}", lambda v: v >= 0, "a number >= 0")
  for key in ("bandwidth", "ps_bandwidth"):
    _number(config, f"timeline.{key}", lambda v: v > 0, "a number > 0")
  if "overlap" in config.timeline:
    _number(config, "timeline.overlap", lambda v: 0 <= v <= 1, "a fraction of a step in [0, 1]")


def _check_hetero_off(config):
  """Raises ConfigError unless every hetero.* key is at its off value (_HETERO_OFF): the lockstep
  executor has no clock to slow a worker on."""
  for key, off in _HETERO_OFF.items():
    value = config.hetero[key]
    _note(f"hetero.{key}", f"{off!r} (off: hetero.* needs executor=sim or async)")
    if (tuple(value) if isinstance(value, (list, tuple)) else value) != off:
      needs = "hetero.* needs executor=sim or executor=async"
      _fail(f"hetero.{key}", value, f"{off!r} (off) with executor={config.executor}: {needs}")


def _check_run_end(config):
  """Raises ConfigError for validation_examples, eval_workers or stop_at_target where they cannot
  work: all three are the simulator's, and stopping at a target needs target_accuracy."""
  if "validation_examples" in config:
    _int_in(config, "validation_examples", 0, 10**9, "an integer number of training examples >= 0 (0: none)")
    if config.validation_examples and config.executor != "sim":
      _fail(
        "validation_examples",
        config.validation_examples,
        f"0 with executor={config.executor} (the simulator records val_accuracy)",
      )
  if "eval_workers" in config:
    _bool(config, "eval_workers")
    if not config.eval_workers and config.executor != "sim":
      _fail("eval_workers", False, f"True with executor={config.executor} (the simulator's evaluations)")
  if "stop_at_target" in config:
    _bool(config, "stop_at_target")
  if config.get("stop_at_target"):
    if config.executor != "sim":
      _fail(
        "stop_at_target", True, f"False with executor={config.executor} (the simulator stops at a target)"
      )
    if not config.target_accuracy:
      _fail("stop_at_target", True, "False unless target_accuracy is set (> 0)")


_LEAVE = (
  "() or (worker, t_leave, t_rejoin) triples in virtual seconds: worker < num_workers, t_leave >= 0, "
  "t_rejoin > t_leave or -1 / inf for never, one worker's intervals in order and apart"
)


def _check_leave(config, n):
  """hetero.leave (docs/design.md 3.10): clock events of the simulator, for the algorithms that can
  go on without a worker; refused elsewhere, before anything is built."""
  value = config.hetero.get("leave", ())
  if config.executor != "sim":
    _note("hetero.leave", "() (off: leaving and joining are clock events of executor=sim)")
    if value:
      _fail(
        "hetero.leave",
        value,
        f"() with executor={config.executor}: leaving and joining are clock events of executor=sim",
      )
    return
  why = algorithms.get(config.algorithm).no_leave
  if why:
    _note("hetero.leave", "() (off: the algorithm cannot exclude a worker)")
    if value:
      _fail("hetero.leave", value, f"() with algorithm={config.algorithm}: {why}")
    return
  _note("hetero.leave", _LEAVE)
  if not isinstance(value, (tuple, list)):
    _fail("hetero.leave", value, _LEAVE)
  last = {}  # worker -> the end of its latest interval
  for item in value:
    if not isinstance(item, (tuple, list)) or len(item) != 3:
      _fail("hetero.leave", value, _LEAVE)
    w, t0, t1 = item
    number = lambda v: not isinstance(v, bool) and isinstance(v, (int, float))  # noqa: E731
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n or not (number(t0) and number(t1)):
      _fail("hetero.leave", value, _LEAVE)
    never = t1 == -1 or t1 == math.inf
    if not (math.isfinite(t0) and t0 >= 0 and (never or (math.isfinite(t1) and t1 > t0))):
      _fail("hetero.leave", value, _LEAVE)
    if w in last and not t0 > last[w]:  # it must have rejoined before it can leave again
      _fail("hetero.leave", value, _LEAVE)
    last[w] = math.inf if never else t1


def _number(config, key, ok, allowed):
  """A finite int or float for which ok(value) holds."""
  _note(key, allowed)
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    _fail(key, value, allowed)
  if not math.isfinite(value):
    finite = "a finite " + allowed[2:] if allowed.startswith("a ") else "finite " + allowed
    _fail(key, value, allowed if "finite" in allowed else finite)
  if not ok(value):
    _fail(key, value, allowed)


def _int_in(config, key, lo, hi, allowed):
  _note(key, allowed)
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    _fail(key, value, allowed)


HYBRID_ALGORITHMS = algorithms.hybrid_names()  # every algorithm with groups, and none


def _check_replicas(config, local_devices: int | None = None) -> None:
  """replicas.*: the hybrid executor's keys (ripples_jax/hybrid); count 0 checks only count."""
  _int_in(config, "replicas.count", 0, 4096, "an integer number of replicas in [0, 4096] (0: none)")
  c = config.replicas
  if not c.count:
    return
  if config.placement not in ("one_device", "devices", "per_process"):
    _fail(
      "placement",
      config.placement,
      "one_device (simulated), devices (R x K devices of this process) or per_process (a process per "
      "replica and stage) with replicas.count > 0",
    )
  if config.placement == "devices":
    import jax

    have = jax.local_device_count() if local_devices is None else local_devices
    if c.count * config.num_stages > have:
      _fail(
        "replicas.count",
        c.count,
        f"at most {have // config.num_stages} with placement=devices: replicas x num_stages="
        f"{config.num_stages} devices, this process has {have}",
      )
  _number(
    config,
    "replicas.pad_s",
    lambda v: v >= 0,
    "seconds >= 0 (placement=devices, per_process: each tick's length)",
  )
  _one_of(config, "replicas.algorithm", HYBRID_ALGORITHMS)
  _int_in(config, "replicas.group_size", 2, 4096, "an integer >= 2")
  _number(config, "replicas.smart_tolerance", lambda v: v >= 0, "a number >= 0")
  _int_in(config, "replicas.smart_max_gap", 0, 10**6, "an integer >= 0")
  _bool(config, "replicas.smart_fresh")
  _number(config, "replicas.window", lambda v: v >= 0, "seconds >= 0 (0: lockstep)")
  _int_in(config, "replicas.window_max_gap", 0, 10**6, "an integer >= 0")
  grid = tuple(c.grid)
  if grid and (not all(isinstance(g, int) and g >= 2 for g in grid) or math.prod(grid) != c.count):
    _fail("replicas.grid", grid, f"() or a tuple of integers >= 2 whose product is replicas.count={c.count}")
  _positive_int(config, "replicas.workers_per_node")
  _positive_int(config, "replicas.sync_every")
  K, R = config.num_stages, c.count
  slow = tuple(c.slow)
  if slow and not (
    len(slow) == 2 and all(isinstance(v, int) for v in slow) and 0 <= slow[0] < R and 0 <= slow[1] < K
  ):
    _fail(
      "replicas.slow", slow, f"() or (replica, stage) with replica < count={R} and stage < num_stages={K}"
    )
  _number(config, "replicas.slowdown", lambda v: v >= 1, "a factor >= 1")
  _number(config, "replicas.rotate_every", lambda v: v >= 0, "virtual seconds >= 0 (0: a fixed slow device)")
  _number(config, "replicas.jitter", lambda v: 0 <= v <= 1, "a number in [0, 1]")
  for key in ("stage_s", "stage_bytes"):
    v = tuple(c[key])
    if v and (len(v) != K or not all(isinstance(x, (int, float)) and x > 0 for x in v)):
      _fail(f"replicas.{key}", v, f"() (measured) or num_stages={K} positive numbers")
  _number(config, "replicas.alpha", lambda v: v >= 0, "seconds >= 0")
  _number(config, "replicas.bandwidth", lambda v: v > 0, "bytes/s > 0")
  _number(config, "replicas.avg_s", lambda v: v >= 0, "seconds >= 0 (0: the ring model)")
  _number(config, "replicas.target_accuracy", lambda v: 0 <= v <= 1, "a number in [0, 1] (0: none)")


def _check_dsp_placement(config, num_processes: int, local_devices: int | None = None) -> None:
  """validate_dsp_config's placement keys: per_process's own (process count, method, mode, chunks,
  runtime.*), or what the one-process placements refuse."""
  from ripples_jax.pipeline.tick import PROCESS_MODES

  _one_of(config, "placement", PLACEMENTS)
  hybrid = bool(config.get("replicas") and config.replicas.get("count", 0))
  if config.placement == "per_process" and hybrid:
    _check_hybrid_processes(config, num_processes, PROCESS_MODES)
  elif config.placement == "per_process":
    _check_per_process(config, num_processes, PROCESS_MODES)
  elif num_processes > 1:
    raise ConfigError(
      f"--jax_distributed: {num_processes} processes are not allowed with "
      f"placement={config.placement}: a pipeline runs inside one process (its stages on "
      "that process's devices); placement=per_process runs one process per stage"
    )
  elif config.mode in PROCESS_MODES:
    _fail(
      "mode",
      config.mode,
      "recompute or stash unless placement=per_process (the fused call and the "
      "residual ring exist in the multi-process runtime)",
    )
  elif config.placement in ("devices", "spmd"):
    _check_devices(config, local_devices)
    _check_chunks(config)
  else:
    _check_chunks(config)


def _check_devices(config, local_devices: int | None) -> None:
  """placement=devices or spmd: a method that runs there, and a device of this process per stage."""
  import jax

  where = config.placement
  if where not in methods.get(config.method).placements:
    whole = " and ".join(m for m in methods.names() if m not in methods.names(where))
    how = {
      "devices": "its stages are programs of their own, one device each",
      "spmd": "one program over a stage axis, one device a stage",
    }[where]
    _fail(
      "method",
      config.method,
      f"one of {', '.join(methods.names(where))} with placement={where} ({how}); {whole} run with "
      "placement=one_device",
    )
  n = jax.local_device_count() if local_devices is None else local_devices
  if config.num_stages > n:
    _fail(
      "num_stages",
      config.num_stages,
      f"at most the {n} devices of this process with placement={where} (one device per stage; on "
      "the CPU, --cpu_devices sets their number)",
    )


def _check_chunks(config) -> None:
  """chunks: a divisor of the batch; > 1 only where a stage's calls run chunk by chunk: every tick
  method's backward in every placement (recompute, stash, corrected, residuals: pipeline/tick.py) and
  model-parallel bp's residual calls (per_process); never with a model state (BatchNorm statistics
  would be per chunk)."""
  _positive_int(config, "chunks")
  if config.batch_size % config.chunks:
    _fail("chunks", config.chunks, f"a divisor of batch_size={config.batch_size}")
  if config.chunks == 1:
    return
  if not methods.get(config.method).runs_tick(config.placement):
    _fail(
      "chunks",
      config.chunks,
      f"1 with method={config.method} and placement={config.placement} (a whole-model step; GPipe's "
      "micro-batches are config.microbatches)",
    )
  if config.mode == "fused" and methods.get(config.method).config_mode:
    _fail("chunks", config.chunks, "1 with mode=fused (its one call runs two batches)")
  if _has_model_state(config.model):
    _fail(
      "chunks",
      config.chunks,
      f"1 with model={config.model}: it has a model state (BatchNorm), whose batch statistics would "
      "be per chunk",
    )


def _has_model_state(model: str) -> bool:
  """Whether `model` keeps a model state (BatchNorm's running statistics): its init traced, not run."""
  import jax
  import jax.numpy as jnp

  from ripples_jax.models import build_model, init_model
  from ripples_jax.models.split import DEFAULT_SAMPLE_SHAPES

  x = jnp.zeros((1,) + tuple(DEFAULT_SAMPLE_SHAPES[model]))
  return bool(jax.eval_shape(lambda: init_model(build_model(model, 10), jax.random.key(0), x))[1])


def _check_hybrid_processes(config, num_processes: int, process_modes) -> None:
  """placement=per_process with replicas.count = R > 0 (hybrid/processes.py): R x K stage processes
  and the coordinator, a tick method."""
  R, K = config.replicas.count, config.num_stages
  if num_processes != R * K + 1:
    _fail(
      "placement",
      "per_process",
      f"one process per (replica, stage) and the coordinator: replicas.count x num_stages + 1 = {R * K + 1} "
      f"processes (python -m experiments.launch --num_processes={R * K} --module=experiments.train_dsp "
      f"-- ...: the launcher adds the coordinator), this job has {num_processes}",
    )
  if methods.get(config.method).step != methods.TICK:
    _fail(
      "method",
      config.method,
      f"one of {', '.join(methods.names(step=methods.TICK))} with placement=per_process and replicas.count "
      "> 0 (a replica's stages tick together between its sync points; gpipe's flush and the whole-model "
      "steps run simulated or with placement=devices)",
    )
  _check_per_process(config, K, process_modes)


def _check_per_process(config, num_processes: int, process_modes) -> None:
  if num_processes != config.num_stages:
    _fail(
      "placement",
      "per_process",
      f"one process per stage: num_stages={config.num_stages} processes "
      f"(python -m experiments.launch --num_processes={config.num_stages} "
      f"--module=experiments.train_dsp -- ...), this job has {num_processes}",
    )
  m = methods.get(config.method)
  if "per_process" not in m.placements:
    # e.g. DNI: its predictors train on the true gradient one iteration late and update every stage at
    # once from a synthetic one: a step over the whole model (baselines.make_dni_step), not a tick.
    _fail(
      "method",
      config.method,
      f"one of {', '.join(methods.names('per_process'))} with placement=per_process ({m.label} runs in "
      "one process: its step is a whole-model step, not a pipeline tick)",
    )
  if config.mode in process_modes and not m.config_mode:
    ring = methods.ring(config.method, "per_process", config.mode)
    picked = f"the {ring} ring" if ring else f"{m.label}'s own programs"
    _fail(
      "mode",
      config.mode,
      f"recompute or stash for method={config.method} (the runtime picks its mode: {picked}; "
      f"{' and '.join(process_modes)} are for {', '.join(methods.names(config_mode=True))})",
    )
  if config.mode == "fused" and config.delay < 1:
    _fail("mode", "fused", "recompute, stash or residuals with delay=0 (fusing needs a stored batch)")
  _check_chunks(config)
  for key in ("heartbeat_s", "heartbeat_timeout", "stall_timeout"):
    _number(config, f"runtime.{key}", lambda v: v > 0, "a number of seconds > 0")
  _bool(config, "runtime.pin_cores")
  _bool(config, "runtime.slack")
  _int_in(config, "runtime.fail_tick", 0, 10**9, "an integer >= 0")
  _int_in(
    config,
    "runtime.fail_stage",
    -1,
    config.num_stages - 1,
    f"a stage in [0, num_stages={config.num_stages}) or -1 for none",
  )


def validate_dsp_config(config, num_processes: int = 1, local_devices: int | None = None) -> None:
  """Raises ConfigError naming the first bad key of an experiments.train_dsp config (`local_devices`:
  this process's devices, for placement=devices; default: jax.local_device_count())."""
  from ripples_jax.models.split import max_stages

  _one_of(config, "method", methods.names())  # first: the placement's checks read its record
  _check_dsp_placement(config, num_processes, local_devices)
  _one_of(config, "mode", MODES)
  if "split" in config:
    _one_of(config, "split", SPLIT_COSTS)
  _one_of(config, "dataset", DATASETS)
  _one_of(config, "model", MODEL_NAMES)
  _one_of(config, "placement", PLACEMENTS)
  for key in (
    "num_stages",
    "batch_size",
    "microbatches",
    "chunks",
    "num_epochs",
    "log_every",
    "eval_every",
    "checkpoint_keep",
  ):
    _positive_int(config, key)
  _int_in(config, "checkpoint_every", 0, 10**9, "an integer number of batches >= 0 (0: no checkpoints)")
  if config.checkpoint_every % config.log_every:
    _fail(
      "checkpoint_every",
      config.checkpoint_every,
      f"a multiple of log_every={config.log_every} (checkpoints are taken at logged batches)",
    )
  if "validation_examples" in config:
    _int_in(config, "validation_examples", 0, 10**9, "an integer number of training examples >= 0 (0: none)")
  most = max_stages(config.model)
  if config.num_stages > most:
    _fail("num_stages", config.num_stages, f"{config.model} splits into at most {most} stages")
  if methods.get(config.method).microbatched and config.batch_size % config.microbatches:
    _fail("microbatches", config.microbatches, f"a divisor of batch_size={config.batch_size}")
  _int_in(config, "delay", 0, 64, "an integer number of ticks in [0, 64]")
  if config.placement == "spmd":
    if "spmd_ticks" in config:
      _positive_int(config, "spmd_ticks")
    if config.method == "dsp" and config.delay == 0:
      _fail("delay", 0, "an integer >= 1 with placement=spmd (delay 0 is model-parallel BP, not a pipeline)")
  if config.dataset == "cifar10" and not config.data_dir:
    _fail("data_dir", config.data_dir, "cifar10 needs the directory holding data_batch_1..5 and test_batch")
  _check_optimizer(config)
  if "on_config_change" in config:
    _one_of(config, "on_config_change", ON_CONFIG_CHANGE)
  _number(config, "dni_lr", lambda v: v > 0, "a number > 0")
  if "pipemare" in config:
    _int_in(config, "pipemare.lr_anneal", 0, 10**9, "an integer number of updates >= 0 (0: none)")
    _number(config, "pipemare.ema_decay", lambda v: 0 <= v < 1, "a number in [0, 1)")
  _number(config, "slowdown", lambda v: v >= 1, "a factor >= 1")
  _int_in(
    config,
    "straggler_stage",
    -1,
    config.num_stages - 1,
    f"a stage in [0, num_stages={config.num_stages}) or -1 for none",
  )
  _number(config, "straggler_p", lambda v: 0 <= v <= 1, "a probability in [0, 1]")
  _int_in(config, "seed", 0, 2**32 - 1, "an integer in [0, 2**32)")
  if "replicas" in config:
    _check_replicas(config, local_devices)
