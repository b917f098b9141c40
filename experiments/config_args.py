"""The --config arguments of an entry point's command line, read without absl (no flags defined here:
the launcher reads its children's arguments with them): the spec, the overrides, the config itself."""

import importlib.util
import os

_CONFIG_NAME = "config"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped_configs(argv: list[str]) -> list[str]:
  """`--config=configs/<file>[:k=v]` names the configs shipped beside these entry points when no such
  file exists from here (an installed package run from any folder: `ripples-train --config=...`)."""
  shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")
  out = []
  for arg in argv:
    for prefix in (f"--{_CONFIG_NAME}=", f"-{_CONFIG_NAME}="):
      if arg.startswith(prefix):
        path, sep, variant = arg[len(prefix) :].partition(":")
        name = path[len("configs/") :] if path.startswith("configs/") else None
        if name and not os.path.exists(path) and os.path.isfile(os.path.join(shipped, name)):
          arg = prefix + os.path.normpath(os.path.join(shipped, name)) + sep + variant
    out.append(arg)
  return out


def config_spec(argv, default: str | None = None) -> str:
  """The --config value on the command line (the last one), or `default` (configs/default.py)."""
  spec = default or "configs/default.py"
  for i, arg in enumerate(argv):
    for prefix in (f"--{_CONFIG_NAME}=", f"-{_CONFIG_NAME}="):
      if arg.startswith(prefix):
        spec = arg[len(prefix) :]
    if arg in (f"--{_CONFIG_NAME}", f"-{_CONFIG_NAME}") and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def overrides(argv):
  """[(dotted key, value text)] of every --config.key=value (or --config.key value, --[no]config.key)."""
  out = []
  for i, arg in enumerate(argv):
    for prefix, implied in (
      (f"--{_CONFIG_NAME}.", None),
      (f"-{_CONFIG_NAME}.", None),
      (f"--no{_CONFIG_NAME}.", "False"),
    ):
      if arg.startswith(prefix):
        key, eq, value = arg[len(prefix) :].partition("=")
        if not eq:
          value = implied or (
            argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "True"
          )
        out.append((key, value))
        break
  return out


def load_config(spec: str):
  """get_config(arg) of 'file.py[:arg]', as ml_collections calls it (without the overrides)."""
  path, colon, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_config_for_error_message", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if colon else module.get_config()


def runs_async(module: str, args) -> bool:
  """Whether `python -m module args` is an executor=async run of experiments.train (the launcher then
  starts its coordinator too): --config.executor when given, else the config file's own. A config
  that does not load says so itself, in the child (False here)."""
  if module.rsplit(".", 2)[-2:] != ["experiments", "train"]:
    return False
  given = dict(overrides(args)).get("executor")
  if given is not None:
    return given.strip("'\"") == "async"
  spec = config_spec(shipped_configs(list(args)))
  if not os.path.isabs(spec.split(":", 1)[0]) and not os.path.exists(spec.split(":", 1)[0]):
    spec = os.path.join(_ROOT, spec)
  try:
    return load_config(spec).executor == "async"
  except Exception:  # noqa: BLE001
    return False


def runs_hybrid_processes(module: str, args) -> bool:
  """Whether `python -m module args` is a hybrid run of experiments.train_dsp with a process per
  (replica, stage): placement=per_process and replicas.count > 0 (its coordinator is process 0)."""
  if module.rsplit(".", 2)[-2:] != ["experiments", "train_dsp"]:
    return False
  given = dict(overrides(args))
  spec = config_spec(shipped_configs(list(args)), "configs/dsp.py")
  if not os.path.isabs(spec.split(":", 1)[0]) and not os.path.exists(spec.split(":", 1)[0]):
    spec = os.path.join(_ROOT, spec)
  try:
    config = load_config(spec)
    placement = given.get("placement", config.placement).strip("'\"")
    count = int(given.get("replicas.count", config.replicas.count))
  except Exception:  # noqa: BLE001  the child says what is wrong with its config
    return False
  return placement == "per_process" and count > 0


def needs_coordinator(module: str, args) -> bool:
  """Whether the launcher starts a coordinator (process 0, which trains nothing) besides the workers:
  an executor=async run, or a hybrid run with a process per (replica, stage)."""
  return runs_async(module, args) or runs_hybrid_processes(module, args)


def runs_elastic(module: str, args) -> bool:
  """Whether `python -m module args` is an elastic executor=async run (runtime.elastic): the launcher
  then restarts a dead worker alone (--max_restarts) and the others go on, instead of stopping them."""
  if not runs_async(module, args):
    return False
  given = dict(overrides(args)).get("runtime.elastic")
  if given is not None:
    return given.strip("'\"") in ("True", "true", "1")
  spec = config_spec(shipped_configs(list(args)))
  if not os.path.isabs(spec.split(":", 1)[0]) and not os.path.exists(spec.split(":", 1)[0]):
    spec = os.path.join(_ROOT, spec)
  try:
    return load_config(spec).runtime.get("elastic", False) is True
  except Exception:  # noqa: BLE001
    return False
