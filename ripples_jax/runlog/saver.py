"""One background thread that writes checkpoints in the order they were handed over.

The loop hands a host copy and goes on (a marker costs it a device-to-host copy only); a write that
fails is raised in the loop's thread at its next put() or drain(). drain() returns once every item
handed over has been written (or has failed), so what the loop reads after it is on disk.
"""

import queue
import threading


class Saver:
  def __init__(self, write, name: str = "ripples-saver"):
    self._write, self._name = write, name
    self._q, self._thread, self._error = queue.Queue(), None, None

  def put(self, *item) -> None:
    self.raise_error()
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
      self._thread.start()
    self._q.put(item)

  def _loop(self) -> None:
    while (item := self._q.get()) is not None:
      try:
        self._write(*item)
      except BaseException as e:  # noqa: BLE001  raised in the loop's thread at its next call
        self._error = e
      finally:
        self._q.task_done()
    self._q.task_done()

  def raise_error(self) -> None:
    if self._error is not None:
      e, self._error = self._error, None
      raise e

  def drain(self, stop: bool = False) -> None:
    """Waits for every item handed over; `stop` also ends the thread."""
    if self._thread is not None:
      if stop:
        self._q.put(None)
      self._q.join()
      if stop:
        self._thread.join()
        self._thread = None
    self.raise_error()
