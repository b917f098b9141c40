"""Bad input gets one line, never a traceback: `error: <key, path or value>: ... is not allowed: <what
is>` on stderr, a non-zero exit code, before anything compiles, and nothing a run wrote is lost.

The fast tier calls the checks in-process (config validation, the variant parser, the data loaders, the
entry points' handlers); the slow tier runs the entry point in a subprocess, each case failing before
any compile (a few seconds each)."""

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import default as default_config
from configs import dsp as dsp_config
from experiments import common_flags
from ripples_jax import data
from ripples_jax.config import ConfigError, parse_arg, validate_dsp_config, validate_train_config
from ripples_jax.data import cifar10
from ripples_jax.data import mnist1d as m1d
from tests.test_train import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = float("nan"), float("inf")
ONLY = "a variant key, one of algorithm, dataset, executor, layout, model, num_workers, steps"
SPMD_ONLY = "with executor=spmd: hetero.* needs executor=sim or executor=async"


def one_line(stderr: str) -> str:
  """The last stderr line, after checking there is no traceback."""
  assert "Traceback" not in stderr, stderr[-3000:]
  return stderr.strip().splitlines()[-1]


def exits(capsys, code, fn, *args):
  """fn(*args) must end the process with `code` and one line on stderr; returns that line."""
  with pytest.raises(SystemExit) as e:
    fn(*args)
  assert e.value.code == code
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1, err
  return one_line(err)


# -- the `:k=v` variant form (cases 1, 2) --------------------------------------------------------------

VARIANTS = [
  ("num_workers=abc", "config:num_workers: 'abc' is not allowed: an integer like its default 8"),
  ("steps=1e3", "config:steps: 1000.0 is not allowed: an integer like its default 4000"),
  ("algorithm=1", "config:algorithm: 1 is not allowed: a string like its default 'ripples_static'"),
  ("foo=1", f"config:foo: 'foo' is not allowed: {ONLY}"),
  (
    "steps",
    "config:steps: 'steps' is not allowed: a variant key=value, keys algorithm, dataset, executor, "
    "layout, model, num_workers, steps",
  ),
]


@pytest.mark.parametrize("arg,message", VARIANTS, ids=[a for a, _ in VARIANTS])
def test_variant_errors_name_the_key(arg, message):
  with pytest.raises(ConfigError) as e:
    default_config.get_config(arg)
  assert str(e.value) == message


def test_variant_types_follow_the_defaults():
  got = parse_arg("a=2,b=3,c=x", a=1.5, b=1, c="s")
  assert (got.a, got.b, got.c) == (2, 3, "x")
  with pytest.raises(ConfigError, match=r"config:method: 3 is not allowed: a string like its default 'dsp'"):
    dsp_config.get_config("method=3")


# -- non-finite numbers (case 8) and heterogeneity under the lockstep executor (case 10) --------------

