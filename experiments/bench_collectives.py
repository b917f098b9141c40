r"""P-Reduce step time for every layout the schedules emit, against a full all-reduce of the same bytes.

  python -m experiments.bench_collectives            # 8 forced CPU devices, 64K and 1M float32/device

Prints a markdown table: median seconds per call (interleaved reps in one process), the ratio to the
full all-reduce, and compile seconds. 'direct' is one compiled program per layout (p_reduce's cache);
'switched' is the engine's form: one program over all layouts with the layout index as data.
"""
from absl import app, flags

from ripples_jax.platform import force_host_devices, write_table

_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "CPU devices to force on the host.")
_SIZES = flags.DEFINE_list("sizes", ["65536", "1048576"], "float32 elements per device.")
_REPS = flags.DEFINE_integer("reps", 40, "Timed repetitions per variant.")
_OUT = flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def main(argv):
  del argv
  force_host_devices(_CPU_DEVICES.value)
  from ripples_jax.bench_collectives import run
  table = run([int(s) for s in _SIZES.value], _REPS.value)
  write_table(table, _OUT.value)


if __name__ == "__main__":
  app.run(main)
