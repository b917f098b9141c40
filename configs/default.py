"""The main job: Ripples with the Static GG layout on MNIST-1D, 1D CNN, 8 workers, lockstep SPMD.

  python -m experiments.train --config=configs/default.py --workdir=runs/default
  python -m experiments.train --config=configs/default.py:algorithm=allreduce

Expected (2-core CPU, 8 forced devices): about 90% test accuracy of the averaged model, under 3 minutes;
All-Reduce with the same config within 1 point (WORKSPACE.md has the measured numbers).
Variants (`:k=v,...`): algorithm, num_workers, dataset, model, layout, steps.
"""
from ripples_jax.config_util import parse_arg
import ml_collections


def get_config(arg=None):
  arg = parse_arg(arg, algorithm="ripples_static", num_workers=8, dataset="mnist1d", model="cnn1d",
                  layout="node", steps=4000)
  c = ml_collections.ConfigDict()
  c.algorithm = arg.algorithm      # allreduce | ripples_static
  c.executor = "spmd"              # lockstep on the device mesh
  c.num_workers = arg.num_workers
  c.seed = 0

  c.dataset = arg.dataset          # mnist1d | digits | cifar10 | synthetic
  c.data_dir = ""                  # cifar10: the local batches; mnist1d: cache dir ("" = default)
  c.data_sharding = "iid"          # iid | noniid (label-skewed)
  c.model = arg.model              # mlp | cnn1d | cnn2d | resnet20 | resnet56
  c.batch_size = 32                # per worker

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "momentum"    # sgd | momentum | nesterov | adam
  c.optimizer.lr = 0.1
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4
  c.optimizer.lr_schedule = "cosine"  # constant | cosine
  c.optimizer.warmup_steps = 50

  c.schedule = ml_collections.ConfigDict()
  c.schedule.layout = arg.layout   # node (the authors' Static GG) | hypercube
  c.schedule.workers_per_node = 4
  c.schedule.group_size = 2        # hypercube group size
  c.preduce_impl = "auto"          # auto | collective (one worker per device) | segment

  c.num_steps = arg.steps
  c.log_every = 50
  c.eval_every = 500
  return c
