"""A DSP tick against a BP step of the same model and batch on one device, and the modeled speedups."""
import jax
import numpy as np
import optax

from ripples_jax.benchmark import compile_seconds, markdown_table, time_interleaved
from ripples_jax.pipeline import dsp, split, timing
from ripples_jax.train_dsp import measure_stage_times

CASES = {"cnn1d/mnist1d": ("cnn1d", (40, 1)), "cnn2d/cifar-shape": ("cnn2d", (32, 32, 3)),
         "resnet20/cifar-shape": ("resnet20", (32, 32, 3))}


def run(cases, stage_counts, batch_size: int, reps: int, microbatches: int = 4) -> str:
  opt = optax.sgd(0.01, momentum=0.9)
  rows = []
  for case in cases:
    name, shape = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size,) + shape).astype(np.float32)
    y = rng.integers(0, 10, size=batch_size).astype(np.int32)
    for K in stage_counts:
      stages = split.split_model(name, 10, K, sample_shape=shape)
      fresh = lambda sched: dsp.init_pipeline(stages, opt, sched, jax.random.key(0), x)
      bp = dsp.make_bp_step(stages, opt)
      gpipe = dsp.make_gpipe_step(stages, opt, microbatches)
      sched = dsp.method_schedule("dsp", K)
      tick = dsp.make_tick(stages, opt, sched, num_batches=10**9)
      holder = {"bp": fresh(sched), "gpipe": fresh(sched), "dsp": fresh(sched)}
      compile_s = {"bp": compile_seconds(bp, holder["bp"], x, y),
                   "dsp": compile_seconds(tick, holder["dsp"], x, y, 0)}
      ticks = [0]

      def call_bp():
        holder["bp"], m = bp(holder["bp"], x, y)
        return m

      def call_gpipe():
        holder["gpipe"], m = gpipe(holder["gpipe"], x, y)
        return m

      def call_dsp():
        ticks[0] += 1
        holder["dsp"], m = tick(holder["dsp"], x, y, ticks[0])
        return m
      med = time_interleaved({"bp": call_bp, "gpipe": call_gpipe, "dsp": call_dsp}, reps=reps, warmup=3)
      fwd, bwd = measure_stage_times(stages, holder["bp"], x)
      eq_f, eq_b = [1.0] * K, [2.0] * K
      rows.append([case, K, f"{1e3 * med['bp']:.2f}", f"{1e3 * med['dsp']:.2f}",
                   f"{med['dsp'] / med['bp']:.2f}", f"{1e3 * med['gpipe']:.2f}",
                   f"{timing.speedup_vs_bp('dsp', fwd, bwd):.2f}",
                   f"{timing.speedup_vs_bp('gpipe', fwd, bwd, microbatches=microbatches):.2f}",
                   f"{timing.speedup_vs_bp('dsp', eq_f, eq_b):.2f}",
                   f"{timing.speedup_vs_bp('dsp', eq_f, eq_b, fused=False):.2f}",
                   f"{timing.speedup_vs_bp('gpipe', eq_f, eq_b, microbatches=microbatches):.2f}",
                   f"{timing.speedup_vs_bp('gpipe', eq_f, eq_b, microbatches=microbatches, remat=False):.2f}",
                   f"{compile_s['dsp']:.1f}"])
  header = ["model", "K", "BP step ms", "DSP tick ms", "tick/BP", "GPipe step ms",
            "DSP speedup (measured stages)", f"GPipe M={microbatches} (measured)", "DSP equal, fused",
            "DSP equal, unfused", f"GPipe M={microbatches} equal, remat", "GPipe equal, no remat",
            "DSP compile s"]
  return (f"one {jax.default_backend()} device, batch {batch_size}, median of {reps} interleaved reps; "
          "speedups from the timing model (B = 2F for 'equal')\n\n" + markdown_table(header, rows))
