r"""Engine overhead: Ripples round vs a conventional data-parallel step, side by side in one process.

  python -m experiments.bench_engine        # 8 forced CPU devices, CNN1D and CNN2D, batch 32/worker

Target: a Ripples static round costs at most 1.15x the data-parallel (gradient all-reduce) step.
"""
from absl import app, flags

from ripples_jax.platform import force_host_devices, write_table

_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "CPU devices to force on the host.")
_CASES = flags.DEFINE_list("cases", ["cnn1d/mnist1d", "cnn2d/cifar-shape"], "Model cases.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Per-worker batch.")
_REPS = flags.DEFINE_integer("reps", 40, "Timed repetitions per variant.")
_OUT = flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def main(argv):
  del argv
  force_host_devices(_CPU_DEVICES.value)
  from ripples_jax.bench_engine import run
  table = run(_CASES.value, _BATCH.value, _REPS.value)
  write_table(table, _OUT.value)


if __name__ == "__main__":
  app.run(main)
