"""The package as pip installs it: the wheel built from this checkout holds every subpackage (each folder
with an __init__.py, found, not listed), the shipped configs and the console scripts; installed into a
fresh virtual environment, run from a folder outside the checkout, it imports every subpackage and runs
one tiny job of every executor in run.EXECUTORS through its console scripts (the multi-process ones
through ripples-launch).

The build runs in a copy of the checkout (an in-tree build leaves build/ and *.egg-info behind). It uses
the environment's setuptools when that can build a wheel by itself (setuptools >= 70.1, or the `wheel`
package installed) and pip's isolated build otherwise, which fetches setuptools from the package index.
The wheel is installed with --no-deps --no-index: the environment running the tests lends the fresh one
its packages (jax and the rest), after the wheel's own, and nothing else is downloaded.
"""

import configparser
import importlib.metadata
import json
import os
import signal
import site
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
  PYPROJECT = tomllib.load(_f)
# Top-level folders of the checkout that ship inside the package: {folder: installed name}.
MAPPED = {folder: name for name, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}
SCRIPTS = PYPROJECT["project"]["scripts"]
# Top-level entries of the checkout that the build never needs (large, generated or machine-local).
_NOT_COPIED = {".git", ".venv", "venv", ".whl", "runs", "results", "cache", "build", "dist", ".pytest_cache"}


def source_files() -> dict[str, str]:
  """{path inside the wheel: path in the checkout} of every python file the package must ship."""
  out = {}
  for folder, installed in {"ripples_jax": "ripples_jax", **MAPPED}.items():
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
      for f in filenames:
        if f.endswith(".py"):
          where = os.path.join(installed.replace(".", "/"), rel, f)
          out[os.path.normpath(where).replace(os.sep, "/")] = os.path.join(dirpath, f)
  return out


def source_packages() -> list[str]:
  """Every package the wheel must hold, by its installed name: each folder with an __init__.py."""
  return sorted(
    path[: -len("/__init__.py")].replace("/", ".") for path in source_files() if path.endswith("/__init__.py")
  )


def _copy_ignore(directory, names):
  ignored = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
  if os.path.samefile(directory, ROOT):
    ignored |= _NOT_COPIED & set(names)
  return ignored


