r"""A DSP tick vs a BP step (one device, same model and batch), plus the modeled speedups over BP.

  python -m experiments.bench_dsp

Targets: tick/BP <= 1.4; DSP's modeled speedup at equal stages >= 0.9 K (fused); GPipe's follows its
bubble (K-1)/(M+K-1).
"""
from absl import app, flags

from ripples_jax.platform import write_table

_CASES = flags.DEFINE_list("cases", ["cnn1d/mnist1d", "cnn2d/cifar-shape", "resnet20/cifar-shape"], "Models.")
_STAGES = flags.DEFINE_list("stages", ["2", "4"], "Stage counts K.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Batch.")
_REPS = flags.DEFINE_integer("reps", 30, "Timed repetitions per variant.")
_OUT = flags.DEFINE_string("out", None, "Optional path for the table (markdown).")


def main(argv):
  del argv
  from ripples_jax.bench_dsp import run
  write_table(run(_CASES.value, [int(k) for k in _STAGES.value], _BATCH.value, _REPS.value), _OUT.value)


if __name__ == "__main__":
  app.run(main)
