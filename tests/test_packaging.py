"""The package as pip installs it: the wheel built from this checkout holds every subpackage, the shipped
configs and the console scripts, and runs a one-step job from a folder outside the checkout with nothing
but the unpacked wheel on PYTHONPATH (the environment running the tests supplies jax and the rest).

The build runs in a copy of the checkout (an in-tree build leaves build/ and *.egg-info behind). It uses
the environment's setuptools when that can build a wheel by itself (setuptools >= 70.1, or the `wheel`
package installed) and pip's isolated build otherwise, which fetches setuptools from the package index.
"""

import configparser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.nightly]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Top-level folders of the checkout that ship inside the package (pyproject [tool.setuptools.package-dir]).
MAPPED = {"experiments": "ripples_jax.experiments", "configs": "ripples_jax.configs"}
SCRIPTS = {
  "ripples-train": "ripples_jax.experiments.train:cli",
  "ripples-train-dsp": "ripples_jax.experiments.train_dsp:cli",
  "ripples-launch": "ripples_jax.experiments.launch:cli",
}
# Top-level entries of the checkout that the build never needs (large, generated or machine-local).
_NOT_COPIED = {".git", ".venv", "venv", ".whl", "runs", "results", "cache", "build", "dist", ".pytest_cache"}


def source_files() -> dict[str, str]:
  """{path inside the wheel: path in the checkout} of every python file the package must ship."""
  out = {}
  roots = {
    "ripples_jax": "ripples_jax",
    **{folder: name.replace(".", "/") for folder, name in MAPPED.items()},
  }
  for folder, installed in roots.items():
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
      for f in filenames:
        if f.endswith(".py"):
          out[os.path.normpath(os.path.join(installed, rel, f)).replace(os.sep, "/")] = os.path.join(
            dirpath, f
          )
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
  """(path of the built wheel, folder it is unpacked in)."""
  tmp = tmp_path_factory.mktemp("packaging")
  src, dist, site = tmp / "src", tmp / "dist", tmp / "site"
  shutil.copytree(ROOT, src, ignore=_copy_ignore)
  cmd = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(dist)]
  if _builds_without_isolation():
    cmd.append("--no-build-isolation")
  env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
  out = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
  [path] = dist.glob("ripples_jax-*.whl")
  with zipfile.ZipFile(path) as z:
    z.extractall(site)
  return path, site


def _dist_info(names) -> str:
  [info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
  return info


def test_the_wheel_holds_every_subpackage_config_and_script(wheel):
  path, _ = wheel
  with zipfile.ZipFile(path) as z:
    names = set(z.namelist())
    info = _dist_info(names)
    entry_points = z.read(f"{info}/entry_points.txt").decode()
    metadata = z.read(f"{info}/METADATA").decode()
  missing = sorted(set(source_files()) - names)
  assert not missing, (
    f"files of the checkout not in the wheel (pyproject [tool.setuptools] packages): {missing}"
  )
  for package in [
    "ripples_jax.data",
    "ripples_jax.models",
    "ripples_jax.pipeline",
    "ripples_jax.runtime",
    "ripples_jax.schedule",
    *MAPPED.values(),
  ]:
    assert package.replace(".", "/") + "/__init__.py" in names, package
  assert {"ripples_jax/configs/default.py", "ripples_jax/configs/dsp.py"} <= names
  # Nothing generic (configs, experiments, tests, benchmarks) at the top of site-packages.
  assert {n.split("/")[0] for n in names} == {"ripples_jax", info}

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


# Runs in a fresh interpreter (argv: site folder, packages, script name, then the script's arguments):
# imports every package from the unpacked wheel, loads the console script the way its generated wrapper
# does (the entry point of the installed distribution) and calls it. One script per process: absl flags are
# global, and two entry modules define the same flags (--config, --num_processes, --cpu_devices).
_CHILD = r"""
import importlib, importlib.metadata, json, os, sys
site, packages, script, args = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4:]
for name in packages:
  module = importlib.import_module(name)
  where = module.__file__ or list(module.__path__)[0]
  assert os.path.realpath(where).startswith(os.path.realpath(site) + os.sep), (name, where)
dist = importlib.metadata.distribution("ripples_jax")
assert os.path.realpath(str(dist.locate_file(""))) == os.path.realpath(site), dist.locate_file("")
[ep] = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == script]
cli = ep.load()
if script == "ripples-launch":  # children must run the installed package's entry point
  from absl import flags
  print("module default:", flags.FLAGS["module"].default)
  sys.exit(0)
sys.argv = [script, *args]
cli()
"""


def _run_script(site, cwd, script, *args):
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
  env.update(PYTHONPATH=str(site), JAX_PLATFORMS="cpu", PYTHONNOUSERSITE="1")
  out = subprocess.run(
    [sys.executable, "-c", _CHILD, str(site), ",".join(source_packages()), script, *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, f"{script} {' '.join(args)}: exit {out.returncode}\n{out.stderr[-3000:]}"
  return out.stdout


def test_the_installed_scripts_run_outside_the_checkout(wheel, tmp_path):
  _, site = wheel
  site = os.path.abspath(site)
  cwd = tmp_path / "elsewhere"
  cwd.mkdir()
  assert os.path.commonpath([ROOT, str(cwd)]) != ROOT and os.path.commonpath([ROOT, site]) != ROOT

  # The shipped default config, named by path with a variant.
  default = os.path.join(site, "ripples_jax", "configs", "default.py")
  stdout = _run_script(
    site,
    cwd,
    "ripples-train",
    f"--config={default}:steps=1,dataset=synthetic,model=mlp",
    f"--workdir={tmp_path / 'run'}",
  )
  assert f"run files: {tmp_path / 'run'}" in stdout
  assert (tmp_path / "run" / "summary.json").is_file()

  # No --config: the entry point finds its default (configs/dsp.py) inside the package.
  stdout = _run_script(
    site,
    cwd,
    "ripples-train-dsp",
    "--config.dataset=synthetic",
    "--config.num_epochs=1",
    f"--workdir={tmp_path / 'dsp'}",
  )
  assert f"run files: {tmp_path / 'dsp'}" in stdout
  assert (tmp_path / "dsp" / "summary.json").is_file()

  stdout = _run_script(site, cwd, "ripples-launch")
  assert "module default: ripples_jax.experiments.train" in stdout
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
  import tomllib

  import ripples_jax

  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    assert ripples_jax.__version__ == tomllib.load(f)["project"]["version"]