SIM, ASYNC = "executor=sim", "executor=async,num_workers=1,algorithm=allreduce"
NON_FINITE = [
  ("", "optimizer.weight_decay", NAN, "a finite number >= 0"),
  ("", "optimizer.weight_decay", INF, "a finite number >= 0"),
  ("", "optimizer.lr", NAN, "a finite number > 0"),
  ("", "optimizer.lr", INF, "a finite number > 0"),
  ("", "optimizer.momentum", NAN, "a finite number in [0, 1)"),
  (SIM, "hetero.slowdown", INF, "a finite factor >= 1"),
  (SIM, "hetero.slowdown", NAN, "a finite factor >= 1"),
  (SIM, "hetero.random_p", NAN, "a finite probability in [0, 1]"),
  (SIM, "hetero.jitter", INF, "a finite lognormal sigma >= 0"),
  (SIM, "timeline.compute_time", NAN, "finite seconds >= 0 (0: measure the real jitted step)"),
  (SIM, "timeline.alpha", INF, "a finite number >= 0"),
  (SIM, "timeline.model_bytes", NAN, "a finite number >= 0"),
  (SIM, "timeline.bandwidth", INF, "a finite number > 0"),
  (SIM, "timeline.ps_bandwidth", NAN, "a finite number > 0"),
  (SIM, "time_budget", INF, "finite seconds >= 0 (0: no budget)"),
  (SIM, "target_accuracy", NAN, "a finite fraction in [0, 1] (0: none)"),
  (
    SIM + ",algorithm=ripples_smart",
    "schedule.smart_tolerance",
    INF,
    "a finite number > 0 (a fraction of a step time)",
  ),
  (ASYNC, "runtime.step_time", INF, "finite seconds >= 0 (0: no padding)"),
  (ASYNC, "runtime.heartbeat_s", NAN, "finite seconds > 0"),
  (ASYNC, "runtime.heartbeat_timeout", INF, "finite seconds > 0"),
  (ASYNC, "runtime.stall_timeout", NAN, "finite seconds > 0"),
]
CROSS = [
  ("", "hetero.slowdown", 5.0, f"1.0 (off) {SPMD_ONLY}"),
  ("", "hetero.slow_workers", (3,), f"() (off) {SPMD_ONLY}"),
  ("", "hetero.random_p", 0.1, f"0.0 (off) {SPMD_ONLY}"),
  ("", "hetero.jitter", 0.2, f"0.0 (off) {SPMD_ONLY}"),
  ("", "seed", -1, "an integer in [0, 2**32)"),
  (ASYNC, "runtime.fail_where", "slow", "step without runtime.elastic (slow needs runtime.elastic=True)"),
]


@pytest.mark.parametrize(
  "arg,key,value,allowed",
  NON_FINITE + CROSS,
  ids=[f"{a or 'spmd'}:{k}={v}" for a, k, v, _ in NON_FINITE + CROSS],
)
def test_train_config_refuses(arg, key, value, allowed):
  config = default_config.get_config(arg)
  n = processes(config)
  config.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    validate_train_config(config, num_devices=8, num_processes=n)
  assert str(e.value) == f"config.{key}: {value!r} is not allowed: {allowed}"


def test_a_slow_worker_is_injected_only_where_the_authority_makes_groups():
  config = default_config.get_config("executor=async,num_workers=4,algorithm=adpsgd")
  config.update_from_flattened_dict({"runtime.elastic": True, "runtime.fail_where": "slow"})
  with pytest.raises(ConfigError) as e:
    validate_train_config(config, num_devices=8, num_processes=processes(config))
  assert str(e.value) == (
    "config.runtime.fail_where: 'slow' is not allowed: step or preduce with algorithm=adpsgd (slow: the "
    "authority's groups)"
  )


def test_the_measured_consensus_all_reduce_is_refused_on_an_elastic_run():
  config = default_config.get_config("executor=async,num_workers=4,algorithm=ripples_smart")
  config.update_from_flattened_dict({"runtime.elastic": True, "runtime.consensus_allreduce": True})
  with pytest.raises(ConfigError) as e:
    validate_train_config(config, num_devices=8, num_processes=processes(config))
  assert str(e.value) == (
    "config.runtime.consensus_allreduce: True is not allowed: False with runtime.elastic (an elastic "
    "run's last members are not known before its end)"
  )
  config.runtime.elastic = False
  validate_train_config(config, num_devices=8, num_processes=processes(config))


def test_every_float_key_is_checked_for_nan_and_inf():
  """No float of the train config is left unchecked: nan and inf are refused for each one."""
  # ripples_smart reads schedule.smart_tolerance; only executor=async reads runtime.*
  for arg, groups in (
    (SIM + ",algorithm=ripples_smart", ("optimizer", "hetero", "timeline", "schedule")),
    (ASYNC, ("optimizer", "hetero", "timeline", "runtime")),
  ):
    base = default_config.get_config(arg)
    floats = [k for k, v in base.items() if isinstance(v, float)]
    floats += [f"{g}.{k}" for g in groups for k, v in base[g].items() if isinstance(v, float)]
    assert len(floats) > 8
    for key in floats:
      for bad in (NAN, INF):
        config = default_config.get_config(arg)
        config.update_from_flattened_dict({key: bad})
        with pytest.raises(ConfigError, match=f"config.{key}: {bad!r} is not allowed"):
          validate_train_config(config, num_devices=8, num_processes=processes(config))


