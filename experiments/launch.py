r"""Runs N worker processes of experiments.train on this machine (the asynchronous runtime, locally).

  python -m experiments.launch --num_processes=4 -- \
      --config=configs/default.py:executor=async,num_workers=4,algorithm=ripples_smart \
      --config.hetero.slow_workers='(3,)' --config.hetero.slowdown=2 --workdir=runs/async

Everything after `--` goes to the entry point (--module, default experiments.train), which each child
runs with --jax_distributed and the coordinator on 127.0.0.1 and a free port (--port to choose one);
the coordination service listens on loopback only. Logs are prefixed [w<id>]. The first worker to exit
non-zero is named and the others are stopped (SIGTERM, then SIGKILL after --grace_s); so are all on
SIGTERM, SIGINT or SIGHUP to the launcher. The exit code is that worker's (128 + k for signal k), or
128 + k after signal k to the launcher. On a cluster, run experiments.train with --jax_distributed once
per host/GPU instead (README).
"""
import sys

from absl import app, flags

from ripples_jax.runtime.launcher import launch

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 4, "Worker processes to start.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 1, "CPU devices per process.")
_PLATFORM = flags.DEFINE_string("platform", "auto", "JAX_PLATFORMS for the children: auto (this process's "
                                "JAX_PLATFORMS if set, else cuda when this host has NVIDIA GPUs, one per "
                                "worker, else cpu), cpu, cuda, tpu, or '' (JAX's default).")
_GRACE = flags.DEFINE_float("grace_s", 30.0, "Seconds between SIGTERM and SIGKILL when stopping workers.")
_MODULE = flags.DEFINE_string("module", f"{__package__ or 'experiments'}.train",
                              "The entry point each process runs.")
_PORT = flags.DEFINE_integer("port", 0, "The coordinator's port on 127.0.0.1 (0: a free one).")


def main(argv):
  try:
    code = launch(_NUM_PROCESSES.value, argv[1:], _MODULE.value, _CPU_DEVICES.value, _PLATFORM.value,
                  _GRACE.value, port=_PORT.value)
  except ValueError as e:  # bad input, found before anything starts
    sys.stderr.write(f"error: {e}\n")
    sys.exit(2)
  sys.exit(code)


def cli():  # the console script (pyproject [project.scripts])
  app.run(main)


if __name__ == "__main__":
  app.run(main)
