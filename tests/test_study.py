"""experiments.study: the one run_jobs runs only what runs.json lacks and resumes; the studies use it."""

import json
import pathlib
import re

from experiments import study

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAN = []


def fake_run(job) -> dict:
  RAN.append(job)
  name, lr = job
  return {"curve": {"time": [1.0], "test": [lr], "val": [lr]}, "end": 1.0}


def test_run_jobs_runs_only_what_runs_json_lacks_and_writes_after_each(tmp_path, capsys):
  key = lambda j: f"{j[0]}|lr={j[1]:g}"  # noqa: E731
  RAN.clear()
  got = study.run_jobs(str(tmp_path), [("a", 0.1), ("b", 0.2)], run=fake_run, key=key)
  assert RAN == [("a", 0.1), ("b", 0.2)] and set(got) == {"a|lr=0.1", "b|lr=0.2"}
  assert json.loads((tmp_path / "runs.json").read_text()) == got
  RAN.clear()  # again with one job more: only it runs, the held ones are read back
  got = study.run_jobs(str(tmp_path), [("a", 0.1), ("b", 0.2), ("c", 0.3)], 1, run=fake_run, key=key)
  assert RAN == [("c", 0.3)] and len(got) == 3
  out = capsys.readouterr().out
  assert "2 held in" in out and "c|lr=0.3: test 0.3000 val 0.3000 end 1 s" in out


def test_one_run_jobs_in_experiments():
  defs = [
    str(p.relative_to(ROOT))
    for p in sorted((ROOT / "experiments").glob("*.py"))
    if re.search(r"^def run_jobs\(", p.read_text(), re.M)
  ]
  assert defs == ["experiments/study.py"]
