"""The config reference: every field of configs/default.py and configs/dsp.py with its default, the
values the validator allows (and for which executor, algorithm, placement or method) and its meaning.

  python -m experiments.config_doc                       # print it (markdown)
  python -m experiments.config_doc --out=docs/config.md  # the copy in docs/ (a test keeps it current)
"""

from absl import app, flags

from ripples_jax import config_doc

_OUT = flags.DEFINE_string("out", None, "Write the reference to this file instead of printing it.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  text = config_doc.document()
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)
    print(f"config reference: {_OUT.value}")
  else:
    print(text, end="")


if __name__ == "__main__":
  app.run(main)
