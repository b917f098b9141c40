"""Iteration-time model of DSP and its baselines, with stragglers, and the measurement that feeds it.

The model is pure numpy; `measure_stage_times` times each stage's jitted forward and backward with
`time_interleaved` (round-robin medians), so the model's inputs are measured, never assumed.

A network split depth-wise into K stages; stage k takes F_k for the forward and B_k for the backward of
one batch (the lead measures them with jax and passes them in). One iteration = one batch trained.

  bp     sum_k (F_k + B_k)                          one batch through all stages, nothing overlaps
  gpipe  [sum_k f_k + (M-1) max_k f_k]              M micro-batches, forward wavefront, then the
         + [sum_k b_k + (M-1) max_k b_k]            backward wavefront, flush; f_k = F_k/M,
                                                    b_k = (B_k + F_k)/M with remat, B_k/M without
  ddg    sum_k F_k + max_k B_k                      forward locked, backwards in parallel (delayed grads),
                                                    one batch in flight (the published global step)
  pipedream  steady 1F1B: max_k (F_k + B_k)         stage k: F of batch t (after stage k-1's), then B of
                                                    batch t-(K-1-k) (after stage k+1's, a tick before)
  pipemare   steady 1F1B: max_k (F_k + B_k)         as pipedream; the forward's activations kept, no
                                                    weight versions, no recompute
  fr     sum_k F_k + max_k (F_k + B_k)              as ddg, the backward recomputes the forward first
  dni    sum_k F_k + max_k (B_k + P_k)              as ddg, P_k = synthetic-gradient predictor cost
  dsp    max_k (F_k + B_k)        fused             every stage busy every tick: the forward of a new
         max_k (2 F_k + B_k)      unfused           batch and recompute + backward of an old one

With equal stages (F, B) GPipe is (M+K-1)/M x (F + B) without remat and (M+K-1)/M x (2F + B) with it,
so its speedup over BP is K M / (M+K-1), resp. K M (F+B) / ((M+K-1)(2F+B)) = 3 K M / (4 (M+K-1)) for
B = 2F. DSP's speedup is K fused and K (F+B) / (2F+B) = 3K/4 unfused (B = 2F).

`simulate` runs the same methods as recurrences over iterations (ticks) and stages, so unequal stages,
a fixed straggler and random slowdowns all follow from the dependencies alone:

  times = simulate("dsp", F, B, 200, straggler_stage=1, slowdown=3.0)
  steady_spacing(times)           # = iteration time with the straggler
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from ripples_jax.models import apply_model
from ripples_jax.pipeline import methods as methods_lib
from ripples_jax.pipeline.methods import FLUSH, ONE_F_ONE_B, SCHEDULED, SEQUENTIAL, UNLOCKED

# Each method's shape is its record's (pipeline/methods.py): `iteration` as published, `runtime` as the
# per-process runtime runs it, `backward` the work of its decoupled backward.
METHODS = methods_lib.names()
# The runtime's variants the model names apart from their method: DSP with the residual ring.
RUNTIME_VARIANTS = {"dsp_residuals": ("dsp", "residuals")}


def _stages(fwd_K, bwd_K, predictor_K=None):
  """float64 arrays (F, B, P), checked: same length K >= 1, non-negative."""
  f = np.asarray(fwd_K, np.float64).reshape(-1)
  b = np.asarray(bwd_K, np.float64).reshape(-1)
  p = np.zeros_like(f) if predictor_K is None else np.asarray(predictor_K, np.float64).reshape(-1)
  if not (f.size and f.size == b.size == p.size):
    raise ValueError(f"need K >= 1 equal-length stage times, got {f.size}, {b.size}, {p.size}")
  if (f < 0).any() or (b < 0).any() or (p < 0).any():
    raise ValueError("stage times must be non-negative")
  return f, b, p


def _record(method) -> methods_lib.Method:
  """The record of `method` (ValueError: unknown)."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
  return methods_lib.get(method)


