"""The TensorBoard scalars of a run, plotted into one PNG (what `tensorboard --logdir` would show).

    python scripts/plot_events.py <run dir> <out.png>
"""
from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

PANELS = [("loss", ["train/loss", "eval/loss"]), ("learning rate", ["train/lr"]),
          ("speed", ["speed/tokens_per_sec", "speed/samples_per_sec"]),
          ("milliseconds per step, by stage", ["stage_ms/data", "stage_ms/forward", "stage_ms/backward",
                                               "stage_ms/reduce", "stage_ms/update", "stage_ms/wait"]),
          ("CPU use per core (%)", ["cpu_percent/"])]  # a trailing "/": every tag under it


def main(run_dir: str, out: str) -> None:
    events = EventAccumulator(run_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 3 * len(PANELS)), dpi=100)
    for ax, (title, wanted) in zip(axes, PANELS):
        for tag in [t for w in wanted for t in sorted(tags) if t == w or (w.endswith("/") and t.startswith(w))]:
            points = events.Scalars(tag)
            ax.plot([p.step for p in points], [p.value for p in points], label=tag,
                    marker="o" if len(points) == 1 else None)  # a single evaluation shows as a dot
        ax.set_title(title)
        ax.set_xlabel("step")
        if title != "learning rate":
            ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/plot_events.py <run dir> <out.png>")
    main(*sys.argv[1:3])
