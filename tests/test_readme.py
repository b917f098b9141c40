"""Every `python -m <module>` command in README.md, WORKSPACE.md and docs/ names a module that exists."""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "WORKSPACE.md", "docs/usage.md", "docs/design.md")


def commands():
  found = []
  for doc in DOCS:
    with open(os.path.join(ROOT, doc)) as f:
      for i, line in enumerate(f, 1):
        found += [(doc, i, m) for m in re.findall(r"python -m ([A-Za-z_][\w.]*\w)", line)]
  return found


def test_the_docs_name_modules():
  assert len(commands()) > 10


@pytest.mark.parametrize("doc,line,module", commands(), ids=lambda v: str(v))
def test_module_exists(doc, line, module):
  try:
    spec = importlib.util.find_spec(module)
  except ModuleNotFoundError:  # a parent package is missing
    spec = None
  assert spec is not None, f"{doc}:{line}: python -m {module}: no such module"
