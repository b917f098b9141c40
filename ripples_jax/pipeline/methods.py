"""The pipeline methods: one record each, the one place a method is registered.

Everything that used to keep its own list or compare a method's name reads these records: the validator
(which placements run it, its allowed-values messages), docs/config.md, the tick's link schedule
(tick.method_schedule), the table of steps (baselines.METHODS, devices.STEPS), the timing model
(timing.py's shapes and backward work), the split's balance (inputs.recomputes) and the studies'
labels.

Adding a method on DSP's tick: a record with step=TICK, its link delays and ring mode; nothing else. A
whole-model step: its (init, step) in baselines.STEPS under the record's `step`, and on devices in
devices.STEPS.

Invariants (tests/test_pipeline_methods.py): names are unique; a record has link delays and a ring
exactly where it runs as the tick somewhere; every ring is one of the tick's modes; every iteration
shape and backward is one timing.py models. This module imports nothing of the project: everything in
the pipeline package (and the validator below it) may read it.
"""

import dataclasses

# one_device: every stage in this process, one jitted tick; devices: stage k on device k of this process
# (pipeline/devices.py); per_process: stage k in process k (pipeline/per_process.py, under the launcher);
# spmd: the whole pipeline as one jitted program over a stage axis of this process's devices
# (pipeline/program.py).
PLACEMENTS = ("one_device", "devices", "per_process", "spmd")
# A record's step: TICK runs a link schedule on DSP's tick (tick.make_tick, and per stage on devices and
# in processes); any other is a whole-model step of its own, named in baselines.STEPS.
TICK = "tick"
# A link delay of DELAY is config.delay (DSP's d); an int is fixed.
DELAY = "delay"
# The ring modes whose backward runs the stage's forward again (recompute; stash at the stashed
# weights; fused: as a part of the fused call). residuals and corrected keep what the forward made.
RECOMPUTING = ("recompute", "stash", "fused")
# How a method's stages overlap in the timing model (timing.iteration_time, simulate):
SEQUENTIAL = "sequential"  # one batch through the stages in turn, nothing overlaps: sum_k (F_k + B_k)
FLUSH = "flush"  # M micro-batches up, then down, then a flush (timing.gpipe_iteration)
# A flush whose stages run flush.py's op order: 1F1B, ZB-H1 (timing.scheduled_iteration).
SCHEDULED = "scheduled"
GLOBAL_STEP = "global_step"  # a locked forward, then every stage's backward at once: sum F + max work
ONE_F_ONE_B = "1f1b"  # stage k: the forward of batch t, then the backward of batch t-(K-1-k)
UNLOCKED = "unlocked"  # forward, backward and update locks broken: every stage busy every tick
# The work of a decoupled backward (timing.backward_work): the stored graph or activations (B), the
# forward again first (F + B; on an UNLOCKED tick also the new batch's forward unless fused), or the
# backward from a synthetic gradient plus the predictor's own step (B + P).
KEPT, RECOMPUTE, SYNTHETIC = "kept", "recompute", "synthetic"


@dataclasses.dataclass(frozen=True)
class Method:
  """One pipeline method. A record with `delays` runs as the tick where `runs_tick`, with schedule
  tick.method_schedule(name, ...): link k carries activations up `delays[0]` ticks late and error
  gradients down `delays[1]` ticks late (its staleness), its ring buffers in `ring` mode."""

  name: str
  label: str  # the tables' name
  step: str  # TICK, or its whole-model step (baselines.STEPS)
  iteration: str  # its shape in the timing model as published: SEQUENTIAL, FLUSH, ... (above)
  backward: str | None = None  # its decoupled backward's work (above); None: no decoupled backward
  placements: tuple = PLACEMENTS  # where it runs
  ticks_in: tuple = ()  # placements where a whole-model method runs as the tick (bp per_process)
  delays: tuple | None = None  # the tick's (forward, backward) link delays, an int or DELAY each
  ring: str | None = None  # the tick's ring mode: recompute, stash or corrected (pipeline/tick.py)
  config_mode: bool = False  # config.mode picks its ring (else `ring`, or `process_ring` per_process)
  process_ring: str | None = None  # per_process's ring where it is not `ring`: residuals (no recompute)
  remat: bool = False  # its whole-model step runs each stage's forward again in the backward

  def runs_tick(self, placement: str) -> bool:
    """Whether it runs as the tick (a link schedule) in `placement`."""
    return self.step == TICK or placement in self.ticks_in

  def step_in(self, placement: str) -> str:
    """TICK where it runs as the tick, else its whole-model step."""
    return TICK if self.runs_tick(placement) else self.step

  @property
  def runtime(self) -> str | None:
    """Its shape in the per-process runtime (timing.runtime_iteration), None where it does not run
    there: the runtime has no global step, so a locked forward with one-tick backward links is 1F1B."""
    if "per_process" not in self.placements:
      return None
    return ONE_F_ONE_B if self.iteration == GLOBAL_STEP else self.iteration

  @property
  def microbatched(self) -> bool:
    """Its step runs config.microbatches micro-batches of the batch (a flush)."""
    return self.iteration in (FLUSH, SCHEDULED)


