"""PNG figures a person can read: titled axes with units, legends."""
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"compute": "#4C72B0", "wait": "#DD8452", "comm": "#55A868"}


def accuracy_vs_time(panels: dict, path: str, title: str, xlabel: str = "virtual time (s)") -> None:
  """panels: {panel title: {label: [(virtual seconds, test accuracy), ...]}}; one subplot per panel."""
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
  for ax, (name, curves) in zip(axes[0], panels.items()):
    for label, points in curves.items():
      if points:
        t, acc = zip(*points)
        ax.plot(t, [100 * a for a in acc], marker=".", label=label)
    ax.set_title(name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy of the averaged model (%)")
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8, loc="lower right")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def gantt(intervals, num_workers: int, path: str, title: str, t_max: float | None = None,
          xlabel: str = "virtual time (s)") -> None:
  """One row per worker: compute, waiting for a group, communicating (timeline.Trace.intervals)."""
  fig, ax = plt.subplots(figsize=(11, 0.32 * num_workers + 1.5))
  for kind, color in COLORS.items():
    bars = {}
    for w, k, t0, t1 in intervals:
      if k == kind and (t_max is None or t0 < t_max):
        bars.setdefault(w, []).append((t0, min(t1, t_max or t1) - t0))
    for w, spans in bars.items():
      ax.broken_barh(spans, (w - 0.4, 0.8), color=color, label=kind if w == min(bars) else None)
  ax.set_yticks(range(num_workers))
  ax.set_ylabel("worker")
  ax.set_xlabel(xlabel)
  ax.invert_yaxis()
  if t_max:
    ax.set_xlim(0, t_max)
  handles, labels = ax.get_legend_handles_labels()
  ax.legend(handles, labels, loc="upper right", fontsize=8, ncol=3)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def lines(series: dict, path: str, title: str, xlabel: str, ylabel: str) -> None:
  """series: {label: {x: y}}; one line with markers per label."""
  fig, ax = plt.subplots(figsize=(9.5, 4.2))
  for label, points in series.items():
    if points:
      x = sorted(points)
      ax.plot(x, [points[k] for k in x], marker="o", label=label)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a line
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
