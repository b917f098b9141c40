"""The flags every training entry point shares (workdir, CPU devices, --jax_distributed and its
arguments), and the host set-up and bad-input handling around the one library call.

Bad input ends the process with one line on stderr, `error: <key, path or value>: ... is not allowed:
<what is>`, before JAX initialises or anything compiles:

  app.run(main, flags_parser=common_flags.parse_flags)   # flags, --config, --workdir, stray arguments
  common_flags.run_or_exit(train_and_evaluate, ...)        # config values, datasets, the NaN stop, I/O

Exit codes: EXIT_BAD_INPUT (2) for input that is not allowed, EXIT_DIVERGED (3) for the NaN stop,
EXIT_IO (74, sysexits' EX_IOERR) when the file system fails under a running run (a full disk).
"""

import errno
import os
import sys
import tempfile

import ml_collections
from absl import flags
from ml_collections import config_flags

from ripples_jax import config_doc, runlog
from ripples_jax.data import DatasetError
from ripples_jax.distributed import coord
from ripples_jax.distributed.host import (
  collective_timeout_s,
  init_distributed,
  quiet_library_logs,
  recoverable,
  use_cpu_devices,
)
from ripples_jax.errors import ConfigError

from .config_args import config_spec, shipped_configs
from .config_args import load_config as _load_config
from .config_args import overrides as _overrides

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_IO = coord.EXIT_STORAGE  # 74: the launcher restarts nothing on it (a full disk stays full)

WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: a fresh folder under runs/).")
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "CPU devices to use when running on the host.")
_JAX_DISTRIBUTED = flags.DEFINE_bool("jax_distributed", False, "Call jax.distributed.initialize().")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (default: JAX's).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (default: JAX's).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id (default: JAX's).")
_LOCAL_DEVICE_IDS = flags.DEFINE_list("local_device_ids", None, "This process's GPUs (default: JAX's).")
_VERBOSE_LIBRARIES = flags.DEFINE_bool(
  "verbose_libraries",
  False,
  "Show other libraries' INFO log lines (orbax, jax) and the tracebacks of "
  "their warnings on the console (by default only their warnings and errors, one line each).",
)

_CONFIG_NAME = "config"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_default_config = None  # the --config default of this entry point (config_flag)


def fail(message: str, code: int = EXIT_BAD_INPUT):
  """Ends the process: `error: <message>` as one line on stderr, exit status `code`."""
  line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
  sys.stderr.write(f"error: {line}\n")
  sys.stderr.flush()
  if "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized():
    exit_distributed(code)
  sys.exit(code)


def exit_distributed(code: int, shutdown_s: float = 10.0):
  """Ends a process of a multi-process job: jax.distributed's shutdown (a barrier with the other
  processes) for at most `shutdown_s`, then os._exit. A plain exit can hang forever: orbax's
  non-daemon threads may still wait in a key-value get that no other process will answer, and Python
  joins them before exiting."""
  import logging as std_logging
  import threading

  import jax

  done = threading.Event()

  def wait():
    try:
      jax.distributed.shutdown()
    except Exception:  # noqa: BLE001  the others may be gone: nothing left to say goodbye to
      pass
    done.set()

  threading.Thread(target=wait, daemon=True).start()
  done.wait(shutdown_s)
  std_logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def config_flag(default_file: str):
  """--config: a file under configs/, optionally with ':k=v,...' variant arguments."""
  global _default_config
  path = os.path.join(os.path.dirname(__file__), "..", "configs", default_file)
  _default_config = f"configs/{default_file}" if os.path.samefile(os.getcwd(), _ROOT) else path
  try:
    # Without --config on the command line, ml_collections loads the default (and applies the
    # --config.* overrides) right here, at definition time.
    return config_flags.DEFINE_config_file(
      _CONFIG_NAME, path, "Config file, optionally with ':k=v,...' variant arguments.", lock_config=True
    )
  except Exception as e:  # noqa: BLE001  any failure here comes from the command line or the config file
    fail(describe_flag_error(e, sys.argv))


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flags_parser: absl's parse, with every bad flag, config file, --config.* override, stray
  argument or unusable --workdir reported as one line (exit 2) before main runs."""
  argv = shipped_configs(argv)
  wants_help = [a for a in argv[1:] if a in HELP_FLAGS]
  argv = [a for a in argv if a not in HELP_FLAGS]
  try:
    rest = flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001  ml_collections raises KeyError, AttributeError, IOError, ...
    fail(describe_flag_error(e, argv))
  if len(rest) > 1:
    fail(
      f"{rest[1]!r}: a positional argument is not allowed: flags only, e.g. "
      f"--config={config_spec(argv, _default_config)}:k=v,... or --config.key=value"
    )
  if _CONFIG_NAME in flags.FLAGS:
    config = flags.FLAGS[_CONFIG_NAME].value
    if not isinstance(config, ml_collections.ConfigDict):  # ml_collections defers a load failure
      try:
        config.lock()
      except Exception as e:  # noqa: BLE001
        fail(describe_flag_error(e, argv))
  if wants_help:
    print(describe_entry_point(argv))
    sys.exit(0)
  check_cpu_devices(CPU_DEVICES.value)
  check_workdir(WORKDIR.value)
  return rest


HELP_FLAGS = ("--help", "-h", "--helpshort", "-?")


def describe_entry_point(argv=()) -> str:
  """--help: the entry point's docstring, its flags (this module's and its own), and every field of
  its config (the variant given with --config, if any) with the value it has and, for a shipped
  config, what the validator allows (config_doc)."""
  main = sys.modules["__main__"]
  lines = [(main.__doc__ or "").strip(), "", "Flags:"]
  seen = set()
  for module in (main, sys.modules[__name__]):
    for f in flags.FLAGS.get_key_flags_for_module(module):
      if f.name not in seen and f.name != _CONFIG_NAME:
        seen.add(f.name)
        default = "" if "default" in f.help else f" (default: {f.default!r})"
        lines.append(f"  --{f.name}: {f.help}{default}")
  if _CONFIG_NAME in flags.FLAGS:
    lines += [
      f"  --{_CONFIG_NAME}: a file under configs/ with ':k=v,...' variant arguments "
      f"(default: {_default_config}); each field below is set with --config.<key>=<value>",
      "",
      "Config fields (their values in this config, then what is allowed; meanings: docs/config.md or "
      "python -m experiments.config_doc):",
    ]
    allowed = _shipped_allowed(config_spec(argv, _default_config))
    for k, v in runlog.flat_config(flags.FLAGS[_CONFIG_NAME].value).items():
      lines.append(f"  --config.{k}={v!r}" + (f"  ({allowed[k]})" if k in allowed else ""))
  return "\n".join(lines)


def _shipped_allowed(spec: str) -> dict:
  """config_doc.summaries for a config file shipped in configs/, else {} (a user's own file)."""
  path = os.path.abspath(spec.split(":", 1)[0])
  module = f"configs.{os.path.splitext(os.path.basename(path))[0]}"
  if module not in config_doc.VARIANTS or os.path.dirname(path) != os.path.abspath(
    os.path.join(_ROOT, "configs")
  ):
    return {}
  return config_doc.summaries(module)


def check_cpu_devices(count: int) -> None:
  """Exits with one line unless `count` is at least 1 (0 crashes the CPU backend with a traceback; a
  negative count would fall back to JAX's default silently)."""
  if count < 1:
    fail(f"--cpu_devices={count} is not allowed: at least 1 CPU device per process")


def _chain(e):
  """e and every exception it was raised from or during, outermost first."""
  seen = []
  while e is not None and e not in seen:
    seen.append(e)
    e = e.__cause__ or e.__context__
  return seen


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False", tuple: "a tuple"}


def describe_flag_error(e: BaseException, argv) -> str:
  """One line for a failure to parse the command line: what was given and what is allowed."""
  chain = _chain(e)
  config_errors = [x for x in chain if isinstance(x, ConfigError)]
  if config_errors:  # a bad :k=v variant (parse_arg); ml_collections re-raises it wrapped
    return str(config_errors[-1])
  spec = config_spec(argv, _default_config)
  path = spec.split(":", 1)[0]
  if not os.path.isfile(path):
    what = "a folder" if os.path.isdir(path) else "no such file"
    return (
      f"--config: {path!r} is not allowed: {what}; a python file defining get_config(arg), "
      f"e.g. {_default_config or 'configs/default.py'}"
    )
  try:
    config = _load_config(spec)
    config.keys()
  except Exception as load_error:  # noqa: BLE001  the config file itself fails
    root = _chain(load_error)[-1]
    return f"--config: {path!r} is not allowed: it fails to load ({type(root).__name__}: {root})"
  for key, value in _overrides(argv):
    node, where = config, _CONFIG_NAME
    for part in key.split("."):
      if not isinstance(node, ml_collections.ConfigDict):
        return (
          f"{_CONFIG_NAME}.{key}: {value!r} is not allowed: {where} is a value "
          f"({type(node).__name__}), not a group of keys"
        )
      if part not in node:
        keys = ", ".join(sorted(node.keys()))
        return (
          f"{_CONFIG_NAME}.{key}: {value!r} is not allowed: {where} has no key {part!r} (its keys: {keys})"
        )
      node, where = node[part], f"{where}.{part}"
    if any(str(x).startswith(f"flag --{_CONFIG_NAME}.{key}=") for x in chain):  # absl: a bad value
      kind = type(node)
      return (
        f"{_CONFIG_NAME}.{key}: {value!r} is not allowed: "
        f"{_TYPE_NAMES.get(kind, kind.__name__)} like its default {node!r}"
      )
  if any(
    type(x).__name__ == "FlagOrderError" for x in chain
  ):  # ml_collections: overrides come after --config
    first = next((a for a in argv[1:] if a.startswith(f"--{_CONFIG_NAME}.")), "--config.<key>")
    return (
      f"{first}: an override before --{_CONFIG_NAME} is not allowed: --{_CONFIG_NAME}=<file> first, "
      f"then --{_CONFIG_NAME}.<key>=<value>"
    )
  if isinstance(e, flags.Error):  # absl's own messages are one line: an unknown flag, a bad value
    return str(e).splitlines()[0] if str(e) else type(e).__name__
  root = chain[-1]
  return f"command line {' '.join(argv[1:])!r} is not allowed: {type(root).__name__}: {root}"


def check_workdir(workdir: str | None) -> None:
  """Exits with one line unless `workdir` (default: a new folder under runs/) can be created or written.

  Nothing is created: the folder nearest to it that exists gets a probe file, removed at once.
  """
  shown = workdir if workdir else "runs/<time>"
  path = os.path.abspath(workdir or "runs")
  if os.path.exists(path) and not os.path.isdir(path):
    fail(f"--workdir: {shown!r} is not allowed: it is a file, not a folder")
  probe = path
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    fail(f"--workdir: {shown!r} is not allowed: {probe} is a file, not a folder")
  try:
    fd, tmp = tempfile.mkstemp(dir=probe, prefix=".write-probe-")
    os.close(fd)
    os.remove(tmp)
  except OSError as e:
    fail(
      f"--workdir: {shown!r} is not allowed: {probe} is not writable ({e.strerror}); a folder this "
      "process can write"
    )


def set_up_host(config=None) -> None:
  """The console's log filter (host.quiet_library_logs, off with --verbose_libraries), forced CPU
  devices (before the first device use), then jax.distributed when asked (recoverable when the
  config's runtime is elastic)."""
  quiet_library_logs(verbose=_VERBOSE_LIBRARIES.value)
  use_cpu_devices(CPU_DEVICES.value)
  rt = config.get("runtime") if config is not None else None
  if _JAX_DISTRIBUTED.value and rt is not None and rt.get("elastic") is True:
    recoverable(collective_timeout_s(rt))
  if _JAX_DISTRIBUTED.value:
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _LOCAL_DEVICE_IDS.value)