def backward_work(method, f, b, p, fused=False):
  """Per-stage work that runs in parallel across stages: the decoupled backward, or DSP's tick.

  DSP's fused tick runs the forward of the new batch and the recompute of the old one as one pass
  over both batches and charges it F_k (the optimistic end: the pass is bound by the stage's weights
  and launches, not by the batch); unfused, the recompute is a second forward: 2 F_k + B_k.
  """
  m = _record(method)
  if m.backward == methods_lib.KEPT:
    return b  # the stored graph (activations kept; pipemare: no weight versions): no recompute
  if m.backward == methods_lib.RECOMPUTE and m.iteration == UNLOCKED:
    return f + b if fused else 2 * f + b  # the new batch's forward, the recompute, the backward
  if m.backward == methods_lib.RECOMPUTE:
    return f + b  # inputs only: recompute the forward, then the backward
  if m.backward == methods_lib.SYNTHETIC:
    return b + p  # backward from the synthetic gradient, plus the predictor's own step
  raise ValueError(f"{method!r} has no decoupled backward")


def gpipe_iteration(f, b, microbatches=4, remat=True):
  """One flushed GPipe iteration by recurrence over (stage, micro-batch); f, b are whole-batch times.

  Forward wavefront: micro-batch m enters stage k once stage k-1 has sent it and stage k is done with
  m-1. The backward wavefront starts at the last stage when every forward is done and runs the
  micro-batches in reverse order; with remat each micro-batch backward re-runs its forward first
  (GPipe stores only the stage-boundary activations). The flush: the iteration ends when stage 0 ends.
  """
  f, b = np.asarray(f, np.float64), np.asarray(b, np.float64)
  m_count, k_count = int(microbatches), f.size
  if m_count < 1:
    raise ValueError(f"microbatches must be >= 1, got {microbatches}")
  fm = f / m_count
  bm = (b + f) / m_count if remat else b / m_count
  tf = np.zeros((k_count + 1, m_count + 1))  # row 0 / col 0: nothing upstream / before
  for k in range(k_count):
    for m in range(m_count):
      tf[k + 1, m + 1] = max(tf[k, m + 1], tf[k + 1, m]) + fm[k]
  fwd_end = tf[1:, -1]
  tb = np.zeros((k_count + 1, m_count + 1))  # row k_count: the loss, ready when the forward is done
  tb[k_count, :] = fwd_end[-1]
  for k in reversed(range(k_count)):
    tb[k, 0] = fwd_end[-1]  # a stage starts backwards after every forward (flush)
    for j in range(m_count):
      tb[k, j + 1] = max(tb[k + 1, j + 1], tb[k, j], fwd_end[k]) + bm[k]
  return float(tb[:k_count, -1].max())


# The share of a stage's backward that is W (its weight gradients) in scheduled_iteration: a dense or
# convolutional layer's backward is two products of a forward's size, one for the input's gradient (B)
# and one for the weights' (W).
W_SHARE = 0.5


def scheduled_iteration(method, f, b, microbatches=4, w_share=W_SHARE):
  """One step of a flush pipeline that runs flush.py's op orders (1f1b, zbh1; gpipe with its
  recompute), each op as soon as its stage is free and its inputs arrived: F_k = f_k / M, B_k =
  (1 - w_share) b_k / M (GPipe's: + F_k), W_k = w_share b_k / M. The step ends at its last op."""
  from ripples_jax.pipeline import flush

  f, b = np.asarray(f, np.float64), np.asarray(b, np.float64)
  K, M = f.size, int(microbatches)
  cost = {
    flush.F: f / M,
    flush.B: (1 - w_share) * b / M + (f / M if method == "gpipe" else 0),
    flush.W: w_share * b / M,
  }
  times = flush.op_times(method, K, M, lambda kind, k: cost[kind][k])
  return float(max(end for _, end in times.values()))


def iteration_time(method, fwd_K, bwd_K, microbatches=4, fused=False, remat=True, predictor_K=None) -> float:
  """Seconds per batch in steady state, equal or unequal stages."""
  shape = _record(method).iteration
  f, b, p = _stages(fwd_K, bwd_K, predictor_K)
  if shape == SEQUENTIAL:
    return float((f + b).sum())
  if shape == FLUSH:
    return gpipe_iteration(f, b, microbatches, remat)
  if shape == SCHEDULED:
    return scheduled_iteration(method, f, b, microbatches)
  if shape == UNLOCKED:
    return float(backward_work(method, f, b, p, fused).max())
  if shape == ONE_F_ONE_B:
    return float((f + backward_work(method, f, b, p)).max())
  return float(f.sum() + backward_work(method, f, b, p).max())  # GLOBAL_STEP


