"""The house's rules that a grep can check: the hybrid defines no second copy of what another module
owns (one Ripples), and no import runs back up to an executor from the layers below."""

import ast
import glob
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "ripples_jax")
EXECUTOR_ENTRY = {"run"}  # run.EXECUTORS' function name: every executor module defines its own


def top_level_names(path: str) -> set:
  names = set()
  for node in ast.parse(open(path).read()).body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return names


def test_the_hybrid_shadows_no_library_name():
  """hybrid/ (which composes the pipeline and Ripples' owners) defines no top-level name that a module
  outside it defines, but each executor's `run` (the fourth pass found 25: a second Service,
  encode/decode, pack_rounds, Trace types, ...)."""
  library, hybrid = {}, {}
  for path in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
    into = hybrid if f"{os.sep}hybrid{os.sep}" in path else library
    for name in top_level_names(path):
      into.setdefault(name, []).append(os.path.relpath(path, ROOT))
  shadowed = {n: (hybrid[n], library[n]) for n in hybrid if n in library and n not in EXECUTOR_ENTRY}
  assert not shadowed, shadowed


def test_no_layer_imports_an_executor():
  """The layers below the executors (schedule/, timeline/, runlog/, distributed/, models/, data/,
  workload.py, engine.py, algorithms.py, losses.py) import no executor (sim, spmd, runtime/,
  pipeline/, hybrid/) and not config.py or run.py: imports go down."""
  executors = ("ripples_jax.sim", "ripples_jax.spmd", "ripples_jax.runtime", "ripples_jax.pipeline")
  executors += ("ripples_jax.hybrid", "ripples_jax.config", "ripples_jax.run")
  below = ["schedule", "timeline", "runlog", "distributed", "models", "data"]
  files = [p for d in below for p in glob.glob(os.path.join(ROOT, d, "*.py"))]
  files += [os.path.join(ROOT, f) for f in ("workload.py", "engine.py", "algorithms.py", "losses.py")]
  bad = []
  for path in files:
    for node in ast.walk(ast.parse(open(path).read())):
      mods = []
      if isinstance(node, ast.ImportFrom) and node.module:
        mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
      bad += [
        (os.path.relpath(path, ROOT), m)
        for m in mods
        if any(m == e or m.startswith(e + ".") for e in executors)
      ]
  assert not bad, bad
