"""The wheel's packages, found rather than listed (pyproject.toml holds every other setting): each folder
with an __init__.py under ripples_jax/, and under the top-level folders that pyproject's
[tool.setuptools.package-dir] ships inside the package (experiments/ as ripples_jax.experiments, configs/
as ripples_jax.configs). tests/, benchmarks/ and examples/ are not shipped.

pyproject's packages.find cannot do this alone: it names what it finds by the folder's own path, so
experiments/ would install as a generic top-level `experiments`.
"""

import os
import tomllib

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def packages() -> list[str]:
  """Every package the wheel ships, by its installed name."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    mapped = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
  found = find_packages(ROOT, include=["ripples_jax", "ripples_jax.*"])
  for name, folder in mapped.items():
    found += [name] + [f"{name}.{p}" for p in find_packages(os.path.join(ROOT, folder))]
  return found


setup(packages=packages())