def run_or_exit(fn, *args):
  """fn(*args); bad input (a config value, a dataset), the NaN stop and a failing file system end the
  process with one line, no traceback, and their own exit codes. What the run wrote stays on disk."""
  try:
    return fn(*args)
  except (ConfigError, DatasetError) as e:
    fail(str(e), EXIT_BAD_INPUT)
  except FloatingPointError as e:  # runlog.check_finite: names the step and the last good checkpoint
    fail(str(e), EXIT_DIVERGED)
  except KeyboardInterrupt:  # Ctrl-C: the RunLog has closed (checkpoints committed, lock released)
    fail("interrupted; run the same command again to resume from the newest checkpoint", 130)
  except OSError as e:  # a full disk, a folder gone read-only under the run
    # Without a strerror, str(e) is already a sentence (e.g. one that names the last good checkpoint).
    fail(describe_os_error(e.filename, e.errno, e.strerror) if e.strerror else str(e), EXIT_IO)
  except ValueError as e:  # orbax/tensorstore report a failed write as ValueError(... [os_error_code='28'])
    got = _storage_error(str(e))
    if got is None:
      raise
    fail(describe_os_error(*got), EXIT_IO)


def _storage_error(message: str):
  """(path, errno, strerror) from a tensorstore I/O error message, or None."""
  got = runlog.tensorstore_os_error(message)
  return None if got is None else (got[0], got[1], os.strerror(got[1]))


def describe_os_error(path, code, strerror) -> str:
  name = errno.errorcode.get(code, "") if code else ""
  where = f"{path}: " if path else ""
  return (
    f"{where}{strerror}" + (f" ({name})" if name else "") + "; the files the run wrote so far are "
    "kept: fix this and rerun the same command to resume from the newest checkpoint"
  )
