r"""Runs N worker processes of experiments.train on this machine (the asynchronous runtime, locally).

  python -m experiments.launch --num_processes=4 -- \
      --config=configs/default.py:executor=async,num_workers=4,algorithm=ripples_smart \
      --config.hetero.slow_workers='(3,)' --config.hetero.slowdown=2 --workdir=runs/async

Everything after `--` goes to the entry point (--module, default experiments.train), which each child
runs with --jax_distributed and the coordinator on 127.0.0.1 and a free port (--port to choose one).
An executor=async run gets one more process, its coordinator (process 0, log prefix [c]: it hosts the
coordination service, the Group Generator and the run's records, and trains nothing); --num_processes
counts the workers. The coordination service and gloo's listeners (the CPU collectives) are on
loopback only. Logs are prefixed [w<id>]. The first process to exit non-zero is named (or the cause its
last lines show: a stalled worker its watchdog named, an unknown process that registered at the
coordinator) and the others are stopped (SIGTERM, then SIGKILL after --grace_s); so are all on
SIGTERM, SIGINT or SIGHUP to the launcher. The exit code is that process's (128 + k for signal k), or
128 + k after signal k to the launcher. Bad input (a flag that does not parse, or a value that cannot
run) is one line on stderr and exit code 2, before anything starts; more workers than CPU cores is one
warning line.

Several nodes (torchrun's flags): one launcher per node, each starting --num_processes workers and
restarting its own (--max_restarts); node 0 also runs the coordinator at --coordinator_address, which
every node reaches:

  openssl rand -hex 32 > /shared/run.secret      # once; the same file on every node
  python -m experiments.launch --nnodes=2 --node_rank=R --coordinator_address=HEAD:29500 \
      --secret_file=/shared/run.secret --num_processes=8 --max_restarts=3 -- \
      --config=configs/default.py:executor=async,num_workers=16 \
      --config.runtime.elastic=True --workdir=/shared/runs/async

An elastic run survives the loss of a whole node other than node 0 (its workers leave the run); node 0
hosts the coordinator, and its loss ends the run on every node (rerun every node's command: the run
resumes from the newest marker). Or run experiments.train with --jax_distributed once per host/GPU,
plus one coordinator process for executor=async (docs/usage.md).
"""

import re
import sys

from absl import app, flags

from ripples_jax.distributed.launcher import Node, launch

