"""The console: other libraries' INFO lines filtered off absl's handler, an ETA from the recent rate, no
repeated progress lines, units in the result table, and a short real run that prints few lines."""

import io
import logging as std_logging
import os
import re
import subprocess
import sys
import threading

import pytest
from absl import logging

from ripples_jax import progress, runlog
from ripples_jax.distributed import host as platform
from ripples_jax.progress import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def console(capfd):
  """absl's handler on the root logger (as app.run sets it up), with the filter installed. Yields
  (a function returning what reached the console so far, the filter); restores the logging set-up."""
  handler = logging.get_absl_handler()
  root = std_logging.getLogger()
  old_level, attached = root.level, handler in root.handlers
  old_format = handler.python_handler.formatter
  if not attached:
    root.addHandler(handler)
  root.setLevel(std_logging.INFO)
  f = platform.quiet_library_logs()
  seen = []

  def text():
    seen.append(capfd.readouterr().err)  # absl writes to stderr (sys.stderr or fd 2)
    return "".join(seen)

  try:
    yield text, f
  finally:
    handler.removeFilter(f)
    handler.setFormatter(old_format)
    if not attached:
      root.removeHandler(handler)
    root.setLevel(old_level)


def log_from(path: str, code: str) -> None:
  """Runs `code` as if it were in the file `path` (the record's pathname is `path`)."""
  exec(compile(code, path, "exec"), {"logging": logging, "std_logging": std_logging})


def library_file(module: str) -> str:
  return __import__(module, fromlist=["_"]).__file__


def test_our_lines_carry_a_short_prefix_without_the_thread_id(console):
  text, _ = console
  logging.info("checkpoint %d saved", 100)
  logging.warning("slow worker")
  lines = text().splitlines()
  here = os.path.basename(__file__)
  assert re.fullmatch(rf"I\d{{4}} \d\d:\d\d:\d\d\.\d{{3}} {here}:\d+\] checkpoint 100 saved", lines[-2]), (
    lines
  )
  assert re.fullmatch(rf"W\d{{4}} \d\d:\d\d:\d\d\.\d{{3}} {here}:\d+\] slow worker", lines[-1]), lines
  assert str(threading.get_native_id()) not in lines[-1] and str(threading.get_ident()) not in lines[-1]


def test_filter_drops_library_info_and_keeps_ours(console):
  text, _ = console
  orbax = library_file("orbax.checkpoint.checkpoint_manager")
  xla_bridge = library_file("jax._src.xla_bridge")
  log_from(orbax, "logging.info('orbax says: Saving checkpoint at step 1000')")
  log_from(
    xla_bridge, "std_logging.getLogger('jax._src.xla_bridge').info(\"Unable to initialize backend 'tpu'\")"
  )
  log_from(runlog.__file__, "logging.info('checkpoint 1000 saved: /w/ckpt/1000')")
  log_from(orbax, "logging.warning('orbax warns: something is off')")
  assert "orbax says" not in text() and "Unable to initialize backend" not in text()
  assert "checkpoint 1000 saved: /w/ckpt/1000" in text()
  assert "orbax warns: something is off" in text()
  assert platform.from_library(orbax) and platform.from_library(xla_bridge)
  assert not platform.from_library(runlog.__file__) and not platform.from_library("<string>")
  # The project's own folders, wherever it is installed (site-packages included): ripples_jax/ itself.
  import ripples_jax

  assert os.path.dirname(os.path.abspath(ripples_jax.__file__)) + os.sep in platform._OWN


def test_a_library_warning_shows_without_its_traceback_unless_verbose(console):
  text, f = console
  orbax = library_file("orbax.checkpoint.checkpoint_manager")
  code = "try:\n  1 / 0\nexcept ZeroDivisionError:\n  logging.exception('orbax failed to %s', 'save')"
  log_from(orbax, code)
  assert "orbax failed to save (traceback hidden; --verbose_libraries shows it)" in text()
  assert "Traceback" not in text()
  f.verbose = True
  log_from(orbax, code)
  log_from(orbax, "logging.info('orbax says hello')")
  assert "Traceback" in text() and "ZeroDivisionError" in text() and "orbax says hello" in text()


