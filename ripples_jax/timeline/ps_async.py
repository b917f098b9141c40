"""Asynchronous parameter server on the clock."""

from ripples_jax.timeline.clock import _Clock
from ripples_jax.timeline.costs import Network
from ripples_jax.timeline.trace import COMM, PULL, WAIT


def _ps_async(clock: _Clock, net: Network) -> None:
  """Asynchronous parameter server in slot n: pull, compute, push; the server applies on arrival.

  Transfers share the server's one link (first come first served), which is what limits PS at scale.
  """
  n = clock.n
  server = n
  link_free = [0.0]

  def transfer(w, then, early=0.0):
    # A push may start `early` before now (behind the backward pass, net.hidden): the link is FIFO and
    # link_free is the end of its last booking, so any time after it is free, even in the past.
    begin = max(clock.now - early, link_free[0])
    d = net.ps_transfer()
    link_free[0] = begin + d
    end = max(begin + d, clock.now)
    clock.interval(w, WAIT, clock.now, max(begin, clock.now))
    clock.interval(w, COMM, max(begin, clock.now), end)
    clock.at_w(end, w, then, w)

  def push(w):
    if net.ps_latency:  # the request's delivery first (it holds no link time)
      clock.at_w(clock.now + net.ps_latency, w, lambda w: transfer(w, pushed), w)
    else:
      transfer(w, pushed, net.hidden)

  def pulled(w):
    clock.emit(PULL, w, server)
    clock.start_compute(w, push)

  def pushed(w):
    clock.applied(server, w)
    if not clock.stopped:
      transfer(w, pulled)

  def rejoined(w):  # its first pull after a rejoin: the server's model, fresh optimizer state (3.10)
    clock.joined(w, server)
    clock.start_compute(w, push)

  # Leaving needs nothing more here: what the worker had in flight dies with it (clock.at_w), and the
  # server's link time it had booked is spent.
  clock.plan_membership(lambda w: None, lambda w: transfer(w, rejoined))
  for w in range(n):
    transfer(w, pulled)
  clock.run()
