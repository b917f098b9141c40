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


def _trees(layouts: list, bufs: dict) -> list:
  """Each stage's tree out of stacked vectors: copies of stage k's rows on device k."""
  rows = {
    n: [
      jnp.array(shard.data[0]) for shard in sorted(v.addressable_shards, key=lambda s: s.index[0].start or 0)
    ]
    for n, v in bufs.items()
  }
  return [unflatten(lay, {n: rows[n][k] for n in rows}) for k, lay in enumerate(layouts)]


def spmd_state(state: list[dict], table: Timetable) -> list[dict]:
  """one_device's state (tick.init_pipeline) with its FIFOs replaced by the link rings."""
  out = []
  K = len(state)
  for k, st in enumerate(state):
    st = {key: v for key, v in st.items() if key not in ("fwd_fifo", "bwd_fifo")}
    x_k = st["in_ring"].shape[1:]
    if k > 0:
      st["up_ring"] = jnp.zeros((table.up_len[k],) + x_k, st["in_ring"].dtype)
    if k < K - 1:
      y_k = state[k + 1]["in_ring"].shape[1:]
      st["down_ring"] = jnp.zeros((table.down_len[k],) + y_k, state[k + 1]["in_ring"].dtype)
    out.append(st)
  return out


class _Stacked:
  """What both programs share: the stages' state trees as padded per-dtype vectors stacked over the
  stage axis, the links' message width, the mesh, and the host-side conversions."""

  def _setup(self, state: list[dict], link_shapes: list, link_dtypes: set, devices):
    self.K = len(state)
    self.layouts = [layout_of(st) for st in state]
    names = sorted({n for lay in self.layouts for n in lay.sizes})
    self.widths = {n: max(lay.sizes.get(n, 0) for lay in self.layouts) for n in names}
    if len(link_dtypes) > 1:
      raise ValueError(f"placement=spmd: the links carry one dtype; these stages' inputs are {link_dtypes}")
    self.msg_dtype = link_dtypes.pop() if link_dtypes else "float32"
    self.msg_width = max([math.prod(s) for s in link_shapes], default=1)
    self.mesh = Mesh(np.array(list(devices)[: self.K]), (AXIS,))
    self.sharded = NamedSharding(self.mesh, P(AXIS))

  def _msg(self, y):
    flat = jnp.ravel(y).astype(self.msg_dtype)
    return jnp.pad(flat, (0, self.msg_width - flat.size))

  def _ring_writer(self, k: int):
    """write(bufs, ring, msg, on, index): msg into slot index mod L of stage k's ring `ring`, in place
    (a dynamic_update_slice at the slot's offset in its dtype's vector), where `on`."""
    lay = self.layouts[k]
    index = jax.tree.unflatten(lay.treedef, list(range(len(lay.leaves))))
    where = {key: lay.leaves[index[key]] for key in ("up_ring", "down_ring") if key in index}

    def write(bufs, ring, msg, on, index):
      name, off, shape = where[ring]
      size = math.prod(shape[1:])
      vec = bufs[name]
      new = jax.lax.dynamic_update_slice(vec, msg[:size].astype(name), (off + (index % shape[0]) * size,))
      return dict(bufs, **{name: jnp.where(on, new, vec)})

    return write

  def _shard(self, per_device, n_args: int, n_outs: int):
    """per_device(bufs, *n_args replicated arguments) -> (bufs, *n_outs per-stage outputs), jitted
    over the mesh with the buffers donated."""
    spec = jax.tree.map(lambda _: P(AXIS), self._buffer_tree())
    fn = jax.shard_map(
      per_device,
      mesh=self.mesh,
      in_specs=(spec,) + (P(),) * n_args,
      out_specs=(spec,) + (P(AXIS),) * n_outs,
      check_vma=False,
    )
    return jax.jit(fn, donate_argnums=0)

  def _buffer_tree(self):
    return dict(self.widths)

  def place(self, state: list[dict]) -> dict:
    """The stages' trees as the stacked buffers, stage k's row on device k."""
    rows = [
      flatten(lay, jax.tree.map(np.asarray, st), self.widths, np) for lay, st in zip(self.layouts, state)
    ]
    return {n: jax.device_put(np.stack([r[n] for r in rows]), self.sharded) for n in self.widths}

  def state(self, bufs: dict) -> list[dict]:
    """The stages' trees out of the buffers (jax arrays, stage k's on device k: copies, so the
    buffers may be donated to the next dispatch)."""
    return _trees(self.layouts, bufs)


