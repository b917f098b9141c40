"""placement=devices: the pipeline's stages on the devices of this one process (docs/design.md 4.6).

How JAX users pipeline on one host (the GPUs of a node, the TPU chips of a host, forced CPU devices
here): stage k's state (parameters, optimizer state, ring buffers, the FIFOs of its incoming links)
lives on device k. Each tick dispatches, per stage, a forward program and a backward program on that
stage's device, and the links are device-to-device copies (jax.device_put) into the receiving stage's
FIFO. Dispatch is asynchronous and a program waits only for its own inputs, so the stages of one tick
run at once wherever the schedule makes them independent: under DSP's delays every stage reads its
inputs from its FIFOs (filled by earlier ticks); under a locked forward (ddg, pipedream, pipemare, fr) a
stage's forward waits for the stage below it, as the tick says, while that stage runs its backward.
A link of delay d hands tick t's output to tick t + d, so a transfer has d - 1 ticks of slack. Under
DSP's delays (every link delayed) a stage's whole tick is one program instead (make_fused_device_tick:
the arrivals of tick t - 1 pushed by the receiver's program of tick t; `settle` before the state is
read), the default for such schedules (device_tick_step).

GPipe runs here too (make_device_gpipe): every micro-batch's forward dispatched up the stages, then
every backward down them (rematerialised), one update per stage after the flush: the single-device
step's numerics to float tolerance (separate programs may order sums differently).

The calls are the tick's (tick.make_tick), in its order: the forward wave up, the backward wave down,
then the links. The updates are one_device's, bit for bit on forced CPU devices
(tests/test_pipeline_devices.py; another platform may order floats differently in separate programs).
Nothing here blocks on a result: the loop (pipeline/train.py) reads the clock after
jax.block_until_ready(state), as for one_device.
"""

import jax
import jax.numpy as jnp

from ripples_jax.pipeline import gpipe, methods
from ripples_jax.pipeline.baselines import schedule_of
from ripples_jax.pipeline.tick import (
  BATCH,
  LABELS,
  NOW,
  Schedule,
  cotangent_source,
  input_source,
  push,
  stage_backward,
  stage_forward,
)


def stage_devices(num_stages: int, devices=None) -> list:
  """Device k for stage k: the first num_stages devices of this process (or of `devices`)."""
  devices = list(devices if devices is not None else jax.local_devices())
  if len(devices) < num_stages:
    raise ValueError(
      f"placement=devices needs a device per stage: num_stages={num_stages}, this process has "
      f"{len(devices)} ({devices[0].platform})"
    )
  return devices[:num_stages]


def place(state: list[dict], devices: list) -> list[dict]:
  """Stage k's state committed to device k (what every program of stage k then runs on)."""
  return [jax.device_put(st, d) for st, d in zip(state, devices)]


def _stage_programs(stage, optimizer, schedule: Schedule, k: int, num_batches: int, donate: bool = True):
  """Stage k's forward and backward as programs of their own. A FIFO's head is read inside the
  program (no separate dispatch): `x_in` / `cot` None means "the head of my incoming link's FIFO".
  The backward runs over the schedule's chunks (tick.stage_backward). `donate` False only to measure
  what donation saves (benchmarks/pipeline_devices.py)."""
  last = k == schedule.num_stages - 1

  def forward(st, x_in, t):
    if x_in is None:
      x_in = st["fwd_fifo"][0]
    return stage_forward(stage, schedule, k, st, x_in, t)

  def backward(st, cot, labels, t):
    if cot is None and not last:
      cot = st["bwd_fifo"][0]
    st, g_x, m = stage_backward(stage, optimizer, schedule, k, st, cot, labels, t, num_batches)
    # Stage 0's input gradient goes nowhere: not an output, so XLA never computes it.
    return st, (None if k == 0 else g_x), m

  # The stage's state is donated: its ring buffers are updated in place, not copied every tick.
  donated = (0,) if donate else ()
  return jax.jit(forward, donate_argnums=donated), jax.jit(backward, donate_argnums=donated)


def _fused_program(stage, optimizer, schedule: Schedule, k: int, num_batches: int, donate: bool):
  """Stage k's whole tick as one program, for schedules whose every link is delayed (DSP): first the
  arrivals of the previous tick pushed into the incoming FIFOs (what the unfused tick's link programs
  did at the end of that tick: the same concatenation, so the same bits), then the forward and the
  backward. `up` / `down` None: nothing pending (the first tick, or the links already settled)."""
  last = k == schedule.num_stages - 1

  def fused(st, up, down, x_in, labels, t):
    if up is not None:
      st = dict(st, fwd_fifo=push(st["fwd_fifo"], up))
    if down is not None:
      st = dict(st, bwd_fifo=push(st["bwd_fifo"], down))
    st, y = stage_forward(stage, schedule, k, st, st["fwd_fifo"][0] if x_in is None else x_in, t)
    cot = None if last else st["bwd_fifo"][0]
    st, g_x, m = stage_backward(stage, optimizer, schedule, k, st, cot, labels, t, num_batches)
    return st, y, (None if k == 0 else g_x), m  # stage 0's input gradient: never computed

  return jax.jit(fused, donate_argnums=(0,) if donate else ())


