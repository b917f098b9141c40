"""Synchronous pipelines with a flush: GPipe, 1F1B and ZB-H1 as op orders, and the backward split
into B (the input gradient) and W (the weight gradient) that zero-bubble schedules need.

Every method here is numerically BP on the whole batch: M micro-batches, their gradients summed (each
micro-batch's mean loss over M), one update per stage after the flush. They differ in when each
stage runs each op, and so in time and memory:

  gpipe  every forward (keeping only the stage's input), then per micro-batch B (the forward run
         again, then the input gradient) and W: GPipe's rematerialisation (Huang et al., 2019)
  1f1b   K-1-k warm-up forwards, then one forward and one backward in turn; W right after its B,
         which is 1F1B's backward (Narayanan et al., 2019, the synchronous flush form)
  zbh1   1F1B's order of F and B with W postponed into the stage's idle units, at most K-k
         micro-batches in flight (1F1B's peak memory): ZB-H1 (Qi et al., "Zero Bubble Pipeline
         Parallelism", ICLR 2024), whose bubble is (K-1)(F+B-W) against 1F1B's (K-1)(F+B+W)

`timetable(method, K, M)` places every op on a unit of the lockstep program (program.FlushProgram):
each stage runs its ops in its method's order (`stage_order`), one a unit, each on the first unit its
inputs allow (a message sent in unit v is read from unit v+1 on). With F, B and W one unit each this
gives the published step lengths: 1F1B 3M + 3(K-1) units, ZB-H1 3M + (K-1), ZB-H1 holding at most K
micro-batches on any stage as 1F1B does (tests/test_pipeline_program.py).

The split (`backward_input`, `backward_weights`) runs on pipemare.py's plan of a stage's forward (its
equations, each value classed W, A or C, and the activations the backward reads kept by the forward):
B walks the A equations in reverse, taking only the cotangents of activations and keeping the output
cotangent of every equation that reads a weight; W takes, for those equations alone, the cotangents of
their weight operands. B + W is pipemare.backward at the forward's weights (float order aside).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ripples_jax.pipeline import pipemare

IDLE, F, B, W = 0, 1, 2, 3
METHODS = ("gpipe", "1f1b", "zbh1")


# ----------------------------------------------------------------------------------------------------
# The op orders.


@dataclasses.dataclass(frozen=True)
class FlushTable:
  """op[u, k], mb[u, k]: what stage k runs in unit u of a step (IDLE, F, B, W) on which micro-batch."""

  op: np.ndarray
  mb: np.ndarray
  method: str

  @property
  def units(self) -> int:
    return self.op.shape[0]

  def when(self, k: int, kind: int) -> list:
    """The unit of stage k's op `kind` on each micro-batch, in micro-batch order."""
    units = [u for u in range(self.units) if self.op[u, k] == kind]
    order = [int(self.mb[u, k]) for u in units]
    assert order == sorted(order), (k, kind, order)
    return units

  def in_flight(self, k: int) -> int:
    """The most micro-batches stage k holds at once (from its forward to its W)."""
    live, most = 0, 0
    for u in range(self.units):
      live += int(self.op[u, k] == F) - int(self.op[u, k] == W)
      most = max(most, live)
    return most


def stage_order(method: str, K: int, M: int, k: int) -> list:
  """Stage k's ops of a step in its method's order: (kind, micro-batch) pairs.

  gpipe  F 0..M-1, then B m, W m for each m
  1f1b   K-1-k warm-up forwards, then per micro-batch j: the next F (while any is left), B j, W j
  zbh1   1F1B's order with W postponed by k: W j-k after B j (from j = k on), the rest at the end;
         stage k then holds at most K micro-batches (1F1B's peak, stage 0's), and the later W fill
         the units 1F1B leaves idle at the tail (Qi et al.: "adjusts the starting points of W passes
         depending on the number of warm-up micro-batches")."""
  if method == "gpipe":
    return [(F, m) for m in range(M)] + [op for m in range(M) for op in ((B, m), (W, m))]
  warm, delay = min(K - 1 - k, M), (0 if method == "1f1b" else k)
  order, w = [(F, m) for m in range(warm)], 0
  for j in range(M):
    if warm + j < M:
      order.append((F, warm + j))
    order.append((B, j))
    if j >= delay:
      order, w = order + [(W, w)], w + 1
  return order + [(W, m) for m in range(w, M)]