@pytest.mark.parametrize(
  "key,value,allowed",
  [
    ("optimizer.weight_decay", NAN, "a finite number >= 0"),
    ("dni_lr", INF, "a finite number > 0"),
    ("slowdown", INF, "a finite factor >= 1"),
    ("straggler_p", NAN, "a finite probability in [0, 1]"),
  ],
)
def test_dsp_config_refuses_non_finite(key, value, allowed):
  config = dsp_config.get_config()
  config.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    validate_dsp_config(config)
  assert str(e.value) == f"config.{key}: {value!r} is not allowed: {allowed}"


def test_hetero_is_fine_with_the_clocked_executors():
  for arg in ("executor=sim", "executor=async,num_workers=1,algorithm=allreduce"):
    config = default_config.get_config(arg)
    config.hetero.slowdown, config.hetero.slow_workers = 5.0, (0,)
    validate_train_config(config, num_devices=8, num_processes=processes(config))


# -- the workdir (case 5) --------------------------------------------------------------------------------


def test_workdir_that_is_a_file(tmp_path, capsys):
  f = tmp_path / "f"
  f.write_text("keep me")
  assert exits(capsys, 2, common_flags.check_workdir, str(f)) == (
    f"error: --workdir: '{f}' is not allowed: it is a file, not a folder"
  )
  assert exits(capsys, 2, common_flags.check_workdir, str(f / "sub")) == (
    f"error: --workdir: '{f / 'sub'}' is not allowed: {f} is a file, not a folder"
  )
  assert f.read_text() == "keep me"


def test_workdir_that_is_read_only(tmp_path, capsys, monkeypatch):
  def refuse(**kw):  # what a read-only file system answers (root ignores chmod, so it is simulated)
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), kw.get("dir"))

  monkeypatch.setattr(common_flags.tempfile, "mkstemp", refuse)
  assert exits(capsys, 2, common_flags.check_workdir, str(tmp_path / "run")) == (
    f"error: --workdir: '{tmp_path / 'run'}' is not allowed: {tmp_path} is not writable (Read-only file "
    "system); a folder this process can write"
  )
  assert not (tmp_path / "run").exists()


def test_workdir_check_creates_nothing(tmp_path):
  common_flags.check_workdir(str(tmp_path / "a" / "b"))
  common_flags.check_workdir(str(tmp_path))
  assert os.listdir(tmp_path) == []


# -- the mnist1d cache (cases 6, 11) and CIFAR-10 (case 13) ----------------------------------------------


def _fake_generate(num_samples, gen_seed):
  rng = np.random.default_rng(gen_seed)
  n = int(num_samples * 0.8)
  return {
    "x_train": rng.normal(size=(n, 40)),
    "y_train": rng.integers(0, 10, n),
    "x_test": rng.normal(size=(num_samples - n, 40)),
    "y_test": rng.integers(0, 10, num_samples - n),
  }


@pytest.fixture
def fake_mnist1d(monkeypatch):
  monkeypatch.setattr(m1d, "_generate", _fake_generate)


def _load(folder):
  with pytest.raises(data.DatasetError) as e:
    data.load_dataset("mnist1d", data_dir=str(folder), num_samples=100)
  assert "\n" not in str(e.value) and e.value.__cause__ is None
  return str(e.value)


def test_mnist1d_cache_path_is_a_folder(tmp_path, fake_mnist1d):
  path = m1d.cache_path(str(tmp_path), num_samples=100)
  os.makedirs(path)
  assert _load(tmp_path).startswith(
    f"mnist1d: {path} is a folder where the cache file goes (move it away to regenerate the cache); "
    "config.data_dir"
  )
  assert os.path.isdir(path)  # untouched


def test_mnist1d_data_dir_is_a_file(tmp_path, fake_mnist1d):
  f = tmp_path / "f"
  f.write_text("x")
  assert _load(f).startswith(f"mnist1d: {f} is a file, not a folder; config.data_dir")


