"""The Ripples claims ledger's claims and clocks: each published claim (CLAIMS) with every figure the
paper gave for it (FIGURES), the clocks the claims are judged on (SETTINGS, each constant with its source
in docs/ledger_sources.md; CLOCKS names them on every table), and the helpers every part of the ledger
writes with (publish, fmt, set_clock). experiments/ledger.py runs the ledger."""

import json
import os

SETTINGS = {  # name: (model bytes, bandwidth B/s, step s); docs/ledger_sources.md for each constant
  "light": (2e5, 1.25e9, 0.01),
  "heavy": (528e6, 56e9 / 8, 0.3),
  # ResNet-50: 25,557,032 fp32 parameters (torchvision) = 102.2e6 bytes; 0.101 s per forward-backward
  # of 16 224x224 images on a GTX 1080 Ti (jcjohnson/cnn-benchmarks); the 56 Gb/s link is unsourced.
  "resnet50": (102.2e6, 56e9 / 8, 0.101),
  # The VGG-16 clock with one constant moved, for the verdicts' sensitivity on time to accuracy: 2/3 of
  # a step's transfers may hide behind its backward pass (timeline.overlap), or the CIFAR-10 VGG-16's
  # message (14.7M parameters, 58.9 MB). Their step sizes are the VGG-16 clock's (TUNED_ON).
  "heavy_overlap": (528e6, 56e9 / 8, 0.3, 2 / 3),
  "heavy_cifar": (58.9e6, 56e9 / 8, 0.3),
}

TUNED_ON = {"heavy_overlap": "heavy", "heavy_cifar": "heavy"}

THROUGHPUT_SETTINGS = ("light", "heavy")  # the throughput table's two columns

OVERHEAD_SETTINGS = ("light", "heavy", "resnet50")


# (claim, paper figure, paper metric, scenario (slowdown, slow workers), ours: (algorithm, baseline))
CLAIMS = [
  (
    "homogeneous vs All-Reduce",
    "1.1x (arXiv) / 1.2x (ASPLOS)",
    "training time",
    1.0,
    ("ripples_smart", "allreduce"),
  ),
  (
    "homogeneous vs All-Reduce (Group Division)",
    "1.1x / 1.2x",
    "training time",
    1.0,
    ("ripples_division", "allreduce"),
  ),
  (
    "homogeneous vs Parameter Server (sync)",
    "5.1x / 5.3x",
    "training time",
    1.0,
    ("ripples_smart", "ps_sync"),
  ),
  (
    "homogeneous vs Parameter Server (async)",
    "5.1x / 5.3x",
    "training time",
    1.0,
    ("ripples_smart", "ps_async"),
  ),
  ("homogeneous vs AD-PSGD", "4.3x / 3.7x", "training time", 1.0, ("ripples_smart", "adpsgd")),
  (
    "one worker 2x slower vs All-Reduce",
    "2x / 4.4x (setting unknown)",
    "training time",
    2.0,
    ("ripples_smart", "allreduce"),
  ),
  ("one worker 2x slower vs Parameter Server", "3x", "training time", 2.0, ("ripples_smart", "ps_sync")),
  ("one worker 5x slower vs All-Reduce", "5.01x", "training time", 5.0, ("ripples_smart", "allreduce")),
  ("one worker 5x slower vs AD-PSGD", "4.23x", "training time", 5.0, ("ripples_smart", "adpsgd")),
]


# Every figure the paper published for a claim, by where it was published (docs/ledger_sources.md
# Part 1a): the two abstracts are primary sources; "body (summary)" figures come from a secondary
# summary of the paper's evaluation and are unverified. The 2x-straggler figures do not state their
# slowdown setting.
FIGURES = {
  "homogeneous vs All-Reduce": {"arXiv": 1.1, "ASPLOS": 1.2},
  "homogeneous vs All-Reduce (Group Division)": {"arXiv": 1.1, "ASPLOS": 1.2},
  "homogeneous vs Parameter Server (sync)": {"arXiv": 5.1, "ASPLOS": 5.3},
  "homogeneous vs Parameter Server (async)": {"arXiv": 5.1, "ASPLOS": 5.3},
  # "body (summary)": Smart GG's "overall execution time 5.26x faster than AD-PSGD", its setting unknown
  "homogeneous vs AD-PSGD": {"arXiv": 4.3, "ASPLOS": 3.7, "body (summary)": 5.26},
  "one worker 2x slower vs All-Reduce": {"arXiv": 2.0, "ASPLOS": 4.4},
  "one worker 2x slower vs Parameter Server": {"arXiv": 3.0},
  "one worker 5x slower vs All-Reduce": {"body (summary)": 5.01},
  "one worker 5x slower vs AD-PSGD": {"body (summary)": 4.23},
}

SOURCES = ("arXiv", "ASPLOS", "body (summary)")

MODEL_NAMES = {"mlp": "MLP (40-256-256-10)", "cnn1d": "CNN1D (12,106 parameters)"}


def numerics(model: str = "mlp") -> str:
  """The label of every table: whose numerics the figures are."""
  return f"numerics: MNIST-1D {MODEL_NAMES[model]}, 16 workers, simulator"


NUMERICS = numerics("mlp")

CLOCKS = {
  "light": "clock: light (0.2 MB, 10 Gb/s, 10 ms steps)",
  "heavy": "clock: VGG-16 (528e6 B, 56 Gb/s, 0.3 s steps; unsourced, docs/ledger_sources.md)",
  "resnet50": (
    "clock: ResNet-50 (102.2e6 B and 0.101 s steps, sourced; 56 Gb/s unsourced; docs/ledger_sources.md)"
  ),
  "heavy_overlap": "clock: VGG-16 with 2/3 of a step's transfers hidden behind its compute",
  "heavy_cifar": "clock: VGG-16 with the CIFAR-10 VGG-16's 58.9 MB message",
}


def publish(out_dir: str, name: str, text: str, out: dict) -> None:
  """name.md (text) and name.json (out) into out_dir, and the text printed."""
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(out, f, indent=1)
  print(text)


def set_clock(config, clock) -> tuple[float, float]:
  """config.timeline from a clock, (model bytes, bandwidth B/s, step s[, overlap]), with the server's
  link as fast as every other link; returns (model bytes, step s)."""
  nbytes, bandwidth, step, *rest = clock
  config.timeline.bandwidth = config.timeline.ps_bandwidth = bandwidth
  config.timeline.compute_time, config.timeline.model_bytes = step, nbytes
  config.timeline.overlap = rest[0] if rest else 0.0
  return nbytes, step


def fmt(m, sd):
  return f"{m:.2f}x ± {sd:.2f}"