class Program(_Stacked):
  """The pipeline of `schedule` as one program over `devices` (one per stage).

  state = program.place(spmd_state(one_device_state, program.table))  -> the stacked buffers
  bufs, metrics = program.run(bufs, t0, t_hi, xs, ys, num_batches)     -> ticks [t0, t_hi)
  program.state(bufs)                                                   -> the stages' trees

  xs[i] is batch t0 + i (stage 0's), ys[i] the labels of batch t0 + i - F_{K-1} (the last stage's),
  both of `ticks` entries; metrics[i] = (ran, loss, accuracy) of the last stage's backward of tick
  t0 + i (ran 0 where that tick is past t_hi)."""

  def __init__(self, stages, optimizer, schedule: Schedule, state: list[dict], devices, ticks: int):
    self.schedule, self.ticks = schedule, ticks
    self.table = timetable(schedule)
    # What crosses link k (both ways): stage k+1's input.
    links = [st["in_ring"].shape[1:] for st in state[1:]]
    self._setup(state, links, {str(st["in_ring"].dtype) for st in state[1:]}, devices)
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
    """Stage k's writes, at the end of unit u, of what its neighbours sent in u into its link rings."""
    tab, K, write = self.table, self.K, self._ring_writer(k)

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

    return self._shard(per_device, 5, 2)

  # -- the host side -----------------------------------------------------------------------------------

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

  @staticmethod
  def losses(outs) -> list:
    return losses_of(outs)


def losses_of(outs) -> list:
  """(tick, loss, acc) of each backward the last stage ran, from Program.advance's outputs."""
  got = []
  for out in outs:
    metrics, tb = (np.asarray(a) for a in out)
    got += [(int(t), float(m[1]), float(m[2])) for m, t in zip(metrics, tb) if m[0] > 0]
  return got


def build(stages, optimizer, config, state: list[dict], schedule, devices=None, per_dispatch: int = 0):
  """The program of config.method (placement=spmd): (program, its initial trees). `state` is the
  method's one-device init (baselines.METHODS); a tick method gets Program over `schedule`, a flush
  method (gpipe, 1f1b, zbh1) FlushProgram. `per_dispatch` (0: config.spmd_ticks) ticks or steps a
  dispatch."""
  devices = list(devices if devices is not None else jax.local_devices())[: config.num_stages]
  n = per_dispatch or config.spmd_ticks
  if methods.get(config.method).runs_tick("spmd"):
    trees = spmd_state(state, timetable(schedule))
    return Program(stages, optimizer, schedule, trees, devices, ticks=n), trees
  prog = FlushProgram(stages, optimizer, config.method, state, devices, config.microbatches, steps=n)
  return prog, prog.initial


# ----------------------------------------------------------------------------------------------------
# The flush methods (GPipe, 1F1B, ZB-H1) as one program.


