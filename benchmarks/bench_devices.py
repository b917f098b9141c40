r"""placement=devices beside one_device and per_process: the time per tick, measured side by side.

  python -m benchmarks.bench_devices --models=cnn1d,cnn2d --json_out=results/pipeline_devices/ticks.json

For each model (K=2 stages, CIFAR-shaped synthetic data for CNN2D and MNIST-1D-shaped for CNN1D, batch
64) and each method (DSP as published, recompute; PipeDream-1F1B):
- one_device (every stage in one jitted tick) and devices (stage k on CPU device k of this process,
  pipeline/devices.py), in this process, interleaved block by block: --reps blocks of --ticks ticks
  each after a warm-up, each block's order rotated; the time per tick of a block is its wall time over
  its ticks, with the state ready at both ends;
- per_process: --launches launches of the two stage processes (benchmarks.pipeline.run_variant, one
  stage per core), their measured iteration (the slowest stage's steady tick spacing).
Printed and written: the medians with their spread, devices / one_device paired per block, and
devices / per_process over the medians (the issue's CNN1D target: <= 1/3).
"""

import json
import os
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks.timing import spread

FLAGS = flags.FLAGS
SHAPES = {"cnn1d": (40, 1), "cnn2d": (32, 32, 3)}


def define_flags() -> None:
  flags.DEFINE_list("models", ["cnn1d", "cnn2d"], "Models, split into 2 stages.")
  flags.DEFINE_list("methods", ["dsp", "pipedream"], "Tick methods.")
  flags.DEFINE_integer("ticks", 20, "Ticks per timed block.")
  flags.DEFINE_integer("reps", 5, "Timed blocks per placement (in this process).")
  flags.DEFINE_integer("launches", 3, "per_process launches per model and method (0: none).")
  flags.DEFINE_string("json_out", None, "Where the JSON goes.")


def _stepper(config, placement: str):
  """(advance(n): run n ticks and wait for the state, the tick it is at) for one in-process placement."""
  import jax

  from ripples_jax.pipeline import devices
  from ripples_jax.pipeline import train as pipeline_train

  c = config.copy_and_resolve_references()
  c.placement = placement
  _, state, run = pipeline_train._setup(c)
  if placement == "devices":
    state = devices.place(state, devices.stage_devices(c.num_stages))
  box = {"state": state, "t": 0}
  n = run["num_batches"]

  def advance(ticks: int) -> None:
    for _ in range(ticks):
      t = box["t"] % n  # the data wraps; the schedule's warm-up is behind the first block
      box["state"], _ = run["step"](box["state"], run["feed"].x(t), run["feed"].labels(t), box["t"])
      box["t"] += 1
    jax.block_until_ready(box["state"])

  return advance


def in_process(config, ticks: int, reps: int) -> dict:
  steppers = {p: _stepper(config, p) for p in ("one_device", "devices")}
  for advance in steppers.values():
    advance(5)  # compile and warm
  per_tick = {p: [] for p in steppers}
  for r in range(reps):
    for p in list(steppers)[r % 2 :] + list(steppers)[: r % 2]:
      t0 = time.perf_counter()
      steppers[p](ticks)
      per_tick[p].append((time.perf_counter() - t0) / ticks)
  return per_tick


def per_process(config, launches: int) -> list:
  from benchmarks.pipeline import run_variant

  out = []
  for _ in range(launches):
    c = config.copy_and_resolve_references()
    c.placement = "per_process"
    with tempfile.TemporaryDirectory() as tmp:
      out.append(float(run_variant(c, os.path.join(tmp, "run"))["iteration_s"]))
  return out


def main(argv):
  del argv
  from ripples_jax.distributed.host import use_cpu_devices

  use_cpu_devices(8)  # before the first device use: the stages' devices
  from benchmarks.pipeline import bench_config

  rows = {}
  for model in FLAGS.models:
    for method in FLAGS.methods:
      c = bench_config(2, model, 60, input_shape=SHAPES[model], method=method)
      ticks = in_process(c, FLAGS.ticks, FLAGS.reps)
      row = {p: spread(v) for p, v in ticks.items()}
      row["devices_over_one_device"] = spread(np.divide(ticks["devices"], ticks["one_device"]))
      if FLAGS.launches:
        pp = per_process(c, FLAGS.launches)
        row["per_process"] = spread(pp)
        row["devices_over_per_process"] = row["devices"]["median"] / row["per_process"]["median"]
      rows[f"{model}/{method}"] = row
      print(
        f"{model:6s} {method:9s} ms/tick: one_device {1e3 * row['one_device']['median']:.2f}  devices "
        f"{1e3 * row['devices']['median']:.2f} ({row['devices_over_one_device']['median']:.2f}x of one_device"
        + (
          f"); per_process {1e3 * row['per_process']['median']:.2f} (devices "
          f"{row['devices_over_per_process']:.2f}x of it)"
          if "per_process" in row
          else ")"
        ),
        flush=True,
      )
  out = {
    "rows": rows,
    "ticks": FLAGS.ticks,
    "reps": FLAGS.reps,
    "launches": FLAGS.launches,
    "cores": os.cpu_count(),
  }
  if FLAGS.json_out:
    os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
