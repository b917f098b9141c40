r"""A DSP tick vs a BP step (one device, same model and batch), plus the modeled speedups over BP.

  python -m benchmarks.bench_dsp

Targets: tick/BP <= 1.4; DSP's modeled speedup at equal stages >= 0.9 K fused (an upper bound: the
fused call charged one forward) and 3K/4 unfused; GPipe's follows its bubble (K-1)/(M+K-1). The
measured-stage column is unfused, as the one-process tick and the runtime's recompute mode run it.
"""

import jax
import numpy as np
import optax
from absl import app, flags

from benchmarks.timing import Table, compile_seconds, time_interleaved, write_table
from ripples_jax.models import split
from ripples_jax.pipeline import baselines, tick, timing

FLAGS = flags.FLAGS

CASES = {
  "cnn1d/mnist1d": ("cnn1d", (40, 1)),
  "cnn2d/cifar-shape": ("cnn2d", (32, 32, 3)),
  "resnet20/cifar-shape": ("resnet20", (32, 32, 3)),
}


def define_flags() -> None:
  flags.DEFINE_list("cases", ["cnn1d/mnist1d", "cnn2d/cifar-shape", "resnet20/cifar-shape"], "Models.")
  flags.DEFINE_list("stages", ["2", "4"], "Stage counts K.")
  flags.DEFINE_integer("batch_size", 64, "Batch.")
  flags.DEFINE_integer("reps", 30, "Timed repetitions per variant.")
  flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def run(
  cases=tuple(CASES), stage_counts=(2, 4), batch_size: int = 64, reps: int = 30, microbatches: int = 4
) -> Table:
  """One row per (case, K): measured BP / DSP / GPipe step times and the timing model's speedups."""
  opt = optax.sgd(0.01, momentum=0.9)
  rows = []
  for case in cases:
    name, shape = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size,) + shape).astype(np.float32)
    y = rng.integers(0, 10, size=batch_size).astype(np.int32)
    for K in stage_counts:
      stages = split.split_model(name, 10, K, sample_shape=shape)
      fresh = lambda sched: tick.init_pipeline(stages, opt, sched, jax.random.key(0), x)
      bp = baselines.make_bp_step(stages, opt)
      gpipe = baselines.make_gpipe_step(stages, opt, microbatches)
      sched = tick.method_schedule("dsp", K)
      step = tick.make_tick(stages, opt, sched, num_batches=10**9)
      holder = {"bp": fresh(sched), "gpipe": fresh(sched), "dsp": fresh(sched)}
      compile_s = {
        "bp": compile_seconds(bp, holder["bp"], x, y),
        "dsp": compile_seconds(step, holder["dsp"], x, y, 0),
      }
      ticks = [0]

      def call_bp():
        holder["bp"], m = bp(holder["bp"], x, y)
        return m

      def call_gpipe():
        holder["gpipe"], m = gpipe(holder["gpipe"], x, y)
        return m

      def call_dsp():
        ticks[0] += 1
        holder["dsp"], m = step(holder["dsp"], x, y, ticks[0])
        return m

      med = time_interleaved({"bp": call_bp, "gpipe": call_gpipe, "dsp": call_dsp}, reps=reps, warmup=3)
      fwd, bwd = timing.measure_stage_times(stages, holder["bp"], x)
      eq_f, eq_b = [1.0] * K, [2.0] * K
      rows.append(
        [
          case,
          K,
          f"{1e3 * med['bp']:.2f}",
          f"{1e3 * med['dsp']:.2f}",
          f"{med['dsp'] / med['bp']:.2f}",
          f"{1e3 * med['gpipe']:.2f}",
          f"{timing.speedup_vs_bp('dsp', fwd, bwd, fused=False):.2f}",
          f"{timing.speedup_vs_bp('gpipe', fwd, bwd, microbatches=microbatches):.2f}",
          f"{timing.speedup_vs_bp('dsp', eq_f, eq_b, fused=True):.2f}",
          f"{timing.speedup_vs_bp('dsp', eq_f, eq_b, fused=False):.2f}",
          f"{timing.speedup_vs_bp('gpipe', eq_f, eq_b, microbatches=microbatches):.2f}",
          f"{timing.speedup_vs_bp('gpipe', eq_f, eq_b, microbatches=microbatches, remat=False):.2f}",
          f"{compile_s['dsp']:.1f}",
        ]
      )
  header = [
    "model",
    "K",
    "BP step ms",
    "DSP tick ms",
    "tick/BP",
    "GPipe step ms",
    "DSP speedup (measured stages, recompute as a second forward: what runs)",
    f"GPipe M={microbatches} (measured)",
    "DSP equal, fused",
    "DSP equal, unfused",
    f"GPipe M={microbatches} equal, remat",
    "GPipe equal, no remat",
    "DSP compile s",
  ]
  return Table(
    header,
    rows,
    f"one {jax.default_backend()} device, batch {batch_size}, median of {reps} "
    "interleaved reps; speedups from the timing model (B = 2F for 'equal')",
  )


def main(argv):
  del argv
  write_table(run(FLAGS.cases, [int(k) for k in FLAGS.stages], FLAGS.batch_size, FLAGS.reps), FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