def fusable(schedule: Schedule) -> bool:
  """Whether a stage's tick can be one program: every link delayed, so no stage waits within a tick
  for another's output (under a locked link the receiver's forward needs this tick's output)."""
  return all(d >= 1 for d in schedule.fwd_delays + schedule.bwd_delays)


def dispatches_per_tick(schedule: Schedule, fused: bool = False) -> int:
  """What make_device_tick's tick dispatches: two programs per stage, the batch's and the labels'
  copies, a copy per locked link direction, a copy and a push program per delayed one."""
  links = list(schedule.fwd_delays) + list(schedule.bwd_delays)
  if fused:  # a program per stage (the batch and labels go in with their calls), a copy per link
    return schedule.num_stages + len(links)
  return 2 * schedule.num_stages + 2 + sum(2 if d else 1 for d in links)


def make_fused_device_tick(
  stages, optimizer, schedule: Schedule, num_batches: int, devices: list, donate: bool = True
):
  """make_device_tick for a fusable schedule (DSP) with one program per stage a tick: tick t's
  outputs are copied to their receivers' devices at once and pushed into the FIFOs by the receivers'
  programs of tick t + 1, so a tick dispatches K programs and 2(K - 1) copies. Between ticks the
  returned state's FIFOs lack the pending arrivals: `tick.settle(state)` pushes them (the training
  loop calls it before it reads the state: records, evaluations, checkpoints), after which the state
  is make_device_tick's, bit for bit."""
  K = len(stages)
  programs = [_fused_program(stages[k], optimizer, schedule, k, num_batches, donate) for k in range(K)]
  link = jax.jit(push, donate_argnums=0)
  to = lambda x, k: jax.device_put(x, devices[k])
  pending = {"up": [None] * K, "down": [None] * K}  # arrivals for stage k's next program

  def tick(state, x_t, y_t, t):
    state, ups, downs = list(state), pending["up"], pending["down"]
    outs, grads, metrics = [None] * K, [None] * K, None
    for k in range(K):  # no stage waits for another within the tick: any order runs them at once
      x_in = x_t if k == 0 else None
      labels = y_t if k == K - 1 else None  # host arrays: each program's call copies them to its device
      state[k], outs[k], grads[k], m = programs[k](state[k], ups[k], downs[k], x_in, labels, t)
      if k == K - 1:
        metrics = m
    pending["up"] = [None] + [to(outs[k - 1], k) for k in range(1, K)]
    pending["down"] = [to(grads[k + 1], k) for k in range(K - 1)] + [None]
    return state, metrics

  def settle(state):
    state = list(state)
    for k in range(K):
      if pending["up"][k] is not None:
        state[k] = dict(state[k], fwd_fifo=link(state[k]["fwd_fifo"], pending["up"][k]))
      if pending["down"][k] is not None:
        state[k] = dict(state[k], bwd_fifo=link(state[k]["bwd_fifo"], pending["down"][k]))
    pending["up"], pending["down"] = [None] * K, [None] * K
    return state

  tick.settle = settle
  return tick


def make_device_tick(
  stages, optimizer, schedule: Schedule, num_batches: int, devices: list, donate: bool = True
):
  """Returns tick(state, x_t, y_t, t) -> (state, (loss, acc)) with make_tick's meaning, stage k's
  programs on devices[k] (`state` placed by `place`). (loss, acc) live on the last stage's device."""
  K = len(stages)
  f, b = schedule.fwd_delays, schedule.bwd_delays
  programs = [_stage_programs(stages[k], optimizer, schedule, k, num_batches, donate) for k in range(K)]
  link = jax.jit(push, donate_argnums=0)  # one program; it runs where the receiving FIFO lives
  to = lambda x, k: jax.device_put(x, devices[k])

  def forward_wave(state, x_t, t):
    outs = [None] * K
    for k in range(K):
      src = input_source(schedule, k)
      # NOW: this tick's output of the stage below, copied over; FIFO: read inside the program.
      x_in = to(x_t, 0) if src == BATCH else to(outs[k - 1], k) if src == NOW else None
      state[k], outs[k] = programs[k][0](state[k], x_in, t)
    return outs

  def backward_wave(state, y_t, t):
    grads_in, metrics = [None] * K, None
    for k in reversed(range(K)):
      src = cotangent_source(schedule, k)
      cot = to(grads_in[k + 1], k) if src == NOW else None
      labels = to(y_t, k) if src == LABELS else None
      state[k], grads_in[k], m = programs[k][1](state[k], cot, labels, t)
      if k == K - 1:
        metrics = m
    return grads_in, metrics

  def tick(state, x_t, y_t, t):
    state = list(state)
    outs = forward_wave(state, x_t, t)
    grads_in, metrics = backward_wave(state, y_t, t)
    for k in range(K - 1):  # the links advance: each transfer lands in the receiver's FIFO
      if f[k]:
        state[k + 1] = dict(state[k + 1], fwd_fifo=link(state[k + 1]["fwd_fifo"], to(outs[k], k + 1)))
      if b[k]:
        state[k] = dict(state[k], bwd_fifo=link(state[k]["bwd_fifo"], to(grads_in[k + 1], k)))
    return state, metrics

  return tick


