"""The main job: Ripples with the Static GG layout on MNIST-1D, 1D CNN, 8 workers, lockstep SPMD.

  python -m experiments.train --config=configs/default.py --workdir=runs/default
  python -m experiments.train --config=configs/default.py:algorithm=allreduce
  python -m experiments.launch --num_processes=4 -- \
      --config=configs/default.py:executor=async,num_workers=4,algorithm=ripples_smart,model=mlp

Expected (2-core CPU, 8 forced devices): about 90% test accuracy of the averaged model, under 3 minutes;
All-Reduce with the same config within 1 point (WORKSPACE.md has the measured numbers).
Variants (`:k=v,...`): algorithm, executor, num_workers, dataset, model, layout, steps.
A rerun with the same --workdir resumes from the newest checkpoint (every `checkpoint_every` steps).
"""

import ml_collections

from ripples_jax.config import parse_arg
from ripples_jax.schedule import default_grid


def get_config(arg=None):
  arg = parse_arg(
    arg,
    algorithm="ripples_static",
    executor="spmd",
    num_workers=8,
    dataset="mnist1d",
    model="cnn1d",
    layout="node",
    steps=4000,
  )
  c = ml_collections.ConfigDict()
  # the algorithm registry's names (ripples_jax/algorithms.py; which executor runs each: "Allowed")
  c.algorithm = arg.algorithm
  c.executor = arg.executor  # spmd: lockstep on the device mesh | sim: event-driven, virtual time
  # | async: one process per worker (experiments.launch, --jax_distributed)
  c.num_workers = arg.num_workers  # data-parallel workers (async: one process each)
  c.seed = 0  # parameters, data order and the simulated clock

  c.dataset = arg.dataset  # mnist1d | digits | cifar10 | synthetic
  c.data_dir = ""  # cifar10: the local batches; mnist1d: cache dir ("" = default)
  # mnist1d: examples its generator makes (80% train, 20% test; 5000 is the standard set). Any number
  # comes from the same seed, cached after the first generation: 512000 gives 4096 workers 100 each.
  c.mnist1d_samples = 5000
  c.data_sharding = "iid"  # iid | noniid (label-skewed)
  c.validation_examples = (
    0  # sim: training examples held out (the same for every seed); records carry val_accuracy too
  )
  c.model = arg.model  # mlp | cnn1d | cnn2d | resnet20 | resnet56 | rescnn
  c.batch_size = 32  # per worker

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "momentum"  # sgd | momentum | nesterov | adam | adamw (DiLoCo's inner, as published)
  c.optimizer.lr = 0.1  # peak step size (after warm-up)
  c.optimizer.momentum = 0.9  # momentum and nesterov
  c.optimizer.weight_decay = 5e-4  # L2, added to the gradient; adamw: decoupled, lr x it x params
  c.optimizer.b1 = 0.9  # adam and adamw: the first moment's decay
  c.optimizer.b2 = 0.999  # adam and adamw: the second moment's decay
  c.optimizer.eps = 1e-8  # adam and adamw: added to the second moment's root
  c.optimizer.lr_schedule = "cosine"  # constant | cosine
  c.optimizer.warmup_steps = 50  # linear warm-up from 0
  c.optimizer.schedule_steps = 0  # the schedule's horizon in steps (0: num_steps)

  c.schedule = ml_collections.ConfigDict()
  c.schedule.layout = arg.layout  # node (the authors' Static GG) | hypercube
  c.schedule.workers_per_node = 4  # Static GG, layout=node: workers per node (intra-node groups)
  c.schedule.hypercube_group_size = 2  # Static GG, layout=hypercube: group size (num_workers a power of it)
  c.schedule.group_size = min(3, arg.num_workers)  # Random GG, Group Division, Smart GG
  c.schedule.smart_tolerance = 0.5  # Smart GG: sync with workers ready within this x own step time
  c.schedule.smart_max_gap = 4  # Smart GG: at most this many skipped syncs in a row
  c.schedule.smart_fresh = False  # Smart GG: rank its last group's members after the others ready in time
  c.schedule.request_ahead = True  # online GG: request the next group when a step starts (Random,
  # Division), or one measured round trip before it ends (Smart GG, in the runtime)
  c.diloco = ml_collections.ConfigDict()  # algorithm=diloco (Douillard et al., 2023; executor=sim)
  c.diloco.inner_steps = 16  # H: local steps (the run's optimizer, per worker) between outer steps
  c.diloco.outer_lr = 0.7  # the outer step size on the pseudo-gradient
  c.diloco.outer_momentum = 0.9  # the outer Nesterov momentum (0: plain outer SGD)
  c.moshpit = ml_collections.ConfigDict()  # algorithm=moshpit (Ryabinin et al., 2021; sim and async)
  c.moshpit.grid = default_grid(arg.num_workers)  # the virtual grid, its product num_workers: round r
  # averages within the workers that share every coordinate but the (r mod d)-th; one local step between
  # rounds; (4, 4) for 16 workers, (2, 4) for 8
  c.moshpit.window = 0.0  # seconds (hivemind's averaging_expiration): > 0, a worker's group is its line's
  # workers ready within this of it, the others not waited for (group_gen.moshpit_window_gg); 0: lockstep
  c.moshpit.max_gap = 4  # with a window: at most this many requests in a row without a group
  c.ps = ml_collections.ConfigDict()  # algorithm=ps_async: the server's step (docs/design.md 3.4)
  c.ps.staleness = "none"  # none | divide: each gradient at lr / its staleness, the server's updates
  # from the pull it was computed on to its own (Zhang et al., 2016); SGD optimizers only
  c.ps.server_momentum = 0.9  # the server optimizer's momentum (optimizer.name momentum or nesterov;
  # ps_async's workers take no optimizer step, so optimizer.momentum is unused there)
  c.preduce_impl = "auto"  # auto | collective (one worker per device) | segment

  # executor=sim and async: heterogeneity and the clock (docs/design.md 3.5, 3.1; async plans with the clock).
  c.hetero = ml_collections.ConfigDict()
  c.hetero.slow_workers = ()  # worker ids, e.g. --config.hetero.slow_workers='(3,)'
  c.hetero.slowdown = 1.0  # a slow step takes this many times the base step
  c.hetero.random_p = 0.0  # or: every worker slowed with this probability per step
  c.hetero.jitter = 0.0  # lognormal sigma of every step time
  c.hetero.rotate_every = 0.0  # seconds: the slow worker moves to the next id this often (0: stays)
  c.hetero.leave = ()  # executor=sim: (worker, t_leave, t_rejoin) triples in virtual seconds, e.g.
  # '((3, 0.5, 1.2),)': the worker leaves at t_leave and rejoins at t_rejoin (-1: never) from its first
  # group's mean, with fresh optimizer state (docs/design.md 3.10)
  c.timeline = ml_collections.ConfigDict()
  c.timeline.compute_time = 0.01  # virtual seconds per base step (0: measure the real jitted step)
  c.timeline.alpha = 5e-6  # per-message latency, s
  c.timeline.bandwidth = 1.25e9  # bytes/s per link (10 Gb/s)
  c.timeline.ps_bandwidth = 1.25e9  # the parameter server's link
  c.timeline.overlap = (
    0.0  # share of a base step its transfers may overlap (timeline.Network.hidden), for every algorithm
  )
  c.timeline.model_bytes = 0.0  # 0: the model's real float32 bytes
  c.timeline.request_rtt = 0.0  # seconds a request to the Group Generator takes to be answered
  c.timeline.authority_service = 0.0  # seconds of the authority's work per request (one FIFO server)
  c.timeline.group_setup = 0.0  # seconds a group pays the first time it meets a member set / pair
  c.timeline.setup_unit = "group"  # group (runtime.preduce=group) | pair (runtime.preduce=pairs)
  c.timeline.detect_s = 0.0  # hetero.leave: seconds from a death to its removal (the runtime's
  # heartbeat timeout; 0: at once); in between its groups fail after their live members' exchanges
  c.timeline.adpsgd_serial = (
    True  # AD-PSGD (timeline.AdpsgdCost): a passive worker serves one average at a time
  )
  c.timeline.adpsgd_fixed_cost = 0.0  # AD-PSGD: seconds added to every average
  c.timeline.adpsgd_passive_blocks = False  # AD-PSGD: the passive worker's compute pauses while it serves
  c.timeline.adpsgd_hidden = 1.0  # AD-PSGD: the share of an active worker's average its compute hides
  # (1: Lian et al.'s order, the average beside the compute; 0: the average, then the compute)
  c.time_budget = 0.0  # virtual seconds; 0: run num_steps x num_workers worker steps
  c.target_accuracy = 0.0  # summary.json reports time_to_target when set
  c.stop_at_target = False  # executor=sim: end the run at the first evaluation that reaches it

  # executor=async only: the multi-process runtime (ripples_jax/runtime).
  c.runtime = ml_collections.ConfigDict()
  c.runtime.step_time = 0.0  # pad every real step to at least this many seconds (0: no padding)
  c.runtime.warmup_steps = 3  # timed steps before the run: the first step-time estimate
  c.runtime.adpsgd_passive = "concurrent"  # AD-PSGD's passive side: concurrent (a communication
  # thread, as published) | blocking (between its own steps)
  c.runtime.heartbeat_s = 1.0  # seconds between a worker's heartbeats
  c.runtime.heartbeat_timeout = 15.0  # no heartbeat from a worker for this long: it is lost
  c.runtime.stall_timeout = 40.0  # no worker completes anything for this long: the run is stuck
  c.runtime.checkpoint_every = 80  # a checkpoint marker every this many steps per worker (0: none)
  c.runtime.checkpoint_keep = 3  # markers kept per worker
  c.runtime.preduce = "auto"  # P-Reduce: group (one collective per member set, cached) | pairs
  # (pairwise exchanges: at most num_workers - 1 programs) | auto (pairs when the generator's member sets
  # per worker exceed cache_size)
  c.runtime.cache_size = 64  # compiled P-Reduce programs kept with preduce=group (one per member set)
  c.runtime.fail_worker = -1  # fault injection: this worker SIGKILLs itself (-1: none) before its local
  # step fail_step, once its newest checkpoint has committed
  c.runtime.fail_step = 0  # fault injection: the local step before which fail_worker dies
  c.runtime.fail_where = "step"  # step (before that local step) | preduce (inside the P-Reduce after
  # it, after its first exchange; runtime.elastic) | slow (no death: after that first exchange the worker
  # sleeps the collective timeout + 1 s, heartbeating, so its next partner's exchange times out against
  # a live worker; runtime.elastic, the authority's groups)
  c.runtime.elastic = False  # Random GG, Group Division, Smart GG, AD-PSGD: a worker that dies or
  # stalls is removed and the others go on; a restarted one (experiments.launch --max_restarts)
  # rejoins (docs/design.md 3.12)
  c.runtime.consensus_allreduce = False  # gossip and group methods (their deployable model is built):
  # after the last step every worker times one All-Reduce of its model over all workers, warm (its
  # program compiled and connected first), the charge summary.json's consensus_time pays; not elastic

  c.num_steps = arg.steps  # steps per worker
  c.log_every = 50  # steps between log records (metrics.jsonl, TensorBoard)
  c.eval_every = 500  # steps between evaluations of the averaged model
  # sim: evaluations also take each worker's own model's accuracy (worker_test_accuracy: one forward
  # pass per worker, most of an evaluation's cost); False: the averaged model's alone
  c.eval_workers = True
  c.checkpoint_every = 1000  # steps between orbax checkpoints (0: none); a rerun resumes
  c.checkpoint_keep = 2  # checkpoints kept
  c.stuck_timeout_s = 30.0  # spmd: a round whose collective has not completed after this many seconds
  # ends the run with one line and exit 75 (resume from the last checkpoint); under XLA's 40 s abort; 0: off
  c.profile_steps = ""  # "a:b": a jax.profiler trace of steps [a, b) in WORKDIR/profile (spmd)
  c.on_config_change = "refuse"  # a rerun whose workdir holds another config: refuse | new | force
  return c