class Terminal(io.StringIO):
  def isatty(self):
    return True


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def test_eta_comes_from_the_recent_rate_without_compilation():
  clock, out = Clock(), Terminal()
  p = Progress(1000, stream=out, clock=clock)
  clock.t = 100.0  # compilation: the first update comes 100 s in
  p.update(1)
  assert p.rate() is None and p.eta() is None and "1/1000 ? steps/s ETA ?" in out.getvalue()
  for step in range(2, 101):  # then 10 steps/s
    clock.t += 0.1
    p.update(step)
  assert p.rate() == pytest.approx(10.0) and p.eta() == pytest.approx(90.0)
  assert p.describe() == "100/1000 10.0 steps/s ETA 90s"
  for step in range(101, 161):  # slower for 60 s: the 30 s window forgets the fast part
    clock.t += 1.0
    p.update(step)
  assert p.rate() == pytest.approx(1.0) and p.eta() == pytest.approx(840.0)


def test_a_step_that_did_not_advance_prints_nothing(caplog):
  clock = Clock()
  p = Progress(100, log_every=10, stream=io.StringIO(), clock=clock)  # not a terminal: log lines
  with caplog.at_level(std_logging.INFO):
    for step in [0, 0, 0] + list(range(1, 101)) + [100] * 32:  # filling, running, then done 32 times
      clock.t += 0.5
      p.update(step)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert [l.split()[1] for l in lines] == [f"{s}/100" for s in range(10, 101, 10)]
  assert lines[-1] == "step 100/100 2.0 steps/s ETA 0s"
  out = Terminal()  # on a terminal: one drawing per step that advanced (0.5 s apart: none held back)
  p = Progress(100, stream=out, clock=clock)
  for step in [0, 0, 0] + [s for s in range(1, 101) for _ in range(2)] + [100] * 32:
    clock.t += 0.5
    p.update(step)
  assert [d.split("] ")[1].split()[0] for d in out.getvalue().split("\r")[1:]] == [
    f"{s}/100" for s in range(1, 101)
  ]
  assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1


def test_a_log_line_clears_the_bar_first():
  out = Terminal()
  p = Progress(10, stream=out, clock=Clock())
  p.update(3)
  assert out.getvalue().endswith("\x1b[K") and progress._drawn is p
  progress.clear_bar()
  assert out.getvalue().endswith("\r\x1b[K") and progress._drawn is None
  p.close()  # the bar is not drawn: nothing to end
  assert out.getvalue().endswith("\r\x1b[K")


NotebookStream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})


def test_in_a_notebook_the_bar_is_drawn_without_escape_sequences():
  """A Jupyter kernel's stderr is no terminal, and a notebook run has no absl handler to show log lines:
  the bar is drawn there too, padded over the previous drawing (the output area shows ESC as text)."""
  out = NotebookStream()
  p = Progress(10, stream=out, clock=Clock())
  assert p.tty and p.notebook
  for step in range(1, 11):
    p.clock.t += 1.0
    p.update(step, loss=12345.678 if step == 5 else 1.0)
  drawings = out.getvalue().split("\r")[1:]
  assert "\x1b" not in out.getvalue() and out.getvalue().endswith("\n")
  assert [d.split("] ")[1].split()[0] for d in drawings] == [f"{s}/10" for s in range(1, 11)]
  assert all(len(b) >= len(a.rstrip()) for a, b in zip(drawings, drawings[1:]))  # the last one covered
  assert not Progress(10, stream=io.StringIO()).tty