def speedup_vs_bp(method, fwd_K, bwd_K, **kw) -> float:
  """BP's iteration time over the method's (predictor_K and friends do not change BP)."""
  return iteration_time("bp", fwd_K, bwd_K) / iteration_time(method, fwd_K, bwd_K, **kw)


def slowdown_factors(
  num_stages, num_iters, straggler_stage=None, slowdown=1.0, random_p=0.0, seed=0
) -> np.ndarray:
  """[num_iters, K] multipliers of every stage's work per iteration.

  random_p > 0: every stage independently slowed by `slowdown` with probability random_p per
  iteration (the same draw for every method under a seed, so methods are compared on one trace);
  else only `straggler_stage`, every iteration.
  """
  out = np.ones((int(num_iters), int(num_stages)))
  if random_p > 0:
    hit = np.random.default_rng(seed).random(out.shape) < random_p
    out[hit] = slowdown
  elif straggler_stage is not None:
    if not -num_stages <= straggler_stage < num_stages:
      raise ValueError(f"straggler_stage {straggler_stage} out of range for K={num_stages}")
    out[:, straggler_stage] = slowdown
  return out


def simulate(
  method,
  fwd_K,
  bwd_K,
  num_iters,
  microbatches=4,
  fused=False,
  remat=True,
  straggler_stage=None,
  slowdown=1.0,
  random_p=0.0,
  seed=0,
  predictor_K=None,
) -> np.ndarray:
  """Cumulative completion time of each iteration, from a recurrence over iterations and stages.

  A stage's work of an iteration starts once its own previous work is done and its inputs arrived.
    bp        the stages run one after the other: end_t = end_{t-1} + sum_k work_k,t
    gpipe     each iteration is a flushed `gpipe_iteration` on that iteration's stage times
    ddg/fr/dni  one batch in flight (the methods' global step: the next forward starts once every
              stage applied its update). The forward runs stage by stage; at the loss every stage
              starts its backward, needing its forward and stage k+1's gradient of iteration t-1
    dsp       T[k,t] = max(T[k,t-1], T[k-1,t-1], T[k+1,t-1]) + work[k,t]: delay-1 FIFOs both ways;
              the completion of tick t is the last stage's, where the loss is
    pipedream, pipemare  1F1B (`one_f_one_b`): a stage's forward follows its previous tick and stage
              k-1's forward of the tick, its backward follows that and stage k+1's previous tick
  Every stage's work is a full tick from t = 0 (no cheaper fill ticks): only the steady state is meant.
  The recurrence is the method's record's `iteration` shape (pipeline/methods.py).
  """
  shape = _record(method).iteration
  f, b, p = _stages(fwd_K, bwd_K, predictor_K)
  k_count, n = f.size, int(num_iters)
  fac = slowdown_factors(k_count, n, straggler_stage, slowdown, random_p, seed)
  out = np.empty(n)
  if shape == SEQUENTIAL:
    return np.cumsum(fac @ (f + b))
  if shape in (FLUSH, SCHEDULED):
    end = 0.0
    for t in range(n):
      if shape == FLUSH:
        end += gpipe_iteration(f * fac[t], b * fac[t], microbatches, remat)
      else:
        end += scheduled_iteration(method, f * fac[t], b * fac[t], microbatches)
      out[t] = end
    return out
  if shape == UNLOCKED:
    w = backward_work(method, f, b, p, fused)
    tick = np.zeros(k_count)
    pad = np.full(1, -np.inf)  # stage 0 reads the data, stage K-1 makes the loss: local
    for t in range(n):
      up = np.concatenate([pad, tick[:-1]])  # stage k-1's activations of tick t-1
      down = np.concatenate([tick[1:], pad])  # stage k+1's error gradient of tick t-1
      tick = np.maximum(np.maximum(tick, up), down) + w * fac[t]
      out[t] = tick[-1]
    return out
  if shape == ONE_F_ONE_B:
    return one_f_one_b(f[None] * fac, backward_work(method, f, b, p)[None] * fac)[:, -1]
  w = backward_work(method, f, b, p)  # GLOBAL_STEP
  done = np.zeros(k_count)  # when each stage finished its previous backward
  for t in range(n):
    start = done.max()  # one batch in flight: the global step
    tf = np.empty(k_count)
    prev = start
    for k in range(k_count):
      tf[k] = max(prev, done[k]) + f[k] * fac[t, k]
      prev = tf[k]
    loss = tf[-1]  # as published, the parallel backward phase follows it
    grad = np.append(done[1:], loss)  # stage k+1's delayed gradient; the last stage's is fresh
    done = np.maximum(np.maximum(tf, loss), grad) + w * fac[t]
    out[t] = done.max()
  return out


