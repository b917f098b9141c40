"""The config reference (docs/config.md) is the validators' own account: every check it lists is one
the validator makes, docs/config.md is current, and each field's meaning is its config-file comment."""

import os
import subprocess
import sys

import ml_collections
import pytest

from ripples_jax import config as config_lib
from ripples_jax import config_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_config_md_is_the_generated_reference():
  with open(os.path.join(ROOT, "docs", "config.md")) as f:
    assert f.read() == config_doc.document(), (
      "regenerate: python -m experiments.config_doc --out=docs/config.md"
    )


def _set(c, key, value):
  *parents, leaf = key.split(".")
  for p in parents:
    c = c[p]
  c[leaf] = value


BAD = {"one of ": "no-such-value", "a positive integer": 0, "True or False": "yes"}


@pytest.mark.parametrize("module", list(config_doc.VARIANTS))
def test_every_listed_check_refuses_a_bad_value_naming_its_key(module):
  """For each variant, each (key, allowed) the reference lists for it: a value outside `allowed`
  makes the same validator refuse it. A listed check the validator does not make fails."""
  import importlib

  validate, variants = config_doc.VARIANTS[module]
  get_config = importlib.import_module(module).get_config
  tried = 0
  for _, arg, kwargs in variants():
    kwargs = dict(kwargs)
    placement = kwargs.pop("placement", None)
    base = get_config(arg)
    if placement:
      base.placement = placement
    for key, allowed in config_lib.noting_checks(validate, base, **kwargs):
      bad = next((v for prefix, v in BAD.items() if allowed.startswith(prefix)), None)
      if bad is None:
        continue
      c = ml_collections.ConfigDict(base.to_dict(), type_safe=False)  # a str where a bool was
      _set(c, key, bad)
      with pytest.raises(config_lib.ConfigError) as refused:
        validate(c, **kwargs)
      # Named as the bad key, or (an earlier cross-field rule caught it) inside that rule's line.
      assert str(refused.value).startswith(f"config.{key}: ") or key in str(refused.value), (key, refused)
      tried += 1
  assert tried > 50


def test_conditions_name_the_variants_a_check_applies_to():
  allowed = config_doc.summaries("configs.default")
  assert allowed["runtime.step_time"] == "seconds >= 0 (0: no padding) (executor=async)"
  assert allowed["schedule.smart_max_gap"] == "an integer >= 0 (algorithm=ripples_smart)"
  assert allowed["hetero.slowdown"].startswith("a factor >= 1 (executor=sim|async); 1.0 (off")
  assert allowed["batch_size"] == "a positive integer"  # every variant: no condition
  dsp = config_doc.summaries("configs.dsp")
  assert dsp["chunks"] == "a positive integer" and "(placement=per_process)" in dsp["runtime.fail_tick"]


def test_field_comments_read_the_line_its_continuation_or_the_block_above(tmp_path):
  path = tmp_path / "c.py"
  path.write_text(
    "def get_config():\n"
    "  c = ConfigDict()\n"
    "  # the block above a field\n"
    "  # without its own comment\n"
    "  c.a = 1\n"
    "  c.b = 'x#y'  # own comment, '#' in the value\n"
    "  # continues b\n"
    "  c.c = 2\n"
    "  c.d.e = (1,\n"
    "           2)  # on its last line\n"
    "  c.f = 3\n"
  )
  assert config_doc.field_comments(str(path)) == {
    "a": "the block above a field without its own comment",
    "b": "own comment, '#' in the value continues b",
    "c": "",  # b's continuation is not also c's
    "d.e": "on its last line",
    "f": "",
  }


@pytest.mark.slow
@pytest.mark.nightly
def test_the_entry_point_writes_the_reference(tmp_path):
  out = tmp_path / "config.md"
  run = subprocess.run(
    [sys.executable, "-m", "experiments.config_doc", f"--out={out}"], cwd=ROOT, capture_output=True, text=True
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert out.read_text() == config_doc.document()
