"""DSP on MNIST-1D: the CNN1D split into K stages, unit link delays, the recompute ring buffer.

  python -m experiments.train_dsp --config=configs/dsp.py --workdir=runs/dsp
  python -m experiments.train_dsp --config=configs/dsp.py:method=bp
  python -m experiments.train_dsp --config=configs/dsp.py:method=gpipe,num_stages=4
  python -m experiments.launch --num_processes=2 --module=experiments.train_dsp -- \
      --config=configs/dsp.py:mode=residuals --config.placement=per_process   # stage k in process k
  python -m experiments.train_dsp --config=configs/dsp.py --config.replicas.count=4   # 4 replicas, simulated
  python -m experiments.launch --num_processes=8 --module=experiments.train_dsp -- \
      --config=configs/dsp.py:num_stages=2 --config.placement=per_process --config.replicas.count=4 \
      --config.replicas.pad_s=0.05   # 4 x 2 stage processes and the coordinator

Expected (2-core CPU, ~15-25 s a run on MNIST-1D; measured, WORKSPACE.md sections 3 and 12):
- Accuracy at this config's lr 0.02, one seed (`python -m experiments.reproduce_dsp
  --out_dir=runs/reproduce_dsp`, section 3): DSP 91.1% (K=2) and 90.9% (K=4) against BP's 88.7% and
  89.4%; at this small fixed step size staleness acts as a regulariser. At each method's step size
  chosen on validation from one shared grid (0.01-0.3), 3 seeds (`python -m experiments.dsp_accuracy
  --workers=2`, section 20): BP 94.8% at lr 0.2 (K=2); DSP 93.0% at lr 0.05 (K=2) and 89.6% at 0.02
  (K=4), 1.8 and 5.7 points behind BP.
- Speed, measured wall clock with every stage in its own process, against the fastest of four
  single-process BP variants in the same run (`python -m benchmarks.pipeline --num_stages=2
  --json_out=results/pipeline/k2.json`, section 18; CNN2D on CIFAR-shaped synthetic data, batch 64):
  DSP as published 0.65x, GPipe 0.76x, weight stashing on DSP's schedule with 4-chunk calls 0.84x;
  two single-core stages could reach 1.42x here. On this config's CNN1D (`--model=cnn1d
  --input_shape=40,1`, section 20) a BP step takes ~1 ms and every pipeline is slower still. The
  timing model's speedups (`modeled_time`, results/dsp/table.md) are modeled, not measured.
Variants (`:k=v,...`): method, num_stages, mode, delay, dataset, model, epochs.
"""

import ml_collections

from ripples_jax.config import parse_arg


