r"""How a simulated run's averaging groups mix, window by window (ripples_jax.analysis.group_windows).

  python -m experiments.group_mix --scenario="worker killed and restarted, VGG-16 clock" \
      --algorithm=ripples_smart --lr=0.5657 --seed=0 --windows=0-10,10-25,25-40,40-60

One run of a baselines-study scenario (experiments.ledger_tta.SCENARIOS, its config exactly), then a
table: per window of virtual seconds, the groups that started in it, how many distinct member sets,
the most repeated one, and the components the groups connect. It is how results/baselines/README.md
found Smart GG's groups locking into a fixed partition while a killed worker is away.
"""

import tempfile

from absl import app, flags

from experiments import ledger_tta
from ripples_jax import analysis, sim
from ripples_jax.tables import Table

_SCENARIO = flags.DEFINE_string(
  "scenario", "homogeneous, VGG-16 clock", "A scenario of ledger_tta.SCENARIOS."
)
_ALGORITHM = flags.DEFINE_string("algorithm", "ripples_smart", "An algorithm variant (ledger_tta.variant).")
_LR = flags.DEFINE_float("lr", 0.5657, "Step size.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps per worker.")
_WORKERS = flags.DEFINE_integer("num_workers", 0, "Workers (0: the scenario's).")
_WINDOWS = flags.DEFINE_list("windows", ["0-10", "10-25", "25-40", "40-60"], "Windows lo-hi, virtual s.")


def mix_table(scenario, algorithm, lr, seed, steps, windows, num_workers=0) -> Table:
  """The run's group_windows as a table, its membership events (leave, rejoin) in the title."""
  from ripples_jax.timeline import AVG

  config, _, _ = ledger_tta.scenario_config(scenario, algorithm, lr, seed, steps, own=False)
  config.num_workers = num_workers or config.num_workers
  with tempfile.TemporaryDirectory() as d:
    summary, trace = sim.simulate_and_train(config, d)
  groups = [(t, a) for t, kind, a, _ in trace.events if kind == AVG]
  rows = [
    [
      f"{r['window'][0]:g}-{r['window'][1]:g}",
      r["groups"],
      r["distinct"],
      str(r["top"]),
      r["top_count"],
      r["components"],
    ]
    for r in analysis.group_windows(groups, windows, config.num_workers)
  ]
  events = ", ".join(f"{e[2]} {e[1]} at {e[0]:.1f} s" for e in summary.get("membership", []))
  title = f"{scenario}, {config.num_workers} workers, {algorithm}, lr {lr:g}, seed {seed}, {steps} steps" + (
    f"; {events}" if events else ""
  )
  header = ["window (virtual s)", "groups", "distinct sets", "most repeated", "its count", "components"]
  return Table(header, rows, title)


def main(argv):
  del argv
  if _SCENARIO.value not in ledger_tta.SCENARIOS:
    raise app.UsageError(f"--scenario: {_SCENARIO.value!r} is not one of {sorted(ledger_tta.SCENARIOS)}")
  if _WORKERS.value < 0 or _WORKERS.value == 1:
    raise app.UsageError(f"--num_workers: {_WORKERS.value}; 0 (the scenario's) or at least 2")
  try:
    windows = [tuple(float(x) for x in w.split("-")) for w in _WINDOWS.value]
    assert all(len(w) == 2 and w[0] < w[1] for w in windows)
  except (ValueError, AssertionError):
    raise app.UsageError(f"--windows: {_WINDOWS.value} must be lo-hi pairs of seconds with lo < hi") from None
  print(
    mix_table(
      _SCENARIO.value, _ALGORITHM.value, _LR.value, _SEED.value, _STEPS.value, windows, _WORKERS.value
    )
  )


if __name__ == "__main__":
  app.run(main)