def one_f_one_b(fwd_TK, bwd_TK, up=None) -> np.ndarray:
  """[T, K] end times of every stage's ticks under 1F1B, from [T, K] forward and backward (the work
  after the forward: the backward, with its recompute where there is one) seconds per tick.

  Stage k's tick t is the forward of batch t, which needs stage k-1's forward of it (plus the link's
  transfer up[k-1]), then the backward of batch t-(K-1-k), which needs stage k+1's tick t-1 (plus its
  transfer down); the last stage's loss and backward follow its forward at once. Transfers run beside
  compute (the runtime's link threads), so they delay the receiver only."""
  fwd_TK, bwd_TK = np.asarray(fwd_TK, np.float64), np.asarray(bwd_TK, np.float64)
  n, K = fwd_TK.shape
  up = np.zeros(max(K - 1, 0)) if up is None else np.asarray(up, np.float64)
  end = np.zeros((n + 1, K))  # row 0: before the first tick
  for t in range(n):
    fwd_end = np.empty(K)
    for k in range(K):
      ready = fwd_end[k - 1] + up[k - 1] if k > 0 else 0.0
      fwd_end[k] = max(end[t, k], ready) + fwd_TK[t, k]
    for k in reversed(range(K)):
      grad = end[t, k + 1] + up[k] if k < K - 1 else 0.0  # stage k+1's tick t-1 (row t: its end)
      end[t + 1, k] = max(fwd_end[k], grad) + bwd_TK[t, k]
  return end[1:]


def steady_spacing(times, warmup=None) -> float:
  """Mean seconds per iteration after `warmup` iterations (default half of them)."""
  times = np.asarray(times, np.float64)
  n = times.size
  warmup = n // 2 if warmup is None else int(warmup)
  if not 1 <= warmup < n:
    raise ValueError(f"warmup must be in [1, {n}), got {warmup}")
  return float((times[-1] - times[warmup - 1]) / (n - warmup))


def straggler_report(fwd_K, bwd_K, num_iters=400, methods=METHODS, **kw) -> dict:
  """{method: {base, slowed, ratio, speedup}}: steady iteration time without and with the slowdown.

  kw goes to `simulate` (straggler_stage/slowdown or random_p/seed, microbatches, fused, ...);
  `speedup` is BP's slowed time over the method's slowed time, both on the same slowdown trace.
  """
  none = {k: v for k, v in kw.items() if k not in ("straggler_stage", "slowdown", "random_p")}
  rows = {}
  for m in ("bp",) + tuple(x for x in methods if x != "bp"):
    base = steady_spacing(simulate(m, fwd_K, bwd_K, num_iters, **none))
    slowed = steady_spacing(simulate(m, fwd_K, bwd_K, num_iters, **kw))
    rows[m] = {
      "base": base,
      "slowed": slowed,
      "ratio": slowed / base,
      "speedup": rows["bp"]["slowed"] / slowed if rows else 1.0,
    }
  return {m: rows[m] for m in methods}


def time_interleaved(fns: dict, reps: int = 30, warmup: int = 2) -> dict:
  """Median seconds per call of each zero-argument fn (returning jax values), calls interleaved
  round-robin so that drift on a shared machine hits every fn alike."""
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: float(np.median(v)) for k, v in times.items()}


