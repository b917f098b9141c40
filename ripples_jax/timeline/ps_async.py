"""Asynchronous parameter server on the clock."""

from ripples_jax.timeline.clock import _Clock
from ripples_jax.timeline.costs import Network
from ripples_jax.timeline.trace import APPLY, COMM, JOIN, PULL, WAIT

# The server's step per gradient (ps.staleness): "none" applies each at lr / n (workload.build), "divide"
# at lr / its staleness (Zhang et al., 2016, "Staleness-aware async-SGD for distributed deep learning").
STALENESS = ("none", "divide")


class Staleness:
  """The server's versions: how many gradients it has applied, and the version each worker pulled
  last. apply(w) counts one more and returns that gradient's staleness, the versions from the one w
  computed it on to the one it makes (>= 1: 1 when no other gradient landed in between). The
  simulator drives it from the clock's events (`staleness`), the runtime's server from its requests."""

  def __init__(self):
    self.version, self.pulled = 0, {}

  def pull(self, w: int) -> None:
    self.pulled[w] = self.version

  def apply(self, w: int) -> int:
    self.version += 1
    return self.version - self.pulled.get(w, 0)


def staleness(events: list, server: int) -> list:
  """The staleness of every gradient applied on `server`'s slot, in the events' order (a PULL or JOIN
  from it is a pull: a rejoined worker's first model is the server's, docs/design.md 3.10)."""
  count, out = Staleness(), []
  for _, kind, a, b in events:
    if kind in (PULL, JOIN) and b == server:
      count.pull(a)
    elif kind == APPLY and a == server:
      out.append(count.apply(b))
  return out


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