def test_mnist1d_cache_unreadable(tmp_path, fake_mnist1d, monkeypatch):
  data.load_dataset("mnist1d", data_dir=str(tmp_path), num_samples=100)  # writes the cache
  path = m1d.cache_path(str(tmp_path), num_samples=100)

  def refuse(p, *a, **k):  # what a file without read permission answers (root ignores chmod)
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)

  monkeypatch.setattr(m1d, "open", refuse, raising=False)
  assert _load(tmp_path).startswith(f"mnist1d: {path} cannot be read (Permission denied); config.data_dir")


def test_mnist1d_cache_folder_unwritable(tmp_path, fake_mnist1d, monkeypatch):
  def refuse(path, arrays):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

  monkeypatch.setattr(m1d, "_write_atomic", refuse)
  path = m1d.cache_path(str(tmp_path), num_samples=100)
  assert _load(tmp_path).startswith(f"mnist1d: {path} cannot be written (No space left on device);")


def _bad_labels(a):
  a["y_train"][3] = 12


def _negative_labels(a):
  a["y_test"][0] = -1


def _nan_inputs(a):
  a["x_train"][5, 7] = np.nan


def _inf_inputs(a):
  a["x_test"][1, 2] = -np.inf


def _float_labels(a):
  a["y_train"] = a["y_train"].astype(np.float32) + 0.5


def _wrong_shape(a):
  a["x_train"] = a["x_train"][:, :, None]


BAD_CACHES = [
  (_bad_labels, "has train labels outside 0..9 (0..12)"),
  (_negative_labels, "has test labels outside 0..9 (-1..9)"),
  (_nan_inputs, "has 1 non-finite train input values (nan or inf)"),
  (_inf_inputs, "has 1 non-finite test input values (nan or inf)"),
  (_float_labels, "has non-integer train labels (float32)"),
  (_wrong_shape, "has x_train of shape [80, 40, 1], not [N, 40]"),
]


@pytest.mark.parametrize("corrupt,problem", BAD_CACHES, ids=[c.__name__ for c, _ in BAD_CACHES])
def test_mnist1d_cache_with_bad_values_is_refused(tmp_path, fake_mnist1d, corrupt, problem):
  data.load_dataset("mnist1d", data_dir=str(tmp_path), num_samples=100)
  path = m1d.cache_path(str(tmp_path), num_samples=100)
  with np.load(path) as f:
    arrays = {k: f[k].copy() for k in f.files}
  arrays["y_train"][:] = np.arange(len(arrays["y_train"])) % 10  # every label present: known min..max
  arrays["y_test"][:] = np.arange(len(arrays["y_test"])) % 10
  corrupt(arrays)
  np.savez(path, **arrays)
  assert _load(tmp_path) == f"mnist1d: {path} {problem}; delete it to regenerate the cache"


def test_pack_checks_every_loader():
  x, y = np.zeros((4, 3), np.float32), np.array([0, 1, 2, 3])
  with pytest.raises(data.DatasetError, match=r"^somewhere has test labels outside 0\.\.2 \(0\.\.3\)$"):
    data._common.pack(x, y % 3, x, y, num_classes=3, source="somewhere")
  x_bad = x.copy()
  x_bad[0, 0] = np.nan
  with pytest.raises(data.DatasetError, match="has 1 non-finite train input values"):
    data._common.pack(x_bad, y, x, y, num_classes=4)
  assert data._common.pack(x, y, x, y, num_classes=4)["num_classes"] == 4


def test_cifar10_pickles_are_flagged_as_code():
  assert "runs whatever code" in cifar10.__doc__ and "trust" in cifar10.__doc__
  usage = open(os.path.join(ROOT, "docs", "usage.md")).read()  # where config.data_dir is documented
  assert "loading one runs any code it holds" in usage


# -- the entry points' handlers: disk full (case 7) and the NaN stop (case 12) ----------------------------


def test_disk_full_is_one_line_naming_the_path(capsys):
  def write():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.jsonl")

  assert exits(capsys, common_flags.EXIT_IO, common_flags.run_or_exit, write) == (
    "error: /runs/x/metrics.jsonl: No space left on device (ENOSPC); the files the run wrote so far are "
    "kept: fix this and rerun the same command to resume from the newest checkpoint"
  )


