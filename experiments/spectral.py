r"""Spectral gap of one round's averaging against group size, for each Group Generator (16 workers).

  python -m experiments.spectral --out=results/spectral
"""
import os

from absl import app, flags

_OUT = flags.DEFINE_string("out", "results/spectral", "Output folder (table.md, spectral_gap.png).")
_WORKERS = flags.DEFINE_integer("workers", 16, "Workers.")
_SAMPLES = flags.DEFINE_integer("samples", 2000, "Monte Carlo rounds per random generator.")


def main(argv):
  del argv
  from ripples_jax.reproduce import spectral_figure
  os.makedirs(_OUT.value, exist_ok=True)
  print(spectral_figure(_OUT.value, _WORKERS.value, _SAMPLES.value))


if __name__ == "__main__":
  app.run(main)
