r"""The asynchronous runtime in wall-clock time: 4 worker processes, homogeneous and one worker 2x / 5x slower.

  python -m experiments.bench_runtime --out=results/runtime        # ~6 minutes on 2 cores

Each run: MLP on MNIST-1D, 150 steps per worker on average, every step padded to 0.1 s. Targets (n=4):
Ripples smart >= 0.85 x the limit (s (n-1) + 1) / n at 2x and 5x, and >= 0.95x All-Reduce homogeneous.
"""
from absl import app, flags

from ripples_jax.bench_runtime import ALGORITHMS, run

_OUT = flags.DEFINE_string("out", "results/runtime", "Output folder (tables, PNGs, every run's files).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 4, "Worker processes.")
_SLOWDOWNS = flags.DEFINE_list("slowdowns", ["1", "2", "5"], "Slowdowns of the slow worker.")
_ALGORITHMS = flags.DEFINE_list("algorithms", list(ALGORITHMS), "Algorithms (allreduce first).")
_STEPS = flags.DEFINE_integer("steps", 150, "Steps per worker on average (config.num_steps).")
_STEP_TIME = flags.DEFINE_float("step_time", 0.1, "Seconds every step is padded to.")
_MODEL = flags.DEFINE_string("model", "mlp", "Model.")
_TARGET = flags.DEFINE_float("target", 0.5, "Test accuracy for the time-to-target column.")
_SLOW_WORKER = flags.DEFINE_integer("slow_worker", None, "The slow worker (default: the last).")


def main(argv):
  del argv
  args = [f"--config.num_steps={_STEPS.value}", f"--config.runtime.step_time={_STEP_TIME.value}",
          f"--config.model={_MODEL.value}", f"--config.target_accuracy={_TARGET.value}",
          f"--config.eval_every={max(1, _STEPS.value // 10)}",
          # Static GG over two "nodes", so it is not All-Reduce under another name.
          f"--config.schedule.workers_per_node={max(1, _NUM_PROCESSES.value // 2)}"]
  print(run(_OUT.value, _NUM_PROCESSES.value, [float(s) for s in _SLOWDOWNS.value], _ALGORITHMS.value,
            args, _SLOW_WORKER.value, target=_TARGET.value))


if __name__ == "__main__":
  app.run(main)