def _builds_without_isolation() -> bool:
  try:
    version = tuple(int(p) for p in importlib.metadata.version("setuptools").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return False
  if version < (64, 0):
    return False
  try:
    importlib.metadata.version("wheel")
    return True
  except importlib.metadata.PackageNotFoundError:
    return version >= (70, 1)  # bdist_wheel moved into setuptools


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The path of the wheel built from a copy of this checkout."""
  import shutil

  tmp = tmp_path_factory.mktemp("packaging")
  src, dist = tmp / "src", tmp / "dist"
  shutil.copytree(ROOT, src, ignore=_copy_ignore)
  cmd = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(dist)]
  if _builds_without_isolation():
    cmd.append("--no-build-isolation")
  env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
  out = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
  [path] = dist.glob("ripples_jax-*.whl")
  return path


def _dist_info(names) -> str:
  [info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
  return info


@pytest.mark.slow
def test_the_wheel_holds_every_subpackage_config_and_script(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    info = _dist_info(names)
    entry_points = z.read(f"{info}/entry_points.txt").decode()
    metadata = z.read(f"{info}/METADATA").decode()
  missing = sorted(set(source_files()) - names)
  assert not missing, f"files of the checkout not in the wheel (setup.py finds the packages): {missing}"
  assert {p.replace(".", "/") + "/__init__.py" for p in source_packages()} <= names
  assert {"ripples_jax/configs/default.py", "ripples_jax/configs/dsp.py"} <= names
  # Nothing generic (configs, experiments, tests, benchmarks, examples) at the top of site-packages, and
  # nothing of the package but its python files.
  assert {n.split("/")[0] for n in names} == {"ripples_jax", info}
  assert {n for n in names if n.startswith("ripples_jax/")} == set(source_files())

  parser = configparser.ConfigParser()
  parser.optionxform = str
  parser.read_string(entry_points)
  assert dict(parser["console_scripts"]) == SCRIPTS

  requires = [
    line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")
  ]
  runtime = [r for r in requires if "extra ==" not in r]
  assert any(r.startswith("jax") and "<" in r for r in runtime), runtime
  assert not any(r.startswith("pytest") for r in runtime), "pytest is a test dependency, not a runtime one"
  extras = {
    line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")
  }
  assert {"test", "cuda12", "tpu"} <= extras


def _lent_site_dirs() -> list[str]:
  """Where the environment running the tests keeps its packages (jax and the rest)."""
  dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
  if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
  return [d for i, d in enumerate(dirs) if os.path.isdir(d) and d not in dirs[:i]]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
  """(the fresh environment's folder, its site-packages) with the wheel installed in it."""
  env_dir = tmp_path_factory.mktemp("installed") / "venv"
  subprocess.run(
    [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)],
    check=True,
    timeout=120,
  )
  python = str(env_dir / "bin" / "python")
  purelib = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  # A venv made from a venv's interpreter sees the base interpreter's packages, not that venv's: lend
  # the running environment's as plain path entries, after the venv's own (so the wheel's files come
  # first), with none of their .pth files run (an editable install of this checkout among them stays
  # out).
  with open(os.path.join(purelib, "_lent_test_environment.pth"), "w") as f:
    f.write("".join(d + "\n" for d in _lent_site_dirs()))
  cmd = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", str(wheel)]
  out = subprocess.run(cmd, env=_env(str(env_dir)), capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
  return str(env_dir), purelib


def _env(env_dir: str, **extra) -> dict:
  """The environment of a process of the installed package: nothing points at the checkout."""
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
  }
  env.update(
    PATH=os.path.join(env_dir, "bin") + os.pathsep + env.get("PATH", ""),
    VIRTUAL_ENV=env_dir,
    PYTHONNOUSERSITE="1",
    PYTHONSAFEPATH="1",  # not even the current folder on sys.path
    PIP_DISABLE_PIP_VERSION_CHECK="1",
    JAX_PLATFORMS="cpu",
    **extra,
  )
  return env


# One run of every executor, each the smallest its config allows: a Ripples run (configs/default.py) of
# each of its executors, async with one algorithm of each runtime role (run.executor_of dispatches on
# it), and a pipeline run (configs/dsp.py) of each placement, alone and as replicas (the hybrid). The
# executors they reach are read back from each run's config.json and must be run.EXECUTORS: a new
# executor fails the test until a run here reaches it.
_RIPPLES = "model=mlp,dataset=synthetic,steps=1,executor={},algorithm={},num_workers={}"
_ASYNC_ALGORITHMS = {"allreduce": 1, "adpsgd": 2, "ps_sync": 1}  # the fewest workers each allows
# A launched run's processes share 2 cores with the other jobs: a late heartbeat is not a lost process.
_PATIENT = {"runtime.heartbeat_timeout": 60.0, "runtime.stall_timeout": 120.0}
_PIPELINE = {
  "method": "dsp",
  "dataset": "synthetic",
  "model": "mlp",
  "num_epochs": 1,
  "batch_size": 16,
  "synthetic.num_train": 32,  # 2 batches: one per replica
  "synthetic.num_test": 32,
  "split": "macs",  # not measured: no profiling
  "checkpoint_every": 0,
}


def runs() -> list[dict]:
  """{config, variant, overrides, processes (0: in this process; else the launch's --num_processes)}."""
  from ripples_jax.config import EXECUTORS as RIPPLES_EXECUTORS
  from ripples_jax.pipeline.tick import PLACEMENTS, PROCESS_MODES

  out = []
  for executor in RIPPLES_EXECUTORS:
    launched = executor == "async"
    for algorithm, workers in _ASYNC_ALGORITHMS.items() if launched else [("allreduce", 2)]:
      out.append(
        dict(
          config="default",
          variant=_RIPPLES.format(executor, algorithm, workers),
          # one worker: no final marker checkpoint (one worker's orbax save of its host-local row fails)
          overrides={"runtime.checkpoint_every": 0, **_PATIENT} if launched else {},
          processes=workers if launched else 0,
        )
      )
  for replicas in (0, 1):
    for placement in PLACEMENTS:
      if replicas and placement == "spmd":  # the hybrid composes the other placements only
        continue
      stages = 1 if replicas else 2  # a replica of 1 stage: the hybrid's fewest processes
      o = {**_PIPELINE, "num_stages": stages, "placement": placement}
      if replicas:
        o.update({"replicas.count": replicas, "replicas.stage_s": (0.01,) * stages})
      elif placement == "per_process":
        o["mode"] = PROCESS_MODES[0]
      launched = placement == "per_process"
      if launched:
        o.update(_PATIENT)
      out.append(dict(config="dsp", variant="", overrides=o, processes=max(replicas, 1) * stages * launched))
  return out


def config_args(r: dict, path: bool = True) -> list[str]:
  """A run's --config flags; the config named by its path in a checkout (the installed package falls back
  to its shipped copy), or, path=False, the entry point's default."""
  flags = [f"--config=configs/{r['config']}.py" + (f":{r['variant']}" if r["variant"] else "")] * path
  for k, v in r["overrides"].items():
    flags.append(f"--config.{k}={v}" if isinstance(v, str) else f"--config.{k}={v!r}")
  return flags


# Runs in the fresh environment's interpreter (argv: its site-packages, the checkout, the packages, the
# runs as a python literal, their folder): the checkout is not importable, every package comes from the
# installed wheel, and the runs share the interpreter (run.run_fresh: the shipped config with the run's
# overrides).
_CHILD = r"""
import ast, importlib, importlib.metadata, importlib.util, os, sys
site, root, packages, runs, out = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4], sys.argv[5]
inside = lambda path, folder: os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)
assert not any(p and (p == root or inside(p, root)) for p in sys.path), sys.path
for top in ("experiments", "configs"):
  spec = importlib.util.find_spec(top)
  assert spec is None or not inside(spec.origin or list(spec.submodule_search_locations)[0], root), spec
for name in packages:
  module = importlib.import_module(name)
  assert inside(module.__file__, site), (name, module.__file__)
dist = importlib.metadata.distribution("ripples_jax")
assert os.path.realpath(str(dist.locate_file(""))) == os.path.realpath(site), dist.locate_file("")
print("imported", len(packages), "packages from", site, flush=True)

from ripples_jax import run
for r in ast.literal_eval(runs):
  config = importlib.import_module("ripples_jax.configs." + r["config"]).get_config(r["variant"] or None)
  summary, _ = run.run_fresh(config, out, r["name"], **r["overrides"])
  print("ran", r["name"], "test accuracy", summary["final_test_accuracy"], flush=True)
"""


# Jobs at a time: the launches mostly wait (their processes start, connect and end), so a few overlap well
# on 2 cores; more only add processes competing for them.
PARALLEL = 4


def run_jobs(jobs, cwd, env, logs, parallel: int, timeout_s: float) -> list[str]:
  """Runs [(name, argv)] at most `parallel` at a time, in order, each logging to logs/<name>.log; returns
  a line and the log's tail for each that failed (a job past the common deadline is killed)."""
  deadline, todo, running, failed = time.monotonic() + timeout_s, list(jobs), [], []
  while todo or running:
    while todo and len(running) < parallel:
      name, cmd = todo.pop(0)
      log = open(logs / f"{name}.log", "w")
      p = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
      )
      running.append((name, cmd, log, p))
    time.sleep(0.2)
    for job in list(running):
      name, cmd, log, p = job
      code = p.poll()
      if code is None and time.monotonic() < deadline:
        continue
      if code is None:
        os.killpg(p.pid, signal.SIGKILL)
        code = f"killed after {timeout_s:.0f} s ({p.wait()})"
      running.remove(job)
      log.close()
      if code != 0:
        tail = (logs / f"{name}.log").read_text()[-3000:]
        failed.append(f"{name}: {' '.join(cmd[:3])} ...: exit {code}\n{tail}")
  return failed