def flush_state(stages, state: list[dict], table, x_micro) -> tuple[list[dict], list]:
  """Stage k's tree for a flush program: its parameters, optimizer and model state (one_device's),
  the step's gradient sum and (loss, acc) sums, and the rings its ops hand each other (flush.py):
  the forward's kept activations (GPipe: its input and the model state it saw, then the B's kept
  activations), B's output cotangents for W, the last stage's logits, and the incoming links'.
  Each ring has the slots its timetable keeps live at once (flush.slots). Returns (the trees, each
  stage's pipemare plan at the micro-batch's shapes)."""
  from ripples_jax.pipeline import flush, pipemare

  out, plans, K = [], [], len(stages)
  x = jax.ShapeDtypeStruct(x_micro.shape, x_micro.dtype)
  for k, (stage, st) in enumerate(zip(stages, state)):
    spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
    plan = pipemare.make_plan(stage, spec(st["params"]), spec(st["model_state"]), x)
    plans.append(plan)
    (y, _), kept = jax.eval_shape(
      lambda p, ms, x: pipemare.forward(plan, p, ms, x), st["params"], st["model_state"], x
    )
    _, saved = jax.eval_shape(lambda p, kp, c: flush.backward_input(plan, p, kp, c), st["params"], kept, y)
    Fu, Bu, Wu = (table.when(k, kind) for kind in (flush.F, flush.B, flush.W))
    ring = lambda n, tree: jax.tree.map(lambda a: jnp.zeros((n,) + a.shape, a.dtype), tree)
    held = flush.slots(Bu if table.method == "gpipe" else Fu, Wu, False)
    new = {
      "params": st["params"],
      "opt_state": st["opt_state"],
      "model_state": st["model_state"],
      "grads": jax.tree.map(jnp.zeros_like, st["params"]),
      "sums": jnp.zeros((2,), jnp.float32),
      "kept": ring(held, kept),
      "saved": ring(flush.slots(Bu, Wu, False), saved),
    }
    if table.method == "gpipe":  # its input and model state from F to B (rematerialisation)
      new["inputs"] = ring(flush.slots(Fu, Bu, False), (x, st["model_state"]))
    if k == K - 1:
      new["logits"] = ring(flush.slots(Fu, Bu, False), y)
    if k > 0:
      new["up_ring"] = ring(flush.slots(table.when(k - 1, flush.F), Fu, True), x)
    if k < K - 1:
      new["down_ring"] = ring(flush.slots(table.when(k + 1, flush.B), Bu, True), y)
    out.append(new)
    x = jax.ShapeDtypeStruct(y.shape, y.dtype)
  return out, plans


def _get(ring, m):
  return jax.tree.map(lambda r: r[m % r.shape[0]], ring)


def _put(ring, m, value):
  return jax.tree.map(lambda r, v: r.at[m % r.shape[0]].set(v), ring, value)


