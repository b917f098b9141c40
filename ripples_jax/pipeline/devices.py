"""placement=devices: the pipeline's stages on the devices of this one process (docs/design.md 4.6).

How JAX users pipeline on one host (the GPUs of a node, the TPU chips of a host, forced CPU devices
here): stage k's state (parameters, optimizer state, ring buffers, the FIFOs of its incoming links)
lives on device k. Each tick dispatches, per stage, a forward program and a backward program on that
stage's device, and the links are device-to-device copies (jax.device_put) into the receiving stage's
FIFO. Dispatch is asynchronous and a program waits only for its own inputs, so the stages of one tick
run at once wherever the schedule makes them independent: under DSP's delays every stage reads its
inputs from its FIFOs (filled by earlier ticks); under a locked forward (ddg, pipedream, pipemare, fr) a
stage's forward waits for the stage below it, as the tick says, while that stage runs its backward.
A link of delay d hands tick t's output to tick t + d, so a transfer has d - 1 ticks of slack.

The calls are the tick's (tick.make_tick), in its order: the forward wave up, the backward wave down,
then the links. The updates are one_device's, bit for bit on forced CPU devices
(tests/test_pipeline_devices.py; another platform may order floats differently in separate programs).
Nothing here blocks on a result: the loop (pipeline/train.py) reads the clock after
jax.block_until_ready(state), as for one_device.
"""

import jax

from ripples_jax.pipeline.baselines import schedule_of
from ripples_jax.pipeline.tick import Schedule, push, stage_backward, stage_forward


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


def _stage_programs(
  stage, optimizer, schedule: Schedule, k: int, num_batches: int, chunks: int = 1, donate: bool = True
):
  """Stage k's forward and backward as programs of their own. A FIFO's head is read inside the
  program (no separate dispatch): `x_in` / `cot` None means "the head of my incoming link's FIFO".
  `chunks`: the backward over that many equal chunks of the batch (tick.stage_backward). `donate`
  False only to measure what donation saves (benchmarks/pipeline_devices.py)."""
  last = k == schedule.num_stages - 1

  def forward(st, x_in, t):
    if x_in is None:
      x_in = st["fwd_fifo"][0]
    return stage_forward(stage, schedule, k, st, x_in, t)

  def backward(st, cot, labels, t):
    if cot is None and not last:
      cot = st["bwd_fifo"][0]
    return stage_backward(stage, optimizer, schedule, k, st, cot, labels, t, num_batches, chunks)

  # The stage's state is donated: its ring buffers are updated in place, not copied every tick.
  donated = (0,) if donate else ()
  return jax.jit(forward, donate_argnums=donated), jax.jit(backward, donate_argnums=donated)


def dispatches_per_tick(schedule: Schedule) -> int:
  """What make_device_tick's tick dispatches: two programs per stage, the batch's and the labels'
  copies, a copy per locked link direction, a copy and a push program per delayed one."""
  links = list(schedule.fwd_delays) + list(schedule.bwd_delays)
  return 2 * schedule.num_stages + 2 + sum(2 if d else 1 for d in links)


def make_device_tick(
  stages, optimizer, schedule: Schedule, num_batches: int, devices: list, chunks: int = 1, donate: bool = True
):
  """Returns tick(state, x_t, y_t, t) -> (state, (loss, acc)) with make_tick's meaning, stage k's
  programs on devices[k] (`state` placed by `place`). (loss, acc) live on the last stage's device."""
  K = len(stages)
  f, b = schedule.fwd_delays, schedule.bwd_delays
  programs = [
    _stage_programs(stages[k], optimizer, schedule, k, num_batches, chunks, donate) for k in range(K)
  ]
  link = jax.jit(push, donate_argnums=0)  # one program; it runs where the receiving FIFO lives
  to = lambda x, k: jax.device_put(x, devices[k])

  def forward_wave(state, x_t, t):
    outs = [None] * K
    for k in range(K):
      if k == 0:
        x_in = to(x_t, 0)
      elif f[k - 1] == 0:
        x_in = to(outs[k - 1], k)  # locked forward: this tick's output of the stage below
      else:
        x_in = None  # the FIFO's head: the output of tick t - f
      state[k], outs[k] = programs[k][0](state[k], x_in, t)
    return outs

  def backward_wave(state, y_t, t):
    grads_in, metrics = [None] * K, None
    for k in reversed(range(K)):
      cot = to(grads_in[k + 1], k) if k < K - 1 and b[k] == 0 else None
      labels = to(y_t, k) if k == K - 1 else None
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


def device_tick_step(stages, optimizer, config, num_batches):
  """baselines.METHODS' step_fn signature for the tick methods on devices (train.py's setup)."""
  devices = stage_devices(config.num_stages)
  return make_device_tick(stages, optimizer, schedule_of(config), num_batches, devices, config.chunks)