def measure_predictor_times(state, reps: int = 20) -> list[float]:
  """DNI: median seconds of each stage's synthetic-gradient work per iteration (the predictor's own
  training step on the stored output, and its prediction for the new output), 0 for the top stage."""
  from ripples_jax.pipeline.baselines import _predict

  out = []
  for st in state:
    if "sg" not in st:
      out.append(0.0)
      continue

    def work(sg, h, y, target):
      grads = jax.grad(lambda sg: 0.5 * jnp.mean(jnp.square(_predict(sg, h, y) - target)))(sg)
      return jax.tree.map(lambda a, g: a - 0.01 * g, sg, grads), _predict(sg, h, y)

    fn = jax.jit(work)
    args = (st["sg"], st["last_out"], st["last_y"], st["last_true"])
    out.append(time_interleaved({"p": lambda: fn(*args)}, reps=reps)["p"])
  return out


def measure_stage_times(stages, state, sample_x, reps: int = 20):
  """Median forward and backward seconds of each stage's jitted program on one batch."""
  fwd_K, bwd_K = [], []
  x = jnp.asarray(sample_x)
  for stage, st in zip(stages, state):
    x = jax.device_put(x, jax.tree.leaves(st["params"])[0].sharding)  # the stage's device
    f = jax.jit(lambda p, x, stage=stage, ms=st["model_state"]: apply_model(stage, p, ms, x, True)[0])
    y = f(st["params"], x)

    def fb(p, x, stage=stage, ms=st["model_state"], y=y):
      out, pullback = jax.vjp(lambda p, x: apply_model(stage, p, ms, x, True)[0], p, x)
      return pullback(jnp.ones_like(out))

    fb = jax.jit(fb)
    med = time_interleaved({"f": lambda: f(st["params"], x), "fb": lambda: fb(st["params"], x)}, reps=reps)
    fwd_K.append(med["f"])
    bwd_K.append(max(med["fb"] - med["f"], 0.0))
    x = y
  return fwd_K, bwd_K


def stage_busy(stage: dict) -> float:
  """Seconds one stage of a runtime summary computes and transfers per iteration: each kind's median
  call times the calls of that kind it makes per iteration (GPipe: M of each), plus one calibrated
  transfer per link it has."""
  ticks = max(int(stage["ticks"]), 1)
  calls = stage.get("calls", {})
  compute = sum(v * calls.get(k, ticks) / ticks for k, v in stage["median_s"].items() if k != "link")
  return compute + sum(stage.get("transfer_s", {}).values())


def tick_efficiency(summary: dict) -> float:
  """The slowest stage's compute and transfer over the measured iteration (1.0: no stage waits)."""
  return max(stage_busy(s) for s in summary["stages"]) / summary["iteration_s"]


def _runtime_record(method: str) -> tuple:
  """(record, ring mode in the per-process runtime) of a method or a RUNTIME_VARIANTS name; ValueError:
  unknown, or it does not run in the runtime."""
  name, mode = RUNTIME_VARIANTS.get(method, (method, "recompute"))
  m = _record(name)
  if m.runtime is None:
    raise ValueError(f"{method!r} does not run in the pipeline runtime")
  return m, methods_lib.ring(name, "per_process", mode)


def calls_from_bp(method: str, bp_stages: list[dict], microbatches: int = 4) -> list[dict]:
  """Stage entries (median_s, transfer_s) for `method`, made from the calls model-parallel BP measured
  in another run: the model's inputs for a cross-run prediction (`runtime_iteration`). BP's calls keep
  residuals (its forward is a vjp, its backward the pullback and the update). A method that keeps
  residuals makes the same calls; one that recomputes makes a forward (charged BP's) and a backward that
  runs the forward again (BP's forward + backward); GPipe makes M calls of 1/M of the batch each
  (charged 1/M of BP's, the remat backward as the recompute's) and an update (charged nothing). The
  last stage's calls (the loss and its backward at once) are BP's for every method."""
  try:
    m, ring = _runtime_record(method)
  except ValueError:
    raise ValueError(f"{method!r}: no prediction from BP's calls") from None
  K, out = len(bp_stages), []
  for k, st in enumerate(bp_stages):
    f, b = (float(st["median_s"].get(kind, 0.0)) for kind in ("forward", "backward"))
    last = k == K - 1
    if m.runtime == FLUSH:
      M = int(microbatches)
      calls = {"forward": 0.0, "backward": b / M} if last else {"forward": f / M, "backward": (f + b) / M}
    elif last or ring not in methods_lib.RECOMPUTING:
      calls = {"forward": f, "backward": b}
    else:
      calls = {"forward": f, "backward": f + b}
    out.append({"median_s": calls, "transfer_s": dict(st.get("transfer_s", {}))})
  return out