def op_times(method: str, K: int, M: int, cost) -> dict:
  """{(k, kind, m): (start, end)} of every op of a step, each stage running its order
  (`stage_order`), each op as soon as its stage is free and what it reads is done, `cost(kind, k)` its
  duration. What an op reads: F m the output of stage k-1's F m; B m its own F m and stage k+1's B m
  (1f1b: stage k+1's W m, since 1F1B's backward is one op that sends its input gradient when done);
  W m its own B m. The one rule of a flush step's order, read by the program's timetable (unit
  costs) and the timing model (measured costs: timing.scheduled_iteration)."""
  if method not in METHODS:
    raise ValueError(f"flush method {method!r}: one of {', '.join(METHODS)}")
  orders = [stage_order(method, K, M, k) for k in range(K)]
  above = W if method == "1f1b" else B
  times, free, pos = {}, [0] * K, [0] * K
  while any(p < len(o) for p, o in zip(pos, orders)):
    moved = False
    for k in range(K):
      if pos[k] == len(orders[k]):
        continue
      kind, m = orders[k][pos[k]]
      reads = {
        F: [(k - 1, F, m)] if k else [],
        B: [(k, F, m)] + ([(k + 1, above, m)] if k < K - 1 else []),
        W: [(k, B, m)],
      }[kind]
      if all(r in times for r in reads):
        start = max([free[k]] + [times[r][1] for r in reads])
        free[k] = start + cost(kind, k)
        times[(k, kind, m)], pos[k], moved = (start, free[k]), pos[k] + 1, True
    assert moved, "a flush order waits on itself"
  return times


def timetable(method: str, K: int, M: int) -> FlushTable:
  """Every op of a step on a unit of the lockstep program: op_times with every op one unit (a message
  sent in unit v is read from unit v+1 on)."""
  times = op_times(method, K, M, lambda kind, k: 1)
  units = max(end for _, end in times.values())
  op, mb = np.full((units, K), IDLE, np.int32), np.zeros((units, K), np.int32)
  for (k, kind, m), (start, _) in times.items():
    op[start, k], mb[start, k] = kind, m
  return FlushTable(op, mb, method)


def slots(write: list, read: list, same_unit_ok: bool) -> int:
  """The ring length for entries written at units `write[m]` and read at `read[m]` (micro-batch
  order both): slot m mod L is free when m is written if m - L was read by then (in that same unit
  too where the write lands at the unit's end: `same_unit_ok`)."""
  M = len(write)
  for L in range(1, M + 1):
    ok = all(read[m - L] < write[m] or (same_unit_ok and read[m - L] == write[m]) for m in range(L, M))
    if ok:
      return L
  return M


# ----------------------------------------------------------------------------------------------------
# The split backward.


def _vals(plan, env, e):
  return [
    pipemare._read(env, a) if isinstance(a, pipemare.Lit) or a in env else pipemare._zeros(plan.aval[a])
    for a in e.ins
  ]


def _vjp_of(e, vals, diff, out_ct):
  """The cotangents of operands `diff` of equation e at `vals`, given its outputs' cotangents."""

  def fn(*d):
    v = list(vals)
    for i, di in zip(diff, d):
      v[i] = di
    return pipemare._bind(e, v)

  outs, pull = jax.vjp(fn, *[vals[i] for i in diff])
  return pull([c if c is not None else jnp.zeros_like(o) for c, o in zip(out_ct, outs)])


def _diff(plan, e, kind):
  return [
    i
    for i, a in enumerate(e.ins)
    if not isinstance(a, pipemare.Lit) and plan.kind[a] == kind and pipemare._inexact(plan.aval[a])
  ]


def backward_input(plan, params, kept, cotangent):
  """B: (dL/dx, {equation index: its output cotangents} for every equation whose weight operands W
  will differentiate)."""
  wvals, cvals = pipemare._weight_values(plan, params)
  env = {**cvals, **wvals, **dict(zip(plan.kept, kept))}
  ct, saved = {plan.outvars[0]: cotangent}, {}
  for i in reversed(range(len(plan.eqns))):
    e = plan.eqns[i]
    if not any(o in ct for o in e.outs):
      continue
    out_ct = [ct.pop(o, None) for o in e.outs]
    vals = _vals(plan, env, e)
    if _diff(plan, e, pipemare.W):
      saved[i] = [
        c if c is not None else jnp.zeros(plan.aval[o].shape, plan.aval[o].dtype)
        for c, o in zip(out_ct, e.outs)
      ]
    acts = _diff(plan, e, pipemare.A)
    if acts:
      for j, g in zip(acts, _vjp_of(e, vals, acts, out_ct)):
        key = e.ins[j]
        ct[key] = g if key not in ct else ct[key] + g
  x_key = plan.invars[-1]
  return ct.get(x_key, pipemare._zeros(plan.aval[x_key])), saved


def backward_weights(plan, params, kept, saved):
  """W: dL/d params from B's saved output cotangents and the forward's kept activations."""
  wvals, pull_w, cvals = jax.vjp(lambda p: pipemare._weight_values(plan, p), params, has_aux=True)
  env = {**cvals, **wvals, **dict(zip(plan.kept, kept))}
  ct_w = {}
  for i in sorted(saved, reverse=True):  # B's order
    e = plan.eqns[i]
    ws = _diff(plan, e, pipemare.W)
    for j, g in zip(ws, _vjp_of(e, _vals(plan, env, e), ws, saved[i])):
      key = e.ins[j]
      ct_w[key] = g if key not in ct_w else ct_w[key] + g
  (g_params,) = pull_w({k: ct_w.get(k, jnp.zeros_like(v)) for k, v in wvals.items()})
  return g_params