@pytest.mark.slow
def test_the_installed_package_runs_every_executor(venv, tmp_path):
  import ml_collections

  from ripples_jax import run as run_lib

  env_dir, purelib = venv
  bin_dir = os.path.join(env_dir, "bin")
  cwd, out = tmp_path / "elsewhere", tmp_path / "runs"
  cwd.mkdir()
  out.mkdir()
  assert os.path.commonpath([ROOT, str(cwd)]) != ROOT and os.path.commonpath([ROOT, purelib]) != ROOT
  env = _env(env_dir, RIPPLES_JAX_CACHE=str(tmp_path / "cache"))
  modules = {script: target.split(":")[0] for script, target in SCRIPTS.items()}
  entry = {modules[s].rsplit(".", 1)[1]: s for s in SCRIPTS}  # train -> ripples-train, ...
  script_of = {"default": entry["train"], "dsp": entry["train_dsp"]}

  # Each config's first in-process run goes through its console script (the dsp one with no --config:
  # the entry point finds its default inside the package), the other in-process runs share one
  # interpreter (started first: the longest job), every launched run goes through ripples-launch.
  jobs, in_process, scripted = [], [], set()
  for i, r in enumerate(runs()):
    r["name"] = f"{i}-{r['config']}"
    workdir = str(out / r["name"])
    if r["processes"]:
      module = modules[script_of[r["config"]]]
      cmd = [
        os.path.join(bin_dir, entry["launch"]),
        f"--num_processes={r['processes']}",
        f"--module={module}",
      ]
      jobs.append((r["name"], [*cmd, "--", *config_args(r), f"--workdir={workdir}"]))
    elif r["config"] not in scripted:
      scripted.add(r["config"])
      args = config_args(r, path=r["config"] != "dsp")
      jobs.append((r["name"], [os.path.join(bin_dir, script_of[r["config"]]), *args, f"--workdir={workdir}"]))
    else:
      in_process.append(r)
  child = [purelib, ROOT, ",".join(source_packages()), repr(in_process), str(out)]
  jobs.insert(0, ("in-process", [os.path.join(bin_dir, "python"), "-c", _CHILD, *child]))

  failed = run_jobs(jobs, cwd, env, tmp_path, parallel=PARALLEL, timeout_s=400)
  assert not failed, "\n\n".join(failed)
  assert "imported" in (tmp_path / "in-process.log").read_text()

  # Which executors ran: each run's config.json, as the installed package wrote it (process 0 of a launch
  # may run another executor than the others: run.process_executor).
  ran = {}
  for i, r in enumerate(runs()):
    workdir = out / f"{i}-{r['config']}"
    assert (workdir / "summary.json").is_file(), f"{workdir}: no summary.json"
    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    for index in range(2 if r["processes"] else 1):
      with pytest.MonkeyPatch.context() as m:
        m.setattr("jax.process_index", lambda index=index: index)
        ran.setdefault(run_lib.process_executor(config), workdir.name)
  missing = sorted(set(run_lib.EXECUTORS) - set(ran))
  assert not missing, f"run.EXECUTORS has {missing}, which no run here reaches (add one to runs())"
  assert set(ran) == set(run_lib.EXECUTORS), ran
  assert not os.path.exists(cwd / "runs")  # every run wrote only to its --workdir


def test_config_paths_fall_back_to_the_shipped_configs(tmp_path, monkeypatch):
  from experiments import common_flags

  monkeypatch.chdir(tmp_path)  # an installed package run from any folder
  got = common_flags.shipped_configs(
    ["prog", "--config=configs/dsp.py:method=bp", "--config=configs/nope.py"]
  )
  assert got[1] == "--config=" + os.path.join(ROOT, "configs", "dsp.py") + ":method=bp"
  assert got[2] == "--config=configs/nope.py"  # not shipped: left for the one-line error
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "dsp.py").write_text("")
  assert common_flags.shipped_configs(["prog", "--config=configs/dsp.py"])[1] == "--config=configs/dsp.py"


def test_the_version_is_the_one_pyproject_declares():
  import ripples_jax

  assert ripples_jax.__version__ == PYPROJECT["project"]["version"]