def straggler_factor(seed: int, k: int, t: int, slowdown: float, stage: int = -1, p: float = 0.0) -> float:
  """The pipeline runtime's straggler factor of stage k at tick t: `slowdown` on `stage` (or, with
  p > 0, on each stage with probability p per tick: a draw of (seed, t, k) alone, so every method
  and the model see the same one), else 1."""
  if slowdown <= 1:
    return 1.0
  hit = k == stage if p == 0 else np.random.default_rng([seed, t, k]).random() < p
  return float(slowdown) if hit else 1.0


def runtime_with_stragglers(
  method: str, stages: list[dict], factors_TK, delay: int = 1, slack: bool = True, microbatches: int = 4
) -> float:
  """The runtime's steady iteration with each stage's compute calls at tick t scaled by factors_TK[t, k],
  predicted from a run without stragglers (its `stages`: measured calls and transfers), by the
  dependencies each method's ticks have in pipeline/per_process.py:
    dsp       with slack, stage k's tick t starts after its tick t-1 and the swap of tick t-d on each of
              its links (both ends' tick t-d, plus a transfer); lockstep, a tick ends with a swap
              both ends meet at
    pipedream, pipemare, ddg, fr   `one_f_one_b` with the scaled calls
    bp        the stages one after the other; gpipe: a flushed iteration per batch
  (the record's `runtime` shape)."""
  shape = _runtime_record(method)[0].runtime
  fac = np.asarray(factors_TK, np.float64)
  n, K = fac.shape
  call = lambda kind: np.array([float(s["median_s"].get(kind, 0.0)) for s in stages])
  f, b, fused = call("forward"), call("backward"), call("fused")
  up = np.array([float(stages[k]["transfer_s"].get("upper", 0.0)) for k in range(K - 1)])
  if shape == SEQUENTIAL:
    ends = np.cumsum(fac @ (f + b) + 2 * up.sum())
  elif shape == FLUSH:
    M = int(microbatches)
    update = max(float(s["median_s"].get("update", 0.0)) for s in stages)
    b = b + call("accumulate")  # each micro-batch's gradient summed after its backward
    f_up, b_down = f + np.append(up, 0.0) / M, b + np.append(0.0, up) / M
    ends = np.cumsum(
      [gpipe_iteration(M * f_up * fac[t], M * b_down * fac[t], M, remat=False) + update for t in range(n)]
    )
  elif shape == ONE_F_ONE_B:
    ends = one_f_one_b(f[None] * fac, b[None] * fac, up).max(axis=1)
  else:  # UNLOCKED
    work = (fused + f + b)[None] * fac
    link = lambda k: (up[k - 1] if k > 0 else 0.0, up[k] if k < K - 1 else 0.0)
    end = np.zeros((n + 1, K))
    for t in range(n):
      if slack:
        # Tick t reads the swap of tick t - d on each link: a two-party transfer that completes a
        # transfer time after both ends posted it (the end of their tick t - d).
        src = t + 1 - delay
        for k in range(K):
          lo, hi = link(k)
          ready = 0.0
          if src >= 1 and k > 0:
            ready = max(ready, max(end[src, k - 1], end[src, k]) + lo)
          if src >= 1 and k < K - 1:
            ready = max(ready, max(end[src, k + 1], end[src, k]) + hi)
          end[t + 1, k] = max(end[t, k], ready) + work[t, k]
      else:
        done = end[t] + work[t]  # each stage's compute, then the swaps its links meet at
        for k in range(K):
          lo, hi = link(k)
          meet = [done[k]] + ([done[k - 1]] if k > 0 else []) + ([done[k + 1]] if k < K - 1 else [])
          end[t + 1, k] = max(meet) + max(lo, hi)
    ends = end[1:].max(axis=1)
  return steady_spacing(ends, warmup=min(max(n // 4, 1), n - 1))


def runtime_iteration(
  method: str, stages: list[dict], microbatches: int = 4, overhead_s: float = 0.0
) -> float:
  """The pipeline runtime's iteration (pipeline/per_process.py) as predicted from the costs measured in
  that run: per stage, `median_s` (median seconds per call of each kind it makes: forward, backward,
  fused, update, accumulate) and `transfer_s` (one transfer on its lower/upper link with both ends ready).

  It charges exactly the calls the runtime makes, so a recompute is in `backward` where the method
  recomputes (fr, pipemare, dsp recompute, gpipe's remat) and absent where it keeps residuals (bp,
  ddg, pipedream, dsp residuals), and the fused call is what it measured, not an assumed F:
    bp        sum_k (forward_k + backward_k) + an up and a down transfer per link: nothing overlaps
    ddg, fr, pipedream, pipemare  the steady spacing of `one_f_one_b` on the calls and transfers: the
              runtime runs every schedule of a locked forward and one-tick backward links as 1F1B (it
              has no global step; DDG's published one is `iteration_time`'s)
    dsp       max_k (stage k's calls + one swap per link it has): every stage busy every tick
    gpipe     the flushed wavefront of `gpipe_iteration` on the micro-batch calls, each transfer
              (1/M of the batch's) added to the call it follows, plus the update
  `overhead_s`: the seconds a stage spends per tick outside its calls and transfers (the loop in
  Python, dispatch, the link threads' hand-offs; `tick_overhead` fits it to a run), charged once per
  stage-tick, half to its forward and half to its backward: BP pays it on every stage in turn, DSP
  once a tick, 1F1B on each call of its critical path, GPipe on each micro-batch call.
  """
  o = float(overhead_s)
  shape = _runtime_record(method)[0].runtime
  K = len(stages)
  call = lambda k, kind: float(stages[k]["median_s"].get(kind, 0.0))
  up = [float(stages[k]["transfer_s"].get("upper", 0.0)) for k in range(K - 1)]  # link k
  link = lambda k: (up[k - 1] if k > 0 else 0.0) + (up[k] if k < K - 1 else 0.0)  # stage k's links
  f = np.array([call(k, "forward") for k in range(K)]) + o / 2
  b = np.array([call(k, "backward") for k in range(K)]) + o / 2
  if shape == SEQUENTIAL:
    return float(f.sum() + b.sum() + 2 * sum(up))
  if shape == ONE_F_ONE_B:
    n = 64
    ends = one_f_one_b(np.tile(f, (n, 1)), np.tile(b, (n, 1)), up)
    return steady_spacing(ends.max(axis=1))
  if shape == UNLOCKED:  # f + b hold the tick's overhead (a fused stage's are 0 + o / 2 each)
    return float(max(call(k, "fused") + f[k] + b[k] + link(k) for k in range(K)))
  if shape == FLUSH:
    M = int(microbatches)
    b = b + np.array([call(k, "accumulate") for k in range(K)])  # each micro-batch's gradient summed
    f_up = f + np.array(up + [0.0]) / M  # a micro-batch forward, then its activation up
    b_down = b + np.array([0.0] + up) / M  # a micro-batch backward, then its gradient down
    return float(
      gpipe_iteration(M * f_up, M * b_down, M, remat=False) + max(call(k, "update") for k in range(K))
    )
  raise ValueError(f"{method!r} does not run in the pipeline runtime")


def tick_overhead(method: str, stages: list[dict], iteration_s: float, microbatches: int = 4) -> float:
  """The per-stage-tick overhead (runtime_iteration's `overhead_s`) at which the model's iteration
  equals a run's measured `iteration_s`: what the run spent outside its measured calls and transfers.
  Negative where the calls alone already exceed the iteration (a stage's call borrowing the other's
  idle core). Fitted on one run, it predicts others (benchmarks/pipeline.py: `prediction_error`
  beside `prediction_error_with_overhead`)."""
  at = lambda o: runtime_iteration(method, stages, microbatches, o) - float(iteration_s)
  lo, hi = -float(iteration_s), float(iteration_s)
  if at(lo) > 0 or at(hi) < 0:
    raise ValueError(f"no overhead in [{lo}, {hi}] s gives {method}'s measured {iteration_s} s")
  for _ in range(60):  # the model grows with o: bisection
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if at(mid) < 0 else (lo, mid)
  return (lo + hi) / 2
