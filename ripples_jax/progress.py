"""Progress of a long loop: a one-line bar with steps/s and ETA on a terminal, plain log lines otherwise.

The rate (and the ETA from it) is measured over the recent updates only: the last WINDOW_S seconds or the
last WINDOW_UPDATES updates, whichever reaches further back, and never before the first update, so the
compilation before the first step does not count and a slow start fades out. Until two updates exist the
rate and ETA show as `?`. A step count that did not advance prints nothing: a loop still filling (step 0)
or one past its end (clamped to the total) stays quiet, and a step reported twice is shown once.

A log line written while the bar is on the terminal clears the bar first (clear_bar(), called by the
console filter, host.quiet_library_logs); the next update draws it again below the line.

In a Jupyter kernel (its stderr is ipykernel's OutStream, not a terminal) the bar is drawn too: a run
started from a notebook has no absl handler on the root logger, so log lines would show nothing there.
The notebook's output area overwrites a line on a carriage return but shows escape sequences as text,
so there the bar is padded with spaces instead of erased with ESC[K.
"""

import collections
import sys
import time

from absl import logging

WINDOW_S = 30.0
WINDOW_UPDATES = 20
_MAX_POINTS = 4096  # bounds the window of a loop that reports thousands of steps a second
_REDRAW_S = 0.2  # the terminal bar is redrawn at most this often (and at the end)

_drawn = None  # the Progress whose bar is on the terminal's last line now


def in_notebook(stream) -> bool:
  """True for a Jupyter kernel's output stream (ipykernel.iostream.OutStream)."""
  return type(stream).__module__.startswith("ipykernel")


def clear_bar() -> None:
  """Erases the bar on the terminal (if one is drawn) so that a log line starts on a clean line."""
  bar = _drawn
  if bar is not None:
    bar._erase()


class Progress:
  def __init__(self, total: int, log_every: int = 50, stream=None, clock=time.monotonic, start: int = 0):
    self.total, self.log_every = total, max(1, int(log_every))
    self.stream = stream or sys.stderr
    self.notebook = in_notebook(self.stream)
    self.tty = self.notebook or (hasattr(self.stream, "isatty") and self.stream.isatty())
    self._width = 0  # of the last drawing, which a notebook drawing pads over
    self.clock = clock
    self.resume_at(start)

  def resume_at(self, step: int) -> None:
    """Starts counting at `step` (a resumed run): its rate is measured from its own first update."""
    self.step = self._printed = int(step)
    self._points = collections.deque(maxlen=_MAX_POINTS)  # (time, step) of updates that advanced
    self._last_draw = None
    self._pending_redraw = False

  def rate(self) -> float | None:
    """Steps per second over the recent window, or None before the second update."""
    if len(self._points) < 2:
      return None
    t_new, s_new = self._points[-1]
    t_old, s_old = self._points[0]
    return (s_new - s_old) / (t_new - t_old) if t_new > t_old else None

  def eta(self) -> float | None:
    """Seconds left at the recent rate, or None while the rate is unknown."""
    rate = self.rate()
    return max(0, self.total - self.step) / rate if rate else None

  def _trim(self, now: float) -> None:
    while (
      len(self._points) > max(2, WINDOW_UPDATES + 1) and now - self._points[1][0] >= WINDOW_S
    ):  # the next-oldest point still spans the window
      self._points.popleft()

  def describe(self, **info) -> str:
    """`<step>/<total> <rate> steps/s ETA <eta>s <info>`."""
    rate, eta = self.rate(), self.eta()
    extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    return (
      f"{self.step}/{self.total} {'?' if rate is None else f'{rate:.1f}'} steps/s "
      f"ETA {'?' if eta is None else f'{eta:.0f}s'} {extra}"
    ).rstrip()

  def update(self, step: int, **info) -> None:
    step = int(step)
    if step <= self.step:  # nothing new: a filling loop (step 0), a finished one, or a repeat
      return
    now = self.clock()
    self.step = step
    self._points.append((now, step))
    self._trim(now)
    if self.tty:
      if (
        self._last_draw is not None
        and now - self._last_draw < _REDRAW_S
        and step < self.total
        and not self._pending_redraw
      ):
        return
      self._draw(now, info)
    elif step // self.log_every > self._printed // self.log_every or step >= self.total > self._printed:
      self._printed = step
      logging.info("step %s", self.describe(**info))

  def _draw(self, now, info) -> None:
    global _drawn
    self._last_draw, self._pending_redraw = now, False
    filled = int(30 * min(self.step, self.total) / max(1, self.total))
    bar = "#" * filled + "." * (30 - filled)
    text = f"[{bar}] {self.describe(**info)}"
    if self.notebook:
      self.stream.write(f"\r{text.ljust(self._width)}")
      self._width = len(text)
    else:
      self.stream.write(f"\r{text}\033[K")
    if self.step >= self.total:
      self.stream.write("\n")
      _drawn = None
    else:
      _drawn = self
    self.stream.flush()

  def _erase(self) -> None:
    global _drawn
    self.stream.write(f"\r{' ' * self._width}\r" if self.notebook else "\r\033[K")
    self._width = 0
    self.stream.flush()
    self._pending_redraw = True
    _drawn = None

  def close(self) -> None:
    """Ends the bar's line if the loop stopped before its total (a time budget, an error)."""
    global _drawn
    if _drawn is self:
      self.stream.write("\n")
      self.stream.flush()
      _drawn = None