def test_disk_full_under_orbax_is_one_line_naming_the_path(capsys):
  def save():  # what orbax/tensorstore raise for ENOSPC (measured on a full tmpfs)
    raise ValueError(
      'RESOURCE_EXHAUSTED: Error writing "params.Dense_0.bias/0" in OCDBT database at local '
      'file "/runs/x/ckpt/5.orbax-checkpoint-tmp/state/ocdbt.process_0/": Failed writing: '
      '"/runs/x/ckpt/5.orbax-checkpoint-tmp/state/ocdbt.process_0/d/ab12": Failed to write 20789 '
      "bytes to file 12: No space left on device [os_error_code='28']"
    )

  line = exits(capsys, common_flags.EXIT_IO, common_flags.run_or_exit, save)
  assert line.startswith(
    "error: /runs/x/ckpt/5.orbax-checkpoint-tmp/state/ocdbt.process_0/d/ab12: No space "
    "left on device (ENOSPC);"
  )


def test_an_unrelated_value_error_is_not_swallowed():
  def bug():
    raise ValueError("a bug, not bad input")

  with pytest.raises(ValueError, match="a bug"):
    common_flags.run_or_exit(bug)


def test_nan_stop_is_one_line_with_its_own_exit_code(capsys):
  message = (
    "train_loss is nan at step 3; stopping the run; the last good checkpoint is none (no checkpoint yet)"
  )

  def diverge():
    raise FloatingPointError(message)

  assert exits(capsys, common_flags.EXIT_DIVERGED, common_flags.run_or_exit, diverge) == f"error: {message}"
  assert common_flags.EXIT_DIVERGED not in (0, 1, common_flags.EXIT_BAD_INPUT)


def test_config_and_dataset_errors_exit_2(capsys):
  def bad():
    raise ConfigError("config.x: 1 is not allowed: 2")

  assert exits(capsys, 2, common_flags.run_or_exit, bad) == "error: config.x: 1 is not allowed: 2"


def test_cpu_devices_below_1_exit_2(capsys):
  for count in (0, -2):
    assert exits(capsys, 2, common_flags.check_cpu_devices, count) == (
      f"error: --cpu_devices={count} is not allowed: at least 1 CPU device per process"
    )
  common_flags.check_cpu_devices(1)  # no exit


# -- the entry points, end to end (slow: one subprocess each, failing before any compile) ----------------


