"""placement=spmd: the whole pipeline as one jitted program over a stage axis (docs/design.md 4.7).

The K stages sit on a mesh axis `stage` (jax.shard_map over K devices). Every device runs the same
program; `lax.switch` on its stage index picks its stage's code, so stages of unequal shapes run their
own computation (a per-stage branch: no stage computes another's padded work). What is padded is the
*state*: stage k's state (parameters, optimizer state, staleness ring buffers, parameter versions,
PipeMare's delta, its incoming link rings) is flattened per dtype into one vector and padded to the
longest stage's, so the K vectors stack into one array sharded over the axis. The cost: memory of
K x the largest stage's state instead of the sum, and each op reads its stage's tree out of the
vector and writes it back (a copy of the stage's state per op; the link writes update in place).

Time runs in units. In a unit every stage runs at most one op, then activations go up one stage and
error gradients down one stage by `ppermute`, and each receiver writes what arrived into its link ring.
A dispatch is one `lax.scan` over the units of N ticks: no Python per tick.

The timetable (`Timetable`). Stage k runs one_device's tick t (tick.py: the forward of batch t - F_k,
then the backward of batch t - F_k - S_k and the update) with its forward at unit P t + a_k and its
backward at unit P t + c_k. A message sent in unit v can be read from unit v + 1 on, so a link of
forward delay f from stage j to j+1 needs a_{j+1} >= a_j + 1 - P f, and one of backward delay b from
j+1 to j needs c_j >= c_{j+1} + 1 - P b.
  P = 1, c = a (fused: forward and backward in one unit) where every link has f + b >= 2: DSP. All
         a_k = 0: every stage busy every unit, nothing waits; a link's ring holds f (or b) ticks.
  P = 2, c = a + 1 where some link has f + b = 1: a locked forward with one-tick backward links (DDG,
         PipeDream-1F1B, PipeMare, FR) gives a_k = k, the lockstep form of 1F1B: stage k alternates a
         forward unit and a backward unit, adjacent stages in opposite phases, so a batch climbs one
         stage a unit and its gradient comes down one a unit, and stage k's backward lands K-1-k of
         its own updates after its forward, as tick.py's schedule says. Half the stages run a forward
         while the other half run a backward, so a unit lasts the longest of the two.
  f = b = 0 (model-parallel BP) is not a pipeline: refused (BP's whole-model step runs on one device).
Stage k's ticks in order, each tick's forward before its backward: the updates are one_device's, in
its order, so the numerics are equal (float order aside: one program may fuse differently).

Per dispatch of ticks [t0, t_hi): stage k runs exactly those ticks (a stage whose ticks are done
idles while the skewed ones finish), so after every dispatch the state is one_device's after tick
t_hi - 1, and a dispatch may end anywhere (a record, an evaluation, a checkpoint). The skew costs
max(c) + 1 - P idle units per dispatch (K - 1 under a locked forward, none under DSP). t0, t_hi and
the number of batches are arguments, so one compile serves a run of any length.

One_device's FIFOs (`fwd_fifo`, `bwd_fifo`) are replaced by tick-indexed link rings (`up_ring`,
`down_ring`): the slot of sender tick t' is t' mod L, L the ticks a link holds between an arrival and
its read; a read of a tick before the first is zeros, as one_device's fresh FIFO.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ripples_jax.pipeline import methods
from ripples_jax.pipeline.tick import Schedule, stage_backward, stage_forward

AXIS = "stage"


# ----------------------------------------------------------------------------------------------------
# The timetable.


@dataclasses.dataclass(frozen=True)
class Timetable:
  """Units per tick P, each stage's forward unit a_k and backward unit c_k within a tick, and the
  length of each stage's incoming link rings (0: no such link)."""

  period: int
  fwd_unit: tuple  # a_k
  bwd_unit: tuple  # c_k
  up_len: tuple  # stage k's ring of its link from k-1
  down_len: tuple  # stage k's ring of its link from k+1

  @property
  def extra_units(self) -> int:
    """Units a dispatch runs past N P for the skewed stages to finish its last tick."""
    return max(self.bwd_unit) + 1 - self.period

  def units(self, ticks: int) -> int:
    return ticks * self.period + self.extra_units