from . import config_args

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 4, "Worker processes to start.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 1, "CPU devices per process.")
_PLATFORM = flags.DEFINE_string(
  "platform",
  "auto",
  "JAX_PLATFORMS for the children: auto (this process's "
  "JAX_PLATFORMS if set, else cuda when this host has NVIDIA GPUs, one per "
  "worker, else cpu), cpu, cuda, tpu, or '' (JAX's default).",
)
_GRACE = flags.DEFINE_float("grace_s", 30.0, "Seconds between SIGTERM and SIGKILL when stopping workers.")
_MODULE = flags.DEFINE_string(
  "module", f"{__package__ or 'experiments'}.train", "The entry point each process runs."
)
_PORT = flags.DEFINE_integer("port", 0, "The coordinator's port on 127.0.0.1 (0: a free one).")
_MAX_RESTARTS = flags.DEFINE_integer(
  "max_restarts",
  0,
  "Restarts after a failure (torchrun's name). An elastic run (--config.runtime.elastic=True): per "
  "worker, the others go on and the restarted worker rejoins. Otherwise every process restarts and "
  "resumes from the newest checkpoint.",
)
_NNODES = flags.DEFINE_integer("nnodes", 1, "Nodes of the job (torchrun's name); one launcher runs on each.")
_NODE_RANK = flags.DEFINE_integer(
  "node_rank", 0, "This node's rank, 0..nnodes-1: node r starts workers r*N..r*N+N-1; node 0 the coordinator."
)
_COORDINATOR_ADDRESS = flags.DEFINE_string(
  "coordinator_address",
  "",
  "HOST:PORT of node 0's coordinator, which every node reaches (required with --nnodes > 1; default: "
  "127.0.0.1 and --port).",
)
_NODE_ADDRESS = flags.DEFINE_string(
  "node_address",
  "",
  "Where this node's workers' gloo listeners bind (default: loopback for a loopback coordinator, else "
  "what the host's name resolves to).",
)
_MALLOC = flags.DEFINE_string(
  "malloc",
  "default",
  "default, or tuned: glibc's allocator tunables for the children (ripples_jax.allocator: one arena, "
  "no mmap, no trim, huge pages), for processes whose programs allocate large temporaries every call, "
  "e.g. per-process pipeline stages (docs/usage.md).",
)
_SECRET_FILE = flags.DEFINE_string(
  "secret_file",
  "",
  "A file whose one line is the run's secret (every value the run's processes write to the coordination "
  "store carries a MAC under it): required with --nnodes > 1, the same file on every node, unless "
  "RIPPLES_RUN_SECRET is set; one node makes a fresh secret.",
)
_OWN = (
  _NUM_PROCESSES,
  _CPU_DEVICES,
  _PLATFORM,
  _GRACE,
  _MODULE,
  _PORT,
  _MAX_RESTARTS,
  _NNODES,
  _NODE_RANK,
  _COORDINATOR_ADDRESS,
  _NODE_ADDRESS,
  _MALLOC,
  _SECRET_FILE,
)
_KINDS = {"int": "an integer", "float": "a number"}


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flags_parser: absl's parse, with a flag error as one line and exit code 2 (app.run would
  print its usage hint and exit 1: other bad input exits 2). --help still prints the help."""
  if any(a in ("--help", "-h", "--helpshort", "-?") for a in argv[1:]):
    own = "\n".join(f"  --{h.name}: {flags.FLAGS[h.name].help} (default: {h.default!r})" for h in _OWN)
    print(f"{__doc__.strip()}\n\nFlags (the entry point's own go after --; its --help lists them):\n{own}")
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.stderr.write(f"error: {describe_flag_error(e)}\n")
    sys.exit(2)


def describe_flag_error(e: flags.Error) -> str:
  """absl's message, as `--flag=value is not allowed: <kind>` for a value that does not parse, with this
  launcher's flags listed for an unknown one (the entry point's belong after --)."""
  message = str(e).splitlines()[0] if str(e) else type(e).__name__
  bad_value = re.match(r"flag --(\w+)=(.*?): ", message)
  if bad_value and bad_value.group(1) in flags.FLAGS:
    kind = _KINDS.get(flags.FLAGS[bad_value.group(1)].flag_type())
    if kind:
      return f"--{bad_value.group(1)}={bad_value.group(2)} is not allowed: {kind}"
  if isinstance(e, flags.UnrecognizedFlagError):
    own = ", ".join(f"--{f.name}" for f in _OWN)
    return f"{message} (the launcher's flags: {own}; the entry point's go after --)"
  return message


def main(argv):
  try:
    code = launch(
      _NUM_PROCESSES.value,
      argv[1:],
      _MODULE.value,
      _CPU_DEVICES.value,
      _PLATFORM.value,
      _GRACE.value,
      port=_PORT.value,
      coordinator=config_args.needs_coordinator(_MODULE.value, argv[1:]),
      max_restarts=_MAX_RESTARTS.value,
      elastic=config_args.runs_elastic(_MODULE.value, argv[1:]),
      node=Node(_NNODES.value, _NODE_RANK.value, _COORDINATOR_ADDRESS.value, _NODE_ADDRESS.value),
      malloc=_MALLOC.value,
      secret_file=_SECRET_FILE.value,
    )
  except ValueError as e:  # bad input, found before anything starts
    sys.stderr.write(f"error: {e}\n")
    sys.exit(2)
  sys.exit(code)


def cli():  # the console script (pyproject [project.scripts])
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