def entry(module, args, tmp_path):
  env = dict(os.environ, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  return subprocess.run(
    [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )


TINY = "--config=configs/default.py:steps=2,dataset=synthetic,model=mlp"
ENTRY = [
  (
    "variant_type",
    ["--config=configs/default.py:num_workers=abc"],
    "config:num_workers: 'abc' is not allowed: an integer like its default 8",
  ),
  ("variant_key", ["--config=configs/default.py:foo=1"], f"config:foo: 'foo' is not allowed: {ONLY}"),
  (
    "unknown_key",
    ["--config.nonexistent=1"],
    "config.nonexistent: '1' is not allowed: config has no key 'nonexistent' (its keys: algorithm, batch_size, ",
  ),
  (
    "unknown_nested_key",
    [TINY, "--config.optimizer.nope=1"],
    "config.optimizer.nope: '1' is not allowed: config.optimizer has no key 'nope' (its keys: lr, lr_schedule, "
    "momentum, name, warmup_steps, weight_decay)",
  ),
  (
    "override_type",
    [TINY, "--config.num_workers=abc"],
    "config.num_workers: 'abc' is not allowed: an integer like its default 8",
  ),
  (
    "override_order",
    ["--config.num_workers=4", TINY],
    "--config.num_workers=4: an override before --config is not allowed: --config=<file> first, then "
    "--config.<key>=<value>",
  ),
  (
    "missing_file",
    ["--config=configs/nope.py"],
    "--config: 'configs/nope.py' is not allowed: no such file; a python file defining get_config(arg), e.g. "
    "configs/default.py",
  ),
  ("unknown_flag", ["--foo=1"], "Unknown command line flag 'foo'"),
  (
    "positional",
    ["executor=sim"],
    "'executor=sim': a positional argument is not allowed: flags only, e.g. "
    "--config=configs/default.py:k=v,... or --config.key=value",
  ),
  (
    "weight_decay_nan",
    [TINY, "--config.optimizer.weight_decay=nan"],
    "config.optimizer.weight_decay: nan is not allowed: a finite number >= 0",
  ),
  (
    "cpu_devices_zero",
    [TINY, "--cpu_devices=0"],
    "--cpu_devices=0 is not allowed: at least 1 CPU device per process",
  ),
  (
    "cpu_devices_negative",
    [TINY, "--cpu_devices=-2"],
    "--cpu_devices=-2 is not allowed: at least 1 CPU device per process",
  ),
  (
    "hetero_spmd",
    [TINY, "--config.hetero.slowdown=5"],
    f"config.hetero.slowdown: 5.0 is not allowed: 1.0 (off) {SPMD_ONLY}",
  ),
]


# One case per entry point in the slow tier (the subprocess path: flags parsed, one line, exit 2); the
# others' checks run in process above and, through the subprocess too, in the nightly tier.
SUBPROCESS_EVERY_RUN = ("weight_decay_nan",)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,args,message",
  [pytest.param(*e, marks=() if e[0] in SUBPROCESS_EVERY_RUN else pytest.mark.nightly) for e in ENTRY],
  ids=[n for n, _, _ in ENTRY],
)
def test_entry_point_bad_input(name, args, message, tmp_path):
  workdir = tmp_path / "run"
  out = entry("experiments.train", args + [f"--workdir={workdir}"], tmp_path)
  assert out.returncode == common_flags.EXIT_BAD_INPUT, out.stderr[-3000:]
  assert one_line(out.stderr).startswith("error: " + message)
  assert not workdir.exists()


@pytest.mark.slow
@pytest.mark.nightly
def test_entry_point_workdir_is_a_file(tmp_path):
  f = tmp_path / "f"
  f.write_text("keep me")
  out = entry("experiments.train", [TINY, f"--workdir={f}"], tmp_path)
  assert out.returncode == 2
  assert one_line(out.stderr) == f"error: --workdir: '{f}' is not allowed: it is a file, not a folder"
  assert f.read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.nightly
def test_entry_point_bad_mnist1d_cache(tmp_path):
  folder = tmp_path / "data"
  path = m1d.cache_path(str(folder))
  os.makedirs(path)  # a folder where the cache file goes
  out = entry(
    "experiments.train",
    ["--config=configs/default.py:steps=2", f"--config.data_dir={folder}", f"--workdir={tmp_path / 'run'}"],
    tmp_path,
  )
  assert out.returncode == 2
  assert one_line(out.stderr).startswith(f"error: mnist1d: {path} is a folder where the cache file goes")


@pytest.mark.slow
@pytest.mark.nightly
def test_entry_point_nan_stop(tmp_path):
  workdir = tmp_path / "run"
  out = entry(
    "experiments.train",
    [
      TINY.replace("steps=2", "steps=20"),
      "--config.optimizer.lr=1e30",
      "--config.log_every=1",
      f"--workdir={workdir}",
    ],
    tmp_path,
  )
  assert out.returncode == common_flags.EXIT_DIVERGED, out.stderr[-3000:]
  line = one_line(out.stderr)
  assert line.startswith("error: train_loss is ") and " at step " in line and "stopping the run" in line
  assert (workdir / "metrics.jsonl").exists() and (workdir / "config.json").exists()  # kept


@pytest.mark.slow
def test_dsp_entry_point_bad_input(tmp_path):
  out = entry("experiments.train_dsp", ["method=gpipe"], tmp_path)
  assert out.returncode == 2
  assert one_line(out.stderr) == (
    "error: 'method=gpipe': a positional argument is not allowed: flags only, "
    "e.g. --config=configs/dsp.py:k=v,... or --config.key=value"
  )
  out = entry("experiments.train_dsp", ["--config=configs/dsp.py:num_stages=x"], tmp_path)
  assert out.returncode == 2
  assert one_line(out.stderr) == "error: config:num_stages: 'x' is not allowed: an integer like its default 2"
