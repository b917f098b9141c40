"""examples/: every notebook runs top to bottom in a fresh kernel (nbclient), from the repository root."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  path = os.path.join(ROOT, "examples", "quickstart.ipynb")
  nb = nbformat.read(path, as_version=4)
  # The kernel inherits this environment: its runs go to tmp_path, and it imports the checkout.
  monkeypatch.setenv("EXAMPLE_WORKDIR", str(tmp_path))
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "the returned state equals the loaded one: True" in text, text[-2000:]
  assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0
  for algorithm in ("allreduce", "ripples_smart"):
    assert (tmp_path / algorithm / "metrics.jsonl").exists()