_ONE_TICK_BACK = (0, 1)  # a locked forward, error gradients one tick late

REGISTRY = (
  Method(
    "bp",
    "BP",
    "bp",
    SEQUENTIAL,
    placements=("one_device", "per_process"),
    ticks_in=("per_process",),  # model-parallel BP: the tick with zero delays
    delays=(0, 0),
    ring="recompute",
    process_ring="residuals",
  ),
  Method("gpipe", "GPipe", "gpipe", FLUSH, remat=True),
  # Synchronous flush pipelines with stored activations: BP on the whole batch in one process (step
  # "flush"), flush.py's op orders in the program.
  Method("1f1b", "1F1B", "flush", SCHEDULED, placements=("one_device", "spmd")),
  Method("zbh1", "ZB-H1", "flush", SCHEDULED, placements=("one_device", "spmd")),
  Method(
    "ddg", "DDG", TICK, GLOBAL_STEP, KEPT, delays=_ONE_TICK_BACK, ring="stash", process_ring="residuals"
  ),
  Method(
    "pipedream",
    "PipeDream-1F1B",
    TICK,
    ONE_F_ONE_B,
    KEPT,
    delays=_ONE_TICK_BACK,
    ring="stash",
    process_ring="residuals",
  ),
  Method("pipemare", "PipeMare", TICK, ONE_F_ONE_B, KEPT, delays=_ONE_TICK_BACK, ring="corrected"),
  Method("fr", "Features Replay", TICK, GLOBAL_STEP, RECOMPUTE, delays=_ONE_TICK_BACK, ring="recompute"),
  Method("dni", "DNI", "dni", GLOBAL_STEP, SYNTHETIC, placements=("one_device",)),
  Method("dsp", "DSP", TICK, UNLOCKED, RECOMPUTE, delays=(DELAY, DELAY), ring="recompute", config_mode=True),
)
BY_NAME = {m.name: m for m in REGISTRY}


def get(name: str) -> Method:
  """The record of `name` (KeyError names the allowed ones; the validator refuses unknown names first)."""
  if name not in BY_NAME:
    raise KeyError(f"method {name!r} is not registered: one of {', '.join(BY_NAME)}")
  return BY_NAME[name]


def names(placement: str | None = None, **capabilities) -> tuple:
  """The registered names in registry order, those that run in `placement`, and those whose fields or
  properties equal `capabilities` (e.g. names(step=TICK), names("per_process"))."""
  return tuple(
    m.name
    for m in REGISTRY
    if (placement is None or placement in m.placements)
    and all(getattr(m, k) == v for k, v in capabilities.items())
  )


def ring(method: str, placement: str, mode: str) -> str | None:
  """The ring mode `method` runs with in `placement` under config.mode `mode`; None where it is not a
  tick there."""
  m = get(method)
  if not m.runs_tick(placement):
    return None
  if m.config_mode:
    return mode
  return (m.process_ring or m.ring) if placement == "per_process" else m.ring


def recomputes(method: str, placement: str, mode: str) -> bool:
  """Whether a stage below the last runs its forward again in its backward: a recomputing ring, or a
  rematerialising whole-model step."""
  r = ring(method, placement, mode)
  return get(method).remat if r is None else r in RECOMPUTING