class FlushProgram(_Stacked):
  """GPipe, 1F1B or ZB-H1 (flush.py) as one program over `devices`: a step is the timetable's units
  (a scan; in each, every stage runs its op, then one hop up and one down), then every stage's
  update (the flush); a dispatch is a scan over `steps` steps, one compile for any number of them.

  bufs = program.place(program.initial)                  (initial: flush_state of one_device's state)
  bufs, sums = program.run(bufs, xs, ys, n)              xs: (steps, M, b / M, ...), ys: (steps, M, b / M)
  sums[i] = (loss, acc) of step i (the micro-batches' mean), for the first n steps (the rest skipped).

  The parameters and optimizer state (COLD) change only at the flush: they are read by the units but
  not carried through them, so a unit's conditional copies the rest of the stage's state (its rings
  and gradient sum), not them (docs/design.md 4.6b). bufs = {"cold": vectors, "hot": vectors}."""

  COLD = ("params", "opt_state")

  def __init__(
    self, stages, optimizer, method: str, state: list[dict], devices, microbatches: int, steps: int
  ):
    from ripples_jax.pipeline import flush

    self.method, self.M, self.steps = method, microbatches, steps
    x0 = state[0]["in_ring"][0]
    if x0.shape[0] % microbatches:
      raise ValueError(f"microbatches={microbatches} must divide the batch of {x0.shape[0]}")
    self.table = flush.timetable(method, len(stages), microbatches)
    self.initial, self.plans = flush_state(stages, state, self.table, x0[: x0.shape[0] // microbatches])
    links = [st["up_ring"].shape[1:] for st in self.initial[1:]]
    hot, cold = self._split(self.initial)
    self._setup(hot, links, {str(st["up_ring"].dtype) for st in self.initial[1:]}, devices)
    self.cold_layouts = [layout_of(st) for st in cold]
    names = sorted({n for lay in self.cold_layouts for n in lay.sizes})
    self.cold_widths = {n: max(lay.sizes.get(n, 0) for lay in self.cold_layouts) for n in names}
    ops = [self._stage_ops(stages[k], optimizer, k) for k in range(self.K)]
    arrivals = [self._stage_arrivals(k) for k in range(self.K)]
    updates = [self._stage_update(optimizer, k) for k in range(self.K)]
    self._run = self._compile(ops, arrivals, updates)

  def _split(self, trees):
    hot = [{key: v for key, v in st.items() if key not in self.COLD} for st in trees]
    return hot, [{key: st[key] for key in self.COLD} for st in trees]

  def _buffer_tree(self):
    return {"cold": dict(self.cold_widths), "hot": dict(self.widths)}

  def place(self, state: list[dict]) -> dict:
    hot, cold = self._split(state)
    out = {}
    for part, trees, layouts, widths in (
      ("hot", hot, self.layouts, self.widths),
      ("cold", cold, self.cold_layouts, self.cold_widths),
    ):
      rows = [flatten(lay, jax.tree.map(np.asarray, st), widths, np) for lay, st in zip(layouts, trees)]
      out[part] = {n: jax.device_put(np.stack([r[n] for r in rows]), self.sharded) for n in widths}
    return out

  def state(self, bufs: dict) -> list[dict]:
    hot, cold = _trees(self.layouts, bufs["hot"]), _trees(self.cold_layouts, bufs["cold"])
    return [{**h, **c} for h, c in zip(hot, cold)]

  def _stage_ops(self, stage, optimizer, k: int):
    """Stage k's op of unit u: idle, F, B or W on the timetable's micro-batch."""
    from ripples_jax import losses
    from ripples_jax.models import apply_model
    from ripples_jax.pipeline import flush, pipemare

    lay, K, M, gpipe = self.layouts[k], self.K, self.M, self.method == "gpipe"
    hot_keys = [key for key in self.initial[k] if key not in self.COLD]
    last, zero = k == K - 1, jnp.zeros((self.msg_width,), self.msg_dtype)
    plan = self.plans[k]
    op_col, mb_col = jnp.asarray(self.table.op[:, k]), jnp.asarray(self.table.mb[:, k])

    def fwd(st, m, xs, ys):
      x = xs[m] if k == 0 else _get(st["up_ring"], m)
      ms = st["model_state"]
      if gpipe:  # keeps only its input (and the model state it saw): B runs the forward again
        st = dict(st, inputs=_put(st["inputs"], m, (x, ms)))
        y, new_ms = apply_model(stage, st["params"], ms, x, train=True)
      else:
        (y, new_ms), kept = pipemare.forward(plan, st["params"], ms, x)
        st = dict(st, kept=_put(st["kept"], m, kept))
        if last:
          st["logits"] = _put(st["logits"], m, y)
      return dict(st, model_state=new_ms), (zero if last else self._msg(y)), zero

    def bwd(st, m, xs, ys):
      if gpipe:
        x, ms = _get(st["inputs"], m)
        (logits, _), kept = pipemare.forward(plan, st["params"], ms, x)
        st = dict(st, kept=_put(st["kept"], m, kept))
      else:
        kept = _get(st["kept"], m)
        logits = _get(st["logits"], m) if last else None
      if last:  # the micro-batch's mean loss; its gradient is the cotangent B starts from
        loss_fn = lambda z: losses.cross_entropy(z, ys[m])
        loss, cot = jax.value_and_grad(loss_fn)(logits)
        acc = losses.accuracy(logits, ys[m])
        st = dict(st, sums=st["sums"] + jnp.stack([loss, acc]).astype(jnp.float32) / M)
      else:
        cot = _get(st["down_ring"], m)
      g_x, saved = flush.backward_input(plan, st["params"], kept, cot)
      # Stage 0 sends nothing down: XLA drops its input gradient (the cotangents W needs remain).
      return dict(st, saved=_put(st["saved"], m, saved)), zero, (zero if k == 0 else self._msg(g_x))

    def wgt(st, m, xs, ys):
      g = flush.backward_weights(plan, st["params"], _get(st["kept"], m), _get(st["saved"], m))
      return dict(st, grads=jax.tree.map(lambda a, b: a + b / M, st["grads"], g)), zero, zero

    def idle(st, m, xs, ys):
      return st, zero, zero

    cold_lay = self.cold_layouts[k]

    def unit(hot, cold, u, xs, ys):
      # The stage's tree read out of its vectors; what an op changes is hot, and only that goes back.
      st = {**unflatten(lay, hot), **unflatten(cold_lay, cold)}
      st, up, down = jax.lax.switch(op_col[u], [idle, fwd, bwd, wgt], st, mb_col[u], xs, ys)
      return flatten(lay, {key: st[key] for key in hot_keys}, self.widths), up, down

    return unit

  def _stage_arrivals(self, k: int):
    from ripples_jax.pipeline import flush

    K, write = self.K, self._ring_writer(k)
    op, mb = jnp.asarray(self.table.op), jnp.asarray(self.table.mb)

    def arrive(bufs, up, down, u):
      if k > 0:
        bufs = write(bufs, "up_ring", up, op[u, k - 1] == flush.F, mb[u, k - 1])
      if k < K - 1:
        bufs = write(bufs, "down_ring", down, op[u, k + 1] == flush.B, mb[u, k + 1])
      return bufs

    return arrive

  def _stage_update(self, optimizer, k: int):
    """The flush: stage k's update from the step's summed gradients, the sums zeroed."""
    import optax

    lay, cold_lay = self.layouts[k], self.cold_layouts[k]

    def update(hot, cold):
      h, c = unflatten(lay, hot), unflatten(cold_lay, cold)
      updates, opt_state = optimizer.update(h["grads"], c["opt_state"], c["params"])
      c = {"params": optax.apply_updates(c["params"], updates), "opt_state": opt_state}
      new = dict(h, grads=jax.tree.map(jnp.zeros_like, h["grads"]), sums=jnp.zeros_like(h["sums"]))
      return flatten(lay, new, self.widths), flatten(cold_lay, c, self.cold_widths), h["sums"]

    return update

  def _compile(self, ops, arrivals, updates):
    K, units = self.K, self.table.units
    up_perm, down_perm = [(k, k + 1) for k in range(K - 1)], [(k + 1, k) for k in range(K - 1)]

    def one_step(bufs, xs, ys):
      k, cold = jax.lax.axis_index(AXIS), bufs["cold"]

      def unit(hot, u):  # the cold vectors are read, not carried: the units do not copy them
        hot, up, down = jax.lax.switch(k, ops, hot, cold, u, xs, ys)
        up, down = jax.lax.ppermute(up, AXIS, up_perm), jax.lax.ppermute(down, AXIS, down_perm)
        return jax.lax.switch(k, arrivals, hot, up, down, u), None

      hot, _ = jax.lax.scan(unit, bufs["hot"], jnp.arange(units))
      hot, cold, sums = jax.lax.switch(k, updates, hot, cold)
      return {"hot": hot, "cold": cold}, sums

    def per_device(bufs, xs, ys, n):
      bufs = jax.tree.map(lambda v: v[0], bufs)

      def step(bufs, i):
        skip = lambda b: (b, jnp.zeros((2,), jnp.float32))
        return jax.lax.cond(i < n, lambda b: one_step(b, xs[i], ys[i]), skip, bufs)

      bufs, sums = jax.lax.scan(step, bufs, jnp.arange(self.steps))
      return jax.tree.map(lambda v: v[None], bufs), sums[None]

    return self._shard(per_device, 3, 1)

  def advance(self, bufs, t0: int, t_end: int, x_of, labels_of, num_batches: int):
    """Steps (batches) [t0, t_end) in dispatches of `steps`, Program.advance's signature: (bufs,
    [(first step, steps run, sums)] for losses)."""
    del num_batches
    outs = []
    for t in range(t0, t_end, self.steps):
      span, n = range(t, t + self.steps), min(self.steps, t_end - t)
      bufs, sums = self.run(
        bufs, np.stack([x_of(i) for i in span]), np.stack([labels_of(i) for i in span]), n
      )
      outs.append((t, n, sums))
    return bufs, outs

  @staticmethod
  def losses(outs) -> list:
    """(step, loss, acc) of every step the outputs cover."""
    got = []
    for t, n, sums in outs:
      got += [(t + i, float(loss), float(acc)) for i, (loss, acc) in enumerate(np.asarray(sums)[:n])]
    return got

  def run(self, bufs, xs, ys, n: int):
    """The first n of `steps` steps on xs (steps, b, ...) and ys (steps, b): (bufs, sums of the last
    stage: (steps, 2) device arrays)."""
    split = lambda a: a.reshape((a.shape[0], self.M, a.shape[1] // self.M) + a.shape[2:])
    bufs, sums = self._run(bufs, split(jnp.asarray(xs)), split(jnp.asarray(ys)), jnp.asarray(n, jnp.int32))
    return bufs, sums[self.K - 1]
