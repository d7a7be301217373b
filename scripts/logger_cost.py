"""What logging costs a run: samples/s with logger=none, tensorboard, mlflow and both, side by side.

Alternating runs of the same command-line job (LeNet on Fashion-MNIST, 2 workers, one epoch,
a progress record every 10 steps, ten times the default rate, so the loggers have work),
medians of samples/s and of the job's wall time. MLflow writes to an SQLite store beside each
run (its default).

    python scripts/logger_cost.py [--rounds 3] [--out results/logger_cost]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sn_trainer.engine.node.machine import describe_machine
from sn_trainer.report.results import write_result

JOB = ["epochs=1", "workers=2", "log_every=10"]


def run(logger: str, out: Path) -> tuple[float, float]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sn_trainer", *JOB, f"logger={logger}", f"hydra.run.dir={out}"],
                   check=True, capture_output=True)
    wall = time.perf_counter() - started
    return json.loads((out / "summary.json").read_text())["samples_per_sec"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/logger_cost")
    args = parser.parse_args()
    samples: dict[str, list[tuple[float, float]]] = {"none": [], "tensorboard": [], "mlflow": [],
                                                     "[tensorboard,mlflow]": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for logger in samples:
                samples[logger].append(run(logger, Path(tmp) / f"{logger.strip('[]').replace(',', '+')}-{round_index}"))
                print(f"round {round_index + 1}: logger={logger}: {samples[logger][-1][0]:.0f} samples/s, "
                      f"{samples[logger][-1][1]:.1f} s", flush=True)
    med = {k: (statistics.median(r for r, _ in v), statistics.median(w for _, w in v)) for k, v in samples.items()}
    machine = describe_machine()
    lines = ["# What logging costs", "",
             f"Machine: {machine['cpu_model']}, {machine['physical_cores']} physical cores, torch {machine['torch']}. "
             f"`python scripts/logger_cost.py`: `python -m sn_trainer {' '.join(JOB)} logger=...`, {args.rounds} "
             "alternating rounds, medians [min-max].", "",
             "| logger | samples/s | job wall time (s) |", "|---|---:|---:|"]
    for k, v in samples.items():
        rates, walls = [r for r, _ in v], [w for _, w in v]
        lines.append(f"| {k} | {med[k][0]:.0f} [{min(rates):.0f}-{max(rates):.0f}] | {med[k][1]:.1f} "
                     f"[{min(walls):.1f}-{max(walls):.1f}] |")
    lines.append("")
    for k in list(samples)[1:]:
        lines.append(f"{k} / none: samples/s {med[k][0] / med['none'][0]:.3f}, wall time {med[k][1] / med['none'][1]:.3f}.")
    write_result(args.out, {"machine": machine, "rounds": args.rounds, "samples": samples}, "\n".join(lines))


if __name__ == "__main__":
    main()
