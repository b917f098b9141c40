"""Progress of a long loop: a one-line bar with steps/s and ETA on a terminal, plain log lines otherwise."""
import sys
import time

from absl import logging


class Progress:

  def __init__(self, total: int, log_every: int = 50, stream=None):
    self.total, self.log_every = total, log_every
    self.stream = stream or sys.stderr
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.t0 = time.time()
    self._last_draw = 0.0

  def update(self, step: int, **info) -> None:
    elapsed = time.time() - self.t0
    rate = step / elapsed if elapsed > 0 else 0.0
    eta = (self.total - step) / rate if rate > 0 else float("inf")
    extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    if self.tty:
      now = time.time()
      if now - self._last_draw < 0.2 and step < self.total:
        return
      self._last_draw = now
      filled = int(30 * step / self.total)
      bar = "#" * filled + "." * (30 - filled)
      self.stream.write(f"\r[{bar}] {step}/{self.total} {rate:.1f} steps/s ETA {eta:.0f}s {extra}\033[K")
      if step >= self.total:
        self.stream.write("\n")
      self.stream.flush()
    elif step % self.log_every == 0 or step >= self.total:
      logging.info("step %d/%d  %.1f steps/s  ETA %.0fs  %s", step, self.total, rate, eta, extra)
