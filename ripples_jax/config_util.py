"""Small helpers for ml_collections configs (big_vision style `get_config(arg)` variants)."""
import ast

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k=v,k2=v2' (the part after ':' in --config=configs/x.py:k=v) into typed fields.

  Values are parsed as python literals where possible and otherwise kept as strings; keys must be among
  `defaults`, whose values give the allowed types.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for item in arg.split(","):
    if not item:
      continue
    if "=" not in item:
      raise ValueError(f"config arg: {item!r} is not allowed: expected key=value, keys {sorted(defaults)}")
    key, value = item.split("=", 1)
    if key not in defaults:
      raise ValueError(f"config arg: {key!r} is not allowed: one of {sorted(defaults)}")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    out[key] = value
  return out
