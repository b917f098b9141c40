"""Markdown tables: what benchmarks and experiments print and save (a result's rows, its text)."""

import dataclasses


def markdown_table(header: list[str], rows: list[list]) -> str:
  fmt = lambda r: "| " + " | ".join(str(c) for c in r) + " |"
  return "\n".join([fmt(header), fmt(["---"] * len(header))] + [fmt(r) for r in rows])


@dataclasses.dataclass
class Table:
  """A benchmark's result: the rows it prints, and the markdown (with an optional line above) as str()."""

  header: list[str]
  rows: list[list]
  title: str = ""

  def column(self, name: str) -> list:
    i = self.header.index(name)
    return [r[i] for r in self.rows]

  def __str__(self) -> str:
    return (self.title + "\n\n" if self.title else "") + markdown_table(self.header, self.rows)


def write_table(table, path: str | None) -> None:
  """Prints a benchmark's markdown table and, with a path, saves it."""
  text = str(table)
  print(text)
  if path:
    with open(path, "w") as f:
      f.write(text + "\n")


def spread(values) -> dict:
  """{"median", "min", "max"} of a list of numbers, as the experiments' tables report a spread."""
  import numpy as np

  v = np.asarray(values, np.float64)
  return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}
