r"""Ripples' heterogeneity claims in the simulator: 16 workers, MNIST-1D, every algorithm x 3 scenarios.

  python -m experiments.reproduce_ripples --out_dir=runs/reproduce_ripples
  python -m experiments.reproduce_ripples --steps=100 --algorithms=allreduce,ripples_smart   # quick
  python -m experiments.reproduce_ripples --model_bytes=5.28e8 --compute_time=0.3 --bandwidth=7e9 \
      --out_dir=runs/reproduce_ripples_vgg   # the paper's communication: VGG-16 over 56 Gb/s

Writes table.md (throughput and time-to-target relative to All-Reduce, beside the paper's numbers and
the limit (s(n-1)+1)/n), accuracy_vs_time.png and gantt.png.
"""
from absl import app, flags

from configs import default as default_config
from ripples_jax.reproduce_ripples import run
from ripples_jax.schedule import ALGORITHMS

_OUT = flags.DEFINE_string("out_dir", "runs/reproduce_ripples", "Output folder.")
_WORKERS = flags.DEFINE_integer("workers", 16, "Simulated workers (the paper's scale: 16).")
_STEPS = flags.DEFINE_integer("steps", 500, "Steps per worker (num_steps).")
_TARGET = flags.DEFINE_float("target_accuracy", 0.8, "Test accuracy for time-to-target.")
_JITTER = flags.DEFINE_float("jitter", 0.05, "Lognormal sigma of every step time.")
_ALGOS = flags.DEFINE_list("algorithms", list(ALGORITHMS), "Algorithms (allreduce is always needed).")
_COMPUTE = flags.DEFINE_float("compute_time", 0.01, "Virtual seconds of one base step.")
_BYTES = flags.DEFINE_float("model_bytes", 0.0, "Bytes per model exchange (0: the CNN's real bytes; "
                            "5.28e8 is VGG-16, the paper's CIFAR model).")
_BANDWIDTH = flags.DEFINE_float("bandwidth", 1.25e9, "Bytes/s per link and at the parameter server.")


def main(argv):
  del argv
  config = default_config.get_config(
      f"executor=sim,num_workers={_WORKERS.value},steps={_STEPS.value}")
  config.target_accuracy = _TARGET.value
  config.hetero.jitter = _JITTER.value
  config.timeline.compute_time = _COMPUTE.value
  config.timeline.model_bytes = _BYTES.value
  config.timeline.bandwidth = config.timeline.ps_bandwidth = _BANDWIDTH.value
  config.eval_every = max(1, _STEPS.value // 20)
  config.log_every = max(1, _STEPS.value // 20)
  print(run(config, _OUT.value, algorithms=_ALGOS.value))


if __name__ == "__main__":
  app.run(main)