def test_the_result_table_names_its_time_unit():
  row = {
    "algorithm": "allreduce",
    "num_workers": 8,
    "num_steps": 100,
    "final_test_accuracy": 0.5,
    "time": 12.3,
  }
  real = runlog.summary_table([{**row, "executor": "spmd"}]).splitlines()
  sim = runlog.summary_table([{**row, "executor": "sim"}]).splitlines()
  assert real[0].split()[-1] == "time_s" and sim[0].split()[-1] == "virtual_s"
  both = runlog.summary_table([{**row, "executor": "spmd"}, {**row, "executor": "sim"}]).splitlines()
  assert both[0].split()[-2:] == ["time_s", "virtual_s"]
  assert both[2].split()[-2:] == ["12.3", "-"] and both[3].split()[-2:] == ["-", "12.3"]


def test_the_pipeline_table_has_train_tables_layout():
  one = {"method": "dsp", "num_stages": 4, "num_batches": 62, "final_test_accuracy": 0.9051, "time": 27.04}
  rows = [
    {**one, "modeled_speedup_vs_bp": 1.484},
    {**one, "num_stages": 2, "iteration_s": 0.00281, "modeled_speedup_vs_bp": float("nan")},
  ]
  lines = runlog.pipeline_table(rows).splitlines()
  assert lines[0].split() == [
    "method",
    "stages",
    "batches",
    "test_acc",
    "time_s",
    "iteration_ms",
    "modeled_vs_bp",
  ]
  assert set(lines[1]) == {"-", " "}
  assert lines[2].split() == ["dsp", "4", "62", "90.51%", "27.0", "-", "1.48"]
  assert lines[3].split() == ["dsp", "2", "62", "90.51%", "27.0", "2.8", "-"]
  assert (
    runlog.summary_table([{**one, "algorithm": "allreduce", "num_workers": 8, "num_steps": 9}]).count("\n")
    == 2
  )


def is_progress(line: str) -> bool:
  return "progress.py" in line and "] step " in line


@pytest.mark.slow
def test_a_short_run_prints_few_lines(tmp_path):
  args = [
    "--config=configs/default.py:model=mlp,steps=400",
    "--config.log_every=20",
    "--config.eval_every=200",
    "--config.checkpoint_every=100",
  ]
  out = subprocess.run(
    [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path / 'quiet'}", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  lines = (out.stderr + out.stdout).splitlines()
  others = [l for l in lines if not is_progress(l)]
  assert len(others) <= 20, "\n".join(others)
  assert [l.split("] ")[-1] for l in others if "checkpoint" in l] == [
    f"checkpoint {s} saved: {tmp_path / 'quiet' / 'ckpt' / str(s)}" for s in (100, 200, 300, 400)
  ]
  assert not any("orbax" in l or "xla_bridge" in l for l in lines)
  steps = [l.split("] step ")[1].split()[0] for l in lines if is_progress(l)]
  assert steps == [f"{s}/400" for s in range(20, 401, 20)]  # each once
  assert "time_s" in out.stdout

  loud = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--workdir={tmp_path / 'loud'}",
      "--verbose_libraries",
      *args[:1],
      "--config.num_steps=100",
      "--config.checkpoint_every=100",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert loud.returncode == 0, loud.stderr[-3000:]
  assert "checkpoint_manager.py" in loud.stderr and len(loud.stderr.splitlines()) > 40


def test_cpu_pool_has_a_thread_per_device_beside_the_cores(monkeypatch):
  """docs/design.md 5.2: collectives of more devices than cores deadlock in a pool of one thread per
  core; the entry points size it before the backend starts, the user's NPROC stands."""
  monkeypatch.delenv("NPROC", raising=False)
  monkeypatch.setattr(platform.os, "cpu_count", lambda: 2)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
  platform.use_cpu_devices(8)  # the forced count wins: its devices are the ones that block
  assert platform.os.environ["NPROC"] == "34"  # 2 x 16 held at most, 2 cores free
  monkeypatch.setenv("NPROC", "5")
  platform.size_cpu_pool(8)
  assert platform.os.environ["NPROC"] == "5"