def gpipe_dispatches(num_stages: int, microbatches: int) -> int:
  """What make_device_gpipe's step dispatches: per micro-batch its copy in and its labels' copy, a
  forward and a copy up per stage below the last, the last stage's loss-and-backward and
  accumulation, then per stage below the last a copy down, a backward and an accumulation; then one
  update per stage."""
  K, M = num_stages, microbatches
  return M * (2 + 2 * (K - 1) + 2 + 3 * (K - 1)) + K


def make_device_gpipe(stages, optimizer, microbatches: int, devices: list):
  """GPipe with stage k on devices[k]: returns step(state, x, y, t) -> (state, (loss, acc)), the
  numerics of baselines.make_gpipe_step (BP on the whole batch, rematerialised stage boundaries).

  Every micro-batch's forward is dispatched up the stages, then every backward down them; the stages
  overlap wherever a program's inputs are ready (stage k's forward of micro-batch m beside stage k+1's
  of m-1), which is GPipe's pipeline, and the flush is the update after the last backward. The
  gradients are summed over the micro-batches in their order, as the single-device step sums them."""
  K, M = len(stages), microbatches
  progs = [gpipe.stage_programs(stages[k], optimizer, k == 0, k == K - 1, M) for k in range(K)]
  to = lambda x, k: jax.device_put(x, devices[k])

  def step(state, x, y, t):
    del t
    xs = jnp.split(jnp.asarray(x), M)
    ys = [to(a, K - 1) for a in jnp.split(jnp.asarray(y), M)]
    ms = [st["model_state"] for st in state]
    # The stage boundaries (rematerialisation keeps only these), the model state each forward saw
    # (its recompute sees the same), and the error gradient each micro-batch sends down from the top.
    inputs, used, cots = [[None] * K for _ in range(M)], [[None] * K for _ in range(M)], [None] * M
    grads, loss, acc = [None] * K, 0.0, 0.0
    last = progs[K - 1]
    for m in range(M):  # forwards up; the last stage's loss and backward as its micro-batch arrives
      h = to(xs[m], 0)
      for k in range(K - 1):
        inputs[m][k], used[m][k] = h, ms[k]
        h, ms[k] = progs[k]["forward"](state[k]["params"], ms[k], h)
        h = to(h, k + 1)
      g_p, cots[m], ms[K - 1], lm, am = last["backward"](state[K - 1]["params"], ms[K - 1], h, ys[m])
      grads[K - 1] = last["accumulate"](gpipe.zeros_like(g_p) if m == 0 else grads[K - 1], g_p)
      loss, acc = loss + lm / M, acc + am / M
    for m in range(M):  # backwards down, each stage's gradients summed in the micro-batches' order
      cot = cots[m]
      for k in reversed(range(K - 1)):
        g_p, cot = progs[k]["backward"](state[k]["params"], used[m][k], inputs[m][k], to(cot, k))
        grads[k] = progs[k]["accumulate"](gpipe.zeros_like(g_p) if m == 0 else grads[k], g_p)
    state = [progs[k]["update"](state[k], grads[k], ms[k]) for k in range(K)]  # the flush
    return state, (loss, acc)

  return step


def device_gpipe_step(stages, optimizer, config, num_batches):
  """baselines.METHODS' step_fn signature for gpipe on devices (train.py's setup)."""
  del num_batches
  return make_device_gpipe(stages, optimizer, config.microbatches, stage_devices(config.num_stages))


def device_tick_step(stages, optimizer, config, num_batches):
  """baselines.METHODS' step_fn signature for the tick methods on devices (train.py's setup)."""
  devices, schedule = stage_devices(config.num_stages), schedule_of(config)
  make = make_fused_device_tick if fusable(schedule) else make_device_tick
  return make(stages, optimizer, schedule, num_batches, devices)


# A record's step on devices (methods.Method.step_in("devices")): its step_fn, baselines.STEPS' signature.
STEPS = {methods.TICK: device_tick_step, "gpipe": device_gpipe_step}
