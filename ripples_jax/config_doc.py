"""The config reference: every field of a shipped config with its default, what the validator allows
and what the field means, read off the code that owns each part.

- Allowed: the checks `config.validate_train_config` / `validate_dsp_config` make, noted while they run
  (config.noting_checks) on each variant of VARIANTS (every executor with each of its algorithms; every
  placement with each method). A check made only for some variants is listed with them. Cross-field
  rules (a group size that must divide the workers, ...) show in the validator's one-line errors.
- Meaning: the comments beside the field's line in the config file (and the comment lines that continue
  them), or a comment block right above a field line without its own.

`python -m experiments.config_doc` prints it; docs/config.md is its output (a test keeps them equal).
"""

import ast
import importlib
import io
import tokenize

import ml_collections

from ripples_jax import config as config_lib
from ripples_jax.pipeline import methods
from ripples_jax.pipeline.methods import PLACEMENTS


def _train_variants():
  for executor, algorithms in config_lib.ALGORITHMS_OF.items():
    for algorithm in algorithms:
      n = 8
      layouts = ("node", "hypercube") if algorithm == "ripples_static" else ("node",)
      for layout in layouts:
        arg = f"executor={executor},algorithm={algorithm},num_workers={n},layout={layout}"
        kwargs = {"num_devices": 8, "num_processes": n + 1 if executor == "async" else 1}
        yield {"executor": executor, "algorithm": algorithm, "layout": layout}, arg, kwargs


def _dsp_variants():
  for placement in PLACEMENTS:
    for method in methods.names(placement):
      arg = f"method={method}"
      kwargs = {"num_processes": 2 if placement == "per_process" else 1}
      if placement in ("devices", "spmd"):
        kwargs["local_devices"] = 8  # the document must not depend on this machine's devices
      yield {"placement": placement, "method": method}, arg, {"placement": placement, **kwargs}


# config module -> (its validator, its variants: (condition, :arg, validator kwargs)).
VARIANTS = {
  "configs.default": (config_lib.validate_train_config, _train_variants),
  "configs.dsp": (config_lib.validate_dsp_config, _dsp_variants),
}


def config_module(name: str):
  """configs.<x> from a checkout, or ripples_jax.configs.<x> where the package is installed."""
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError:
    return importlib.import_module(f"ripples_jax.{name}")


def _validate(validate, c, kwargs):
  placement = kwargs.pop("placement", None)
  if placement:
    c.placement = placement
  return config_lib.noting_checks(validate, c, **kwargs)


def allowed_values(module: str) -> dict:
  """{key: [(allowed, [condition, ...]), ...]} over the module's variants, in the order checked."""
  validate, variants = VARIANTS[module]
  get_config = config_module(module).get_config
  seen = {}
  for condition, arg, kwargs in variants():
    for key, allowed in dict.fromkeys(_validate(validate, get_config(arg), dict(kwargs))):
      seen.setdefault(key, {}).setdefault(allowed, []).append(condition)
  return {k: list(v.items()) for k, v in seen.items()}


def _where(conditions: list, every: list) -> str:
  """The variants a check applies to, briefly: '' for all, else the values of each dimension that
  cover them (executor=sim|async), or the listed combinations."""
  if len(conditions) == len(every):
    return ""
  for dim in every[0]:
    values = list(dict.fromkeys(c[dim] for c in conditions))
    if len(conditions) == sum(c[dim] in values for c in every):
      return f"{dim}=" + "|".join(values)
  for a in every[0]:  # two dimensions: executor=async with algorithm=adpsgd|...
    for b in every[0]:
      if a == b or len({c[a] for c in conditions}) != 1:
        continue
      values = list(dict.fromkeys(c[b] for c in conditions))
      if len(conditions) == sum(c[a] == conditions[0][a] and c[b] in values for c in every):
        return f"{a}={conditions[0][a]} with {b}=" + "|".join(values)
  return "; ".join(",".join(f"{d}={c[d]}" for d in every[0]) for c in conditions)


def field_comments(path: str) -> dict:
  """{key: meaning}, in the file's order, from the comments of a config file's `c.<key> = ...` lines
  (see the module doc)."""
  source = open(path).read()
  comments = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string.lstrip("#").strip()
  lines = source.splitlines()
  comment_only = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
  fields = {}
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      key = _dotted(node.targets[0])
      if key:
        fields[key] = (node.lineno, node.end_lineno)
  out, claimed = {}, set()
  for key, (first, last) in sorted(fields.items(), key=lambda kv: kv[1]):
    own = [comments[n] for n in range(first, last + 1) if n in comments and n not in comment_only]
    if own:
      n = last + 1
      while n in comment_only:  # the comment lines right below continue it
        own.append(comments[n])
        claimed.add(n)
        n += 1
    else:
      n, above = first - 1, []
      while n in comment_only and n not in claimed:
        above.insert(0, comments[n])
        n -= 1
      own = above
    out[key] = " ".join(own)
  return out


def _dotted(node) -> str | None:
  """'a.b' for the target `c.a.b`, else None."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.insert(0, node.attr)
    node = node.value
  return ".".join(parts) if isinstance(node, ast.Name) and node.id == "c" and parts else None


def _flatten(c, prefix=""):
  for k, v in c.items():
    if isinstance(v, ml_collections.ConfigDict):
      yield from _flatten(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def summaries(module: str) -> dict:
  """{key: what the validator allows, with the variants each check applies to}."""
  every = [condition for condition, _, _ in VARIANTS[module][1]()]
  return {
    key: "; ".join(a + (f" ({w})" if (w := _where(cs, every)) else "") for a, cs in checks)
    for key, checks in allowed_values(module).items()
  }


def reference(module: str) -> str:
  """The markdown table of one config module: field, default, allowed (and where), meaning."""
  allowed = summaries(module)
  meaning = field_comments(config_module(module).__file__)
  rows = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
  values = dict(_flatten(config_module(module).get_config()))
  order = list(meaning) + sorted(set(values) - set(meaning))  # the file's order
  for key, value in ((k, values[k]) for k in order if k in values):
    text = allowed.get(key, "")
    cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    rows.append(f"| `{key}` | `{value!r}` | {cell(text) or 'not checked'} | {cell(meaning.get(key, ''))} |")
  return "\n".join(rows)


def document() -> str:
  """docs/config.md: every shipped config's reference."""
  parts = [
    "# Config reference",
    "",
    "Generated by `python -m experiments.config_doc --out=docs/config.md` from the validators and the "
    "config files' comments (ripples_jax/config_doc.py); a test keeps this file equal to its output. "
    "`allowed` is what the validator checks, with the variants a check applies to in parentheses; "
    "a bad value is refused in one line before anything compiles.",
  ]
  for module in VARIANTS:
    doc = (config_module(module).__doc__ or "").strip().splitlines()[0]
    parts += ["", f"## {module.replace('.', '/')}.py", "", doc, "", reference(module)]
  return "\n".join(parts) + "\n"
