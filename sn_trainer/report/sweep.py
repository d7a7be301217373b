"""A sweep's jobs gathered into sweep.csv and the SingleCaffe study's plots."""
from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

STAGES = ("data", "forward", "backward", "reduce", "update", "wait")  # a step's, as summary.json has them
COLUMNS = ("job", "model", "batch_size", "workers", "threads", "per_worker_batch", "samples_per_sec",
           "efficiency", "test_accuracy", "lr", "weight_decay", "measured_steps", "mean_cpu_percent", "idle_cores", "other_cpu_percent",
           *[f"{s}_ms_per_step" for s in STAGES])


SHARED_PERCENT = 5.0  # other processes' share of the machine above which a measurement is suspect


class ReportError(ValueError):
    """The directory holds nothing to report on; the message says what was looked for."""


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per finished job under ``sweep_dir`` (skipped jobs are left out).

    Raises:
        ReportError: no directory, or no job with a summary.json in it.
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory; pass the sweep directory a multirun printed")
    rows = []
    for path in sorted(root.rglob("summary.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportError(f"{path} is not readable JSON ({exc}); rerun that job or remove it") from None
        if "skipped" in summary or "samples_per_sec" not in summary:
            continue
        rows.append(_row(path.parent.relative_to(root).as_posix() or ".", summary))
    if not rows:
        raise ReportError(f"no job summaries (summary.json) under {root}; run a sweep first, e.g. "
                          "python -m sn_trainer --multirun +experiment=singlecaffe_mnist")
    _add_efficiency(rows)
    rows.sort(key=lambda r: (r["model"], r["threads"], r["batch_size"], r["workers"]))
    return rows


def _row(job: str, summary: dict[str, Any]) -> dict[str, Any]:
    steps = max(1, summary.get("measured_steps") or summary["steps"])
    cpu = summary.get("cpu_percent_per_core") or []
    row = {
        "job": job,
        "model": summary.get("model") or summary["config"]["model"]["name"],
        "batch_size": summary["batch_size"],
        "workers": summary["workers"],
        "threads": summary["threads"],
        "per_worker_batch": summary["per_worker_batch"],
        "samples_per_sec": summary["samples_per_sec"],
        "measured_steps": steps,
        "mean_cpu_percent": sum(cpu) / len(cpu) if cpu else None,
        "idle_cores": sum(1 for c in cpu if c < 20) if cpu else None,  # cores under 20% busy
        "other_cpu_percent": summary.get("other_cpu_percent"),  # the machine's CPU spent on other processes
        "test_accuracy": summary.get("test_accuracy"),
        "lr": ((summary.get("config") or {}).get("optim") or {}).get("lr"),
        "weight_decay": ((summary.get("config") or {}).get("optim") or {}).get("weight_decay"),
    }
    seconds = summary.get("stage_seconds") or summary["phase_seconds"]  # (its name before sn_trainer 0.3)
    for stage in STAGES:
        row[f"{stage}_ms_per_step"] = 1000 * seconds[stage] / steps
    return row


def _add_efficiency(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency: samples/s over (cores used x samples/s of one worker on one core).

    Cores used = workers x threads, so thread scaling and worker scaling share one yardstick;
    without a 1 x 1 job at that batch, the 1-worker job of the same thread count is the base.
    """
    one_core = {(r["model"], r["batch_size"]): r["samples_per_sec"] for r in rows
                if r["workers"] == 1 and r["threads"] == 1}
    one_worker = {(r["model"], r["threads"], r["batch_size"]): r["samples_per_sec"] for r in rows if r["workers"] == 1}
    for r in rows:
        base = one_core.get((r["model"], r["batch_size"]))
        cores = r["workers"] * r["threads"]
        if base is None:
            base, cores = one_worker.get((r["model"], r["threads"], r["batch_size"])), r["workers"]
        r["efficiency"] = r["samples_per_sec"] / (base * cores) if base else None


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: r["samples_per_sec"])


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':14s} {'batch':>5s} {'workers':>7s} {'threads':>7s} {'per-worker':>10s} "
             f"{'samples/s':>10s} {'efficiency':>10s}"]
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        lines.append(f"{r['model']:14s} {r['batch_size']:5d} {r['workers']:7d} {r['threads']:7d} "
                     f"{r['per_worker_batch']:10.1f} {r['samples_per_sec']:10.0f} {eff:>10s}")
    top = best(rows)
    lines.append(f"best: batch_size={top['batch_size']} workers={top['workers']} threads={top['threads']} "
                 f"({top['samples_per_sec']:.0f} samples/s, {top['per_worker_batch']:.1f} samples per worker)")
    busy = [r for r in rows if (r["other_cpu_percent"] or 0) > SHARED_PERCENT]
    if busy:
        worst = max(busy, key=lambda r: r["other_cpu_percent"])
        lines.append(f"warning: in {len(busy)} of {len(rows)} jobs other processes used more than {SHARED_PERCENT:g}% "
                     f"of the machine's CPU (up to {worst['other_cpu_percent']:.0f}%, job {worst['job']}): those "
                     "speeds mean little; rerun on an idle machine")
    return "\n".join(lines)


def plot_all(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the study's PNGs into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = ", ".join(sorted({r["model"] for r in rows}))
    paths = []
    for name, draw in (("speed_vs_workers.png", _speed_vs_workers), ("speed_vs_batch.png", _speed_vs_batch),
                       ("heatmap.png", _heatmap), ("efficiency.png", _efficiency), ("stages.png", _stages)):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        draw(ax, rows)
        ax.set_title(f"{title}: {ax.get_title()}")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _series(rows, key, x, filter_fn=lambda r: True):
    groups = defaultdict(list)
    for r in rows:
        if filter_fn(r):
            groups[key(r)].append(r)
    return {k: sorted(v, key=lambda r: r[x]) for k, v in sorted(groups.items())}


def _speed_vs_workers(ax, rows):
    for (batch, threads), series in _series(rows, lambda r: (r["batch_size"], r["threads"]), "workers").items():
        ax.plot([r["workers"] for r in series], [r["samples_per_sec"] for r in series], marker="o",
                linestyle="-" if threads == 1 else "--", label=f"batch {batch}, {threads} thread(s)/worker")
    _worker_axis(ax, rows)
    ax.set_ylim(bottom=0)  # a speed axis starts at zero: differences look as large as they are
    ax.set_ylabel("training speed (samples/s)")
    ax.set_title("speed against workers")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _worker_axis(ax, rows):
    """Workers on a log2 axis, ticked at the counts that ran, labelled as plain numbers."""
    counts = sorted({r["workers"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.minorticks_off()
    ax.set_xlabel("workers")


def _speed_vs_batch(ax, rows):
    for (workers, threads), series in _series(rows, lambda r: (r["workers"], r["threads"]), "batch_size").items():
        ax.plot([r["batch_size"] for r in series], [r["samples_per_sec"] for r in series], marker="o",
                linestyle="-" if threads == 1 else "--", label=f"{workers} worker(s) x {threads} thread(s)")
    ax.set_xlabel("global batch size (samples)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("training speed (samples/s)")
    ax.set_title("speed against batch size")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _heatmap(ax, rows):
    # Best over thread counts for each (workers, batch) cell.
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["workers"], r["batch_size"])
        if key not in cells or r["samples_per_sec"] > cells[key]["samples_per_sec"]:
            cells[key] = r
    workers = sorted({w for w, _ in cells})
    batches = sorted({b for _, b in cells})
    grid = [[cells[(w, b)]["samples_per_sec"] if (w, b) in cells else float("nan") for b in batches]
            for w in workers]
    image = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    ax.figure.colorbar(image, ax=ax, label="samples/s")
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(range(len(workers)), [str(w) for w in workers])
    ax.set_xlabel("global batch size (samples)")
    ax.set_ylabel("workers")
    for i, w in enumerate(workers):
        for j, b in enumerate(batches):
            if (w, b) in cells:
                c = cells[(w, b)]
                ax.text(j, i, f"{c['samples_per_sec']:.0f} samples/s\n{c['per_worker_batch']:.0f} per worker"
                        f"\n{c['threads']} thread(s)/worker", ha="center", va="center", fontsize=8,
                        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    ax.set_title("best speed per cell (annotated: per-worker batch)")


def _efficiency(ax, rows):
    scaled = [r for r in rows if r["efficiency"] is not None]
    for (batch, threads), series in _series(scaled, lambda r: (r["batch_size"], r["threads"]), "workers").items():
        ax.plot([r["workers"] for r in series], [r["efficiency"] for r in series], marker="o",
                linestyle="-" if threads == 1 else "--", label=f"batch {batch}, {threads} thread(s)/worker")
    ax.axhline(1.0, color="black", linewidth=1, label="ideal linear scaling")
    _worker_axis(ax, rows)
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("efficiency: speed / (cores x speed on 1 core)")
    ax.set_title("scaling efficiency")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _stages(ax, rows):
    labels = [f"b{r['batch_size']} w{r['workers']} t{r['threads']}" for r in rows]
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        values = [r[f"{stage}_ms_per_step"] for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("time per step (ms, mean over workers)")
    ax.set_xlabel("job (batch, workers, threads)")
    ax.set_title("where each step's time goes")
    ax.legend(fontsize=8)


STUDY_RESULTS = "optimization_results.yaml"  # what hydra-optuna-sweeper writes into the sweep's folder


def study(sweep_dir: str | Path, rows: list[dict[str, Any]]) -> str | None:
    """An Optuna sweep's trials, best test accuracy first, and the best the study reported
    (None: the sweep was no study)."""
    import yaml

    path = Path(sweep_dir) / STUDY_RESULTS
    if not path.is_file():
        return None
    found = yaml.safe_load(path.read_text()) or {}
    trials = sorted((r for r in rows if r["test_accuracy"] is not None), key=lambda r: -r["test_accuracy"])
    lines = [f"study ({len(trials)} trials), best test accuracy first:",
             f"{'test accuracy':>13s} {'lr':>10s} {'weight decay':>12s} {'batch':>5s}"]
    lines += [f"{r['test_accuracy']:13.4f} {r['lr']:10.4g} {r['weight_decay']:12.4g} {r['batch_size']:5d}"
              for r in trials]
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in (found.get("best_params") or {}).items())
    lines.append(f"the study's best: {params} (test accuracy {found.get('best_value')})")
    return "\n".join(lines)