def get_config(arg=None):
  arg = parse_arg(
    arg,
    method="dsp",
    num_stages=2,
    mode="recompute",
    delay=1,
    dataset="mnist1d",
    model="cnn1d",
    epochs=120,
    microbatches=4,
  )
  c = ml_collections.ConfigDict()
  c.method = arg.method  # a pipeline method: its record in ripples_jax/pipeline/methods.py says what it is
  c.num_stages = arg.num_stages  # K
  c.mode = arg.mode  # recompute (DSP) | stash (the version the forward used); per_process
  # also: fused (one forward call over the new and the replayed batch),
  # residuals (the forward's vjp residuals kept: no recompute; stash's numerics)
  c.delay = arg.delay  # d_k of every link (DSP); 0 makes DSP equal BP
  c.microbatches = arg.microbatches  # GPipe's, 1F1B's and ZB-H1's M
  c.chunks = 1  # every tick method's backward (recompute, stash, PipeMare's, residual calls;
  # model-parallel bp per_process) over this many chunks of the batch in turn; same numerics up to
  # float order, faster per example on a CPU (cache); not with a model state (BatchNorm)
  c.split = "measured"  # measured: stages balance each layer's measured forward + backward time
  # (profiled once per machine, cached; a run's split is pinned in WORKDIR/split.json) | macs
  c.placement = "one_device"  # one_device (one process, one jitted tick) | devices (stage k on
  # device k of this process: the tick methods) | per_process (stage k in process k:
  # experiments.launch --module=experiments.train_dsp) | spmd (the whole pipeline as one jitted
  # program over a stage axis of this process's devices: pipeline/program.py)
  c.spmd_ticks = 32  # placement=spmd: ticks (flush methods: steps) a dispatch runs, one lax.scan
  c.seed = 0  # parameters and data order

  c.dataset = arg.dataset  # mnist1d | digits | cifar10 | synthetic
  c.data_dir = ""  # cifar10: the local batches; mnist1d: cache dir ("" = default)
  c.model = arg.model  # mlp | cnn1d | cnn2d | resnet20 | resnet56 | rescnn, split into num_stages
  c.validation_examples = 0  # training examples held out for validation (0: none), a fixed
  # permutation (seed 0, the same for every run seed); placement=one_device records val_accuracy
  # beside test_accuracy, so a step size is chosen on validation, reported on test (dsp_accuracy)
  c.batch_size = 64  # per pipeline step
  # dataset=synthetic (benchmarks): Gaussian classes of this shape, e.g. CIFAR-shaped (32, 32, 3).
  c.synthetic = ml_collections.ConfigDict()
  c.synthetic.input_shape = (16,)  # dataset=synthetic: one example's shape
  c.synthetic.num_classes = 4  # dataset=synthetic: classes
  c.synthetic.num_train = 512  # dataset=synthetic: training examples
  c.synthetic.num_test = 128  # dataset=synthetic: test examples

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "momentum"  # sgd | momentum | nesterov | adam | adamw
  c.optimizer.lr = 0.02  # the staleness bound grows with step size: 0.05 diverges at K=4
  c.optimizer.momentum = 0.9  # momentum and nesterov
  c.optimizer.weight_decay = 5e-4  # L2, added to the gradient; adamw: decoupled, lr x it x params
  c.optimizer.lr_schedule = "cosine"  # constant | cosine
  c.optimizer.warmup_steps = 50  # linear warm-up from 0
  # PipeMare (method=pipemare): stage k's step size divided by its delay S_k at first, the division
  # annealed away over lr_anneal updates; its backward's weights w - S_k delta (the forward's
  # activations), delta the updates' moving average with decay ema_decay^(1/S_k) (the paper's two
  # techniques; these values are ours, not tuned)
  c.pipemare = ml_collections.ConfigDict()
  c.pipemare.lr_anneal = 500  # updates (0: no rescheduling)
  c.pipemare.ema_decay = 0.9  # D in [0, 1): stage k's decay gamma_k = D^(1/S_k)
  c.dni_lr = 0.01  # DNI: the synthetic-gradient predictors' step size (plain SGD)

  # The straggler experiment of the timing model: stage `straggler_stage` slowed by `slowdown`
  # (or every stage with probability `straggler_p` per iteration).
  c.straggler_stage = -1
  c.slowdown = 1.0  # the straggler stage's step takes this many times longer
  c.straggler_p = 0.0  # or: every stage slowed with this probability per iteration

  # placement=per_process: the watchdog (a dead stage is named), core pinning, fault injection.
  c.runtime = ml_collections.ConfigDict()
  c.runtime.pin_cores = True  # stage k on core k mod the cores this process may use
  # per_process: links with slack (each link's transfers on a thread of their own: a stage waits only
  # for the transfer a tick reads; link delay d lets it run d - 1 ticks ahead); False: every transfer
  # waited for at once, the lockstep of earlier versions (for comparison)
  c.runtime.slack = True
  c.runtime.heartbeat_s = 1.0  # per_process: seconds between a stage's heartbeats
  c.runtime.heartbeat_timeout = 15.0  # per_process: no heartbeat from a stage for this long: it is lost
  c.runtime.stall_timeout = 60.0  # per_process: no stage completes a tick for this long: the run is stuck
  c.runtime.fail_stage = -1  # fault injection: this stage SIGKILLs itself (-1: none) before tick
  # fail_tick, once its newest checkpoint has committed
  c.runtime.fail_tick = 0  # fault injection: the tick before which fail_stage dies

  # Ripples across pipelines (ripples_jax/hybrid, docs/design.md 4.7): R replicas of this pipeline,
  # each stage's replicas averaging their stage in groups after every sync_every-th tick; simulated
  # with placement=one_device (virtual time, exact numerics), on R x K devices of this process with
  # placement=devices (threads, the wall clock), a process per (replica, stage) with
  # placement=per_process (hybrid/processes.py; replica 0's stage runtime.fail_stage is the one fault
  # injection kills). count 0: the pipeline alone.
  c.replicas = ml_collections.ConfigDict()
  c.replicas.count = 0  # R (0: no replicas; 1: the hybrid executor on one replica, the pipeline's numerics)
  c.replicas.algorithm = "ripples_smart"  # every algorithm with groups (algorithms.hybrid_names), as
  # the simulator runs it over R workers; allreduce: each stage all-reduced across the replicas after every
  # tick, as data-parallel pipelines do; none: no averaging
  c.replicas.group_size = 3  # ripples_smart, ripples_random: members of a group
  c.replicas.smart_tolerance = 0.5  # ripples_smart: as schedule.smart_tolerance (configs/default.py)
  c.replicas.smart_max_gap = 4  # ripples_smart: syncs a replica may skip in a row
  c.replicas.smart_fresh = False  # ripples_smart: as schedule.smart_fresh (configs/default.py)
  c.replicas.workers_per_node = 4  # ripples_static: the node layout's replicas per node
  c.replicas.grid = ()  # moshpit: the replicas' grid; () the squarest (schedule.static.default_grid)
  c.replicas.window = 0.0  # moshpit: as moshpit.window (configs/default.py; 0: lockstep rounds)
  c.replicas.window_max_gap = 4  # moshpit with a window: as moshpit.max_gap
  c.replicas.sync_every = 1  # ticks between a replica's averages
  c.replicas.slow = ()  # (replica, stage) of the slow device; () none
  c.replicas.slowdown = 1.0  # the slow device's forward + backward take this many times longer
  c.replicas.rotate_every = 0.0  # virtual seconds after which the slow device moves to the next replica
  c.replicas.jitter = 0.05  # sigma of a lognormal factor on every device's tick (real ticks differ)
  c.replicas.stage_s = ()  # seconds of each stage's forward + backward per tick; () measured here
  c.replicas.stage_bytes = ()  # bytes of each stage's parameters for the averages' cost; () the model's
  c.replicas.alpha = 5e-6  # seconds per message of an average
  c.replicas.bandwidth = 1.25e9  # bytes/s of each device's link
  c.replicas.avg_s = 0.0  # > 0: a group's averages take this many seconds (measured), not the ring model
  c.replicas.target_accuracy = 0.0  # time_to_target: the first evaluation at or above it (0: none)
  c.replicas.pad_s = 0.0  # placement=devices, per_process: each tick padded to this many wall seconds
  # (the slow device: slowdown x it), so a run on few cores measures the protocol, not the cores

  c.num_epochs = arg.epochs  # passes over the training set
  c.log_every = 50  # batches
  c.eval_every = 500  # batches between evaluations
  c.checkpoint_every = 2000  # batches between orbax checkpoints (0: none); a rerun resumes
  c.checkpoint_keep = 2  # checkpoints kept
  c.on_config_change = "refuse"  # a rerun whose workdir holds another config: refuse | new | force
  return c
