"""examples/: every notebook runs top to bottom in a fresh kernel (nbclient), started in examples/ as
Jupyter starts it there (no PYTHONPATH: the notebook finds the checkout itself)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.nightly
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  path = os.path.join(ROOT, "examples", "quickstart.ipynb")
  nb = nbformat.read(path, as_version=4)
  # The kernel inherits this environment: its runs go to tmp_path, and it imports the checkout.
  monkeypatch.setenv("EXAMPLE_WORKDIR", str(tmp_path))
  monkeypatch.delenv("PYTHONPATH", raising=False)
  examples = os.path.join(ROOT, "examples")
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": examples}}).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "the returned state equals the loaded one: True" in text, text[-2000:]
  assert "] 150/150 " in text  # the progress bar, drawn in the notebook's output
  assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0
  assert "| ripples_smart | 8 | 150 |" in text and (tmp_path / "compare.png").stat().st_size > 0
  # Figures inline: the plot cells carry an image output (Jupyter's inline backend, not Agg).
  images = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if "image/png" in o.get("data", {})
  ]
  assert len(images) >= 2, [c.get("outputs") for c in nb.cells if c.cell_type == "code"]
  for algorithm in ("allreduce", "ripples_smart"):
    assert (tmp_path / algorithm / "metrics.jsonl").exists()