def timetable(schedule: Schedule) -> Timetable:
  """The smallest skews that satisfy every link (module docstring): longest paths over the links'
  difference constraints, P = 1 where every link allows it."""
  f, b, K = schedule.fwd_delays, schedule.bwd_delays, schedule.num_stages
  if any(fj + bj == 0 for fj, bj in zip(f, b)):
    raise ValueError(
      "placement=spmd runs a pipeline: every link needs a forward or a backward delay (f + b >= 1); "
      "model-parallel BP (f = b = 0) runs as the whole-model step"
    )
  period = 1 if all(fj + bj >= 2 for fj, bj in zip(f, b)) else 2
  a = [0] * K
  for _ in range(2 * K + 1):  # Bellman-Ford on K nodes: stable after K rounds (no positive cycle)
    new = list(a)
    for j in range(K - 1):
      new[j + 1] = max(new[j + 1], new[j] + 1 - period * f[j])
      new[j] = max(new[j], new[j + 1] + 1 - period * b[j])  # c = a + P - 1 on both ends
    if new == a:
      break
    a = new
  else:
    raise AssertionError(f"no timetable for delays {f}, {b}")
  a = [x - min(a) for x in a]
  c = [x + period - 1 for x in a]
  up = [0] + [f[j] + 1 + (a[j + 1] - a[j] - 1) // period for j in range(K - 1)]
  down = [b[j] + 1 + (c[j] - c[j + 1] - 1) // period for j in range(K - 1)] + [0]
  return Timetable(period, tuple(a), tuple(c), tuple(up), tuple(down))


# ----------------------------------------------------------------------------------------------------
# A stage's state as one padded vector per dtype.


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf of a stage's state lives in its dtype's vector."""

  treedef: object
  leaves: tuple  # (dtype name, offset, shape) per leaf
  sizes: dict  # dtype name -> elements used


def layout_of(tree) -> Layout:
  leaves, treedef = jax.tree.flatten(tree)
  sizes, out = {}, []
  for leaf in leaves:
    dt = jnp.dtype(leaf.dtype)
    if not (jnp.issubdtype(dt, jnp.number) or dt == jnp.bool_):
      raise ValueError(f"placement=spmd: a stage's state holds a {dt} leaf; only numbers are flattened")
    off = sizes.get(dt.name, 0)
    out.append((dt.name, off, tuple(leaf.shape)))
    sizes[dt.name] = off + math.prod(leaf.shape)
  return Layout(treedef, tuple(out), sizes)


def flatten(layout: Layout, tree, widths: dict, xp=jnp) -> dict:
  """The tree as {dtype: vector of widths[dtype]} (zeros past the stage's own leaves)."""
  parts = {name: [] for name in widths}
  for (name, _, _), leaf in zip(layout.leaves, jax.tree.leaves(tree)):
    parts[name].append(xp.ravel(leaf))
  out = {}
  for name, w in widths.items():
    used = layout.sizes.get(name, 0)
    pad = [xp.zeros((w - used,), name)] if w > used else []
    out[name] = xp.concatenate(parts[name] + pad) if parts[name] or pad else xp.zeros((0,), name)
  return out


def unflatten(layout: Layout, bufs: dict):
  leaves = [bufs[name][off : off + math.prod(shape)].reshape(shape) for name, off, shape in layout.leaves]
  return jax.tree.unflatten(layout.treedef, leaves)


# ----------------------------------------------------------------------------------------------------
# The program.


def spmd_state(state: list[dict], table: Timetable) -> list[dict]:
  """one_device's state (tick.init_pipeline) with its FIFOs replaced by the link rings."""
  out = []
  K = len(state)
  for k, st in enumerate(state):
    st = {key: v for key, v in st.items() if key not in ("fwd_fifo", "bwd_fifo")}
    x_k = st["in_ring"].shape[1:] if "in_ring" in st else None
    if k > 0:
      st["up_ring"] = jnp.zeros((table.up_len[k],) + x_k, st["in_ring"].dtype)
    if k < K - 1:
      y_k = state[k + 1]["in_ring"].shape[1:]
      st["down_ring"] = jnp.zeros((table.down_len[k],) + y_k, state[k + 1]["in_ring"].dtype)
    out.append(st)
  return out


class Program:
  """The pipeline of `schedule` as one program over `devices` (one per stage).

  state = program.place(spmd_state(one_device_state, program.table))  -> the stacked buffers
  bufs, metrics = program.run(bufs, t0, t_hi, xs, ys, num_batches)     -> ticks [t0, t_hi)
  program.state(bufs)                                                   -> the stages' trees

  xs[i] is batch t0 + i (stage 0's), ys[i] the labels of batch t0 + i - F_{K-1} (the last stage's),
  both of `ticks` entries; metrics[i] = (ran, loss, accuracy) of the last stage's backward of tick
  t0 + i (ran 0 where that tick is past t_hi)."""

  def __init__(self, stages, optimizer, schedule: Schedule, state: list[dict], devices, ticks: int):
    self.schedule, self.ticks, self.K = schedule, ticks, len(stages)
    self.table = timetable(schedule)
    self.layouts = [layout_of(st) for st in state]
    names = sorted({n for lay in self.layouts for n in lay.sizes})
    self.widths = {n: max(lay.sizes.get(n, 0) for lay in self.layouts) for n in names}
    act = [st["in_ring"].shape[1:] for st in state[1:]]  # what crosses link k: stage k+1's input
    dtypes = {str(st["in_ring"].dtype) for st in state[1:]}
    if len(dtypes) > 1:
      raise ValueError(f"placement=spmd: the links carry one dtype; these stages' inputs are {dtypes}")
    self.msg_dtype = dtypes.pop() if dtypes else "float32"
    self.msg_width = max([math.prod(s) for s in act], default=1)
    self.mesh = Mesh(np.array(list(devices)[: self.K]), (AXIS,))
    self.sharded = NamedSharding(self.mesh, P(AXIS))
    branches = [self._stage_unit(stages[k], optimizer, k) for k in range(self.K)]
    arrivals = [self._stage_arrivals(k) for k in range(self.K)]
    self._run = self._compile(branches, arrivals)

  # -- the units of one stage ------------------------------------------------------------------------

  def _tick_at(self, unit: int, u, t0, t_hi):
    """(whether the op a stage runs at `unit` of its ticks (its a_k or c_k) falls on unit u of the
    dispatch for a tick in [t0, t_hi), that tick)."""
    rel = u - self.table.period * t0 - unit
    t = t0 + rel // self.table.period
    return (rel >= 0) & (rel % self.table.period == 0) & (t < t_hi), t

  def _msg(self, y):
    flat = jnp.ravel(y).astype(self.msg_dtype)
    return jnp.pad(flat, (0, self.msg_width - flat.size))

  def _stage_unit(self, stage, optimizer, k: int):
    """Stage k's op in a unit: its forward, its backward, both (P = 1) or nothing."""
    sch, tab, lay, K = self.schedule, self.table, self.layouts[k], self.K
    a, c = tab.fwd_unit[k], tab.bwd_unit[k]
    last = k == K - 1
    zero_msg = jnp.zeros((self.msg_width,), self.msg_dtype)

    def forward(st, t, xs, t0):
      if k == 0:
        x_in = jax.lax.dynamic_index_in_dim(xs, t - t0, keepdims=False)
      else:  # the arrival of stage k-1's tick t - f (zeros before its first tick, as a fresh FIFO)
        ring = st["up_ring"]
        src = t - sch.fwd_delays[k - 1]
        x_in = jnp.where(src >= 0, ring[src % ring.shape[0]], 0)
      st, y = stage_forward(stage, sch, k, st, x_in, t)
      return st, (zero_msg if last else self._msg(y))

    def backward(st, t, ys, t0, nb):
      labels = cot = None
      if last:
        labels = jax.lax.dynamic_index_in_dim(ys, t - t0, keepdims=False)
      else:
        ring = st["down_ring"]
        src = t - sch.bwd_delays[k]
        cot = jnp.where(src >= 0, ring[src % ring.shape[0]], 0)
      st, g_x, (loss, acc) = stage_backward(stage, optimizer, sch, k, st, cot, labels, t, nb)
      # Stage 0 sends nothing down: its input gradient is never used, and XLA drops its computation.
      return st, (zero_msg if k == 0 else self._msg(g_x)), jnp.stack([loss, acc])

    def unit(bufs, u, t0, t_hi, nb, xs, ys):
      st = unflatten(lay, bufs)
      f_on, tf = self._tick_at(a, u, t0, t_hi)
      b_on, tb = self._tick_at(c, u, t0, t_hi)
      none = jnp.full((2,), jnp.nan, jnp.float32)

      def run_f(st):
        return forward(st, tf, xs, t0)

      def run_b(st):
        return backward(st, tb, ys, t0, nb)

      st, up = jax.lax.cond(f_on, run_f, lambda st: (st, zero_msg), st)
      st, down, m = jax.lax.cond(b_on, run_b, lambda st: (st, zero_msg, none), st)
      metrics = jnp.concatenate([jnp.where(b_on & last, 1.0, 0.0)[None], m.astype(jnp.float32)])
      return flatten(lay, st, self.widths), up, down, metrics, tb

    return unit

  def _stage_arrivals(self, k: int):
    """Stage k's writes, at the end of unit u, of what its neighbours sent in u into its link rings:
    in place (a dynamic_update_slice at the ring slot's offset in its dtype's vector)."""
    tab, lay, K = self.table, self.layouts[k], self.K
    paths = jax.tree_util.tree_flatten_with_path(
      unflatten(lay, {n: np.zeros(w) for n, w in self.widths.items()})
    )
    where = {}
    for (path, _), (name, off, shape) in zip(paths[0], lay.leaves):
      key = path[0].key if hasattr(path[0], "key") else None
      if key in ("up_ring", "down_ring"):
        where[key] = (name, off, shape)

    def write(bufs, ring, msg, on, t):
      name, off, shape = where[ring]
      size = math.prod(shape[1:])
      slot = t % shape[0]
      vec = bufs[name]
      new = jax.lax.dynamic_update_slice(vec, msg[:size].astype(name), (off + slot * size,))
      return dict(bufs, **{name: jnp.where(on, new, vec)})

    def arrive(bufs, up, down, u, t0, t_hi):
      if k > 0:
        on, t = self._tick_at(tab.fwd_unit[k - 1], u, t0, t_hi)
        bufs = write(bufs, "up_ring", up, on, t)
      if k < K - 1:
        on, t = self._tick_at(tab.bwd_unit[k + 1], u, t0, t_hi)
        bufs = write(bufs, "down_ring", down, on, t)
      return bufs

    return arrive

  # -- the dispatch ------------------------------------------------------------------------------------

  def _compile(self, branches, arrivals):
    K, units = self.K, self.table.units(self.ticks)
    up_perm = [(k, k + 1) for k in range(K - 1)]
    down_perm = [(k + 1, k) for k in range(K - 1)]

    def body(bufs, u, t0, t_hi, nb, xs, ys):
      k = jax.lax.axis_index(AXIS)
      bufs, up, down, metrics, tb = jax.lax.switch(k, branches, bufs, u, t0, t_hi, nb, xs, ys)
      # One hop a unit, both directions at once: stage k's output to k+1, its input gradient to k-1.
      up = jax.lax.ppermute(up, AXIS, up_perm)
      down = jax.lax.ppermute(down, AXIS, down_perm)
      bufs = jax.lax.switch(k, arrivals, bufs, up, down, u, t0, t_hi)
      return bufs, (metrics, tb)

    def per_device(bufs, t0, t_hi, nb, xs, ys):
      bufs = {n: v[0] for n, v in bufs.items()}
      u0 = self.table.period * t0

      def step(bufs, i):
        return body(bufs, u0 + i, t0, t_hi, nb, xs, ys)

      bufs, (metrics, tb) = jax.lax.scan(step, bufs, jnp.arange(units))
      return {n: v[None] for n, v in bufs.items()}, metrics[None], tb[None]

    spec = {n: P(AXIS) for n in self.widths}
    fn = jax.shard_map(
      per_device,
      mesh=self.mesh,
      in_specs=(spec, P(), P(), P(), P(), P()),
      out_specs=(spec, P(AXIS), P(AXIS)),
      check_vma=False,
    )
    return jax.jit(fn, donate_argnums=0)

  # -- the host side -----------------------------------------------------------------------------------

  def place(self, state: list[dict]) -> dict:
    """The stages' trees (spmd_state's) as the stacked buffers, stage k's row on device k."""
    rows = [
      flatten(lay, jax.tree.map(np.asarray, st), self.widths, np) for lay, st in zip(self.layouts, state)
    ]
    return {n: jax.device_put(np.stack([r[n] for r in rows]), self.sharded) for n in self.widths}

  def state(self, bufs: dict) -> list[dict]:
    """The stages' trees out of the buffers (host copies)."""
    host = {n: np.asarray(v) for n, v in bufs.items()}
    return [unflatten(lay, {n: host[n][k] for n in host}) for k, lay in enumerate(self.layouts)]

  def run(self, bufs, t0: int, t_hi: int, xs, ys, num_batches: int):
    """Ticks [t0, t_hi) (t_hi - t0 <= ticks), one dispatch. Returns (bufs, the last stage's per-unit
    (ran, loss, acc) and ticks: device arrays, for losses_of)."""
    assert 0 <= t0 < t_hi <= t0 + self.ticks, (t0, t_hi, self.ticks)
    scalar = lambda v: jnp.asarray(v, jnp.int32)
    bufs, metrics, tb = self._run(bufs, scalar(t0), scalar(t_hi), scalar(num_batches), xs, ys)
    return bufs, (metrics[self.K - 1], tb[self.K - 1])

  def advance(self, bufs, t0: int, t_end: int, x_of, labels_of, num_batches: int):
    """Ticks [t0, t_end) in dispatches of `ticks`: x_of(t) is batch t (zeros past the last),
    labels_of(i) the labels of batch i. Returns (bufs, [per-dispatch outputs]); nothing is read back
    here (losses_of reads them when the caller records)."""
    off, outs = self.schedule.offsets[-1], []
    for t in range(t0, t_end, self.ticks):
      span = range(t, t + self.ticks)
      xs = np.stack([x_of(i) for i in span])
      ys = np.stack([labels_of(i - off) for i in span])
      bufs, out = self.run(bufs, t, min(t + self.ticks, t_end), xs, ys, num_batches)
      outs.append(out)
    return bufs, outs


def losses_of(outs) -> list:
  """(tick, loss, acc) of each backward the last stage ran, from Program.advance's outputs."""
  got = []
  for out in outs:
    metrics, tb = (np.asarray(a) for a in out)
    got += [(int(t), float(m[1]), float(m[2])) for m, t in zip(metrics, tb) if m[0] > 0]
  return got


def supported(method: str) -> bool:
  """Whether `method` runs as the program: a tick method whose links are a pipeline's."""
  return methods.get(method).step == methods.TICK
