r"""Spectral gap of one round's averaging against group size, for each Group Generator (16 workers).

  python -m experiments.spectral --out=results/spectral

Writes table.md and spectral_gap.png (ripples_jax.analysis.spectral_table: Monte Carlo for the random
generators, exact over one period for the periodic ones).
"""

import os

from absl import app, flags

from ripples_jax import analysis
from ripples_jax.tables import markdown_table

_OUT = flags.DEFINE_string("out", "results/spectral", "Output folder (table.md, spectral_gap.png).")
_WORKERS = flags.DEFINE_integer("workers", 16, "Workers.")
_SAMPLES = flags.DEFINE_integer("samples", 2000, "Monte Carlo rounds per random generator.")


def spectral_figure(out_dir: str, n: int = 16, samples: int = 2000) -> str:
  """Writes spectral_gap.png and table.md into out_dir; returns the markdown."""
  table = analysis.spectral_table(n, samples)
  analysis.spectral_gap_figure(table, os.path.join(out_dir, "spectral_gap.png"), n)
  sizes = sorted({g for row in table.values() for g in row})
  rows = [[name] + [f"{row[g]:.3f}" if g in row else "-" for g in sizes] for name, row in table.items()]
  md = markdown_table(["generator"] + [f"g={g}" for g in sizes], rows)
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write(md + "\n")
  return md


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  print(spectral_figure(_OUT.value, _WORKERS.value, _SAMPLES.value))


if __name__ == "__main__":
  app.run(main)
