"""``python -m sn_trainer.report <sweep dir>``: sweep.csv, the study's plots and the best setting.

``python -m sn_trainer.report --predict cores=32 [numa=2] [bandwidth=120] --model lenet --batch 128``:
the speed the tuner's cost model predicts for 1 to ``cores`` workers on such a machine, from the
calibration tuning cached for this model and batch on this machine (made now when there is none).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .sweep import ReportError, collect, plot_all, study, table, write_csv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", nargs="?", help="a multirun directory (holding one folder per job)")
    parser.add_argument("--out", help="where to write sweep.csv and the PNGs (default: the sweep directory)")
    parser.add_argument("--predict", nargs="+", metavar="KEY=VALUE",
                        help="a machine to predict for: cores=N [numa=N] [bandwidth=GB/s]")
    parser.add_argument("--model", default="lenet", help="with --predict: a model name, as model.name takes")
    parser.add_argument("--batch", type=int, default=128, help="with --predict: the global batch")
    args = parser.parse_args(argv)
    if args.predict:
        try:
            print(predict_table(args.predict, args.model, args.batch))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if not args.sweep_dir:
        parser.error("give a sweep directory, or --predict")
    try:
        rows = collect(args.sweep_dir)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or args.sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "sweep.csv")
    paths = plot_all(rows, out)
    print(table(rows))
    found = study(args.sweep_dir, rows)
    if found:
        print(found)
    print(f"wrote {out / 'sweep.csv'} and {', '.join(p.name for p in paths)}")
    return 0


SHAPES = {"lenet": (1, 28, 28), "mlp": (1, 28, 28)}


def predict_table(spec: list[str], model_name: str, batch: int) -> str:
    """Predicted samples/s for 1..cores workers (1 thread each) on the described machine."""
    import torch

    from .. import tune
    from ..models import build_model
    from ..trainer import Trainer

    values = dict(item.split("=", 1) for item in spec if "=" in item)
    unknown = set(values) - {"cores", "numa", "bandwidth"}
    if unknown or "cores" not in values:
        raise ValueError(f"--predict takes cores=N [numa=N] [bandwidth=GB/s], got {' '.join(spec)}")
    machine = tune.Machine(int(values["cores"]), int(values.get("numa", 1)),
                           float(values["bandwidth"]) if "bandwidth" in values else None)
    shape = SHAPES.get(model_name, (3, 32, 32))
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10)
    entry = tune.load(tune.cache_key(model, batch, 1, "fp32"))
    if entry is None:
        data = torch.utils.data.TensorDataset(torch.randn(max(2048, 4 * batch), *shape),
                                              torch.randint(0, 10, (max(2048, 4 * batch),)))
        calibration = Trainer(batch_size=batch).tune(model, data, allocators=[], openmps=[]).calibration
        source = "calibrated now"
    else:
        calibration, source = tune.calibration_of(entry), f"calibrated {entry['measured_at']}"
    sample = (torch.randn(min(batch, 16), *shape), None)
    calibration = tune.Calibration(calibration.compute, calibration.sync_two, calibration.sync_per_doubling,
                                   tune.bytes_per_sample(model, sample))
    one = tune.predict(calibration, machine, batch, 1, 1)
    lines = [f"{model_name}, global batch {batch}, on {machine.cores} cores, {machine.numa_nodes} NUMA node(s)"
             + (f", {machine.bandwidth_gbs:g} GB/s" if machine.bandwidth_gbs else "")
             + f" ({source} on this machine; its per-core speed assumed there)",
             f"{'workers':>7s} {'per-worker':>10s} {'samples/s':>10s} {'speed-up':>8s} {'efficiency':>10s}"]
    workers, best = 1, (0.0, 1)
    while workers <= min(machine.cores, batch):
        rate = tune.predict(calibration, machine, batch, workers, 1)
        lines.append(f"{workers:7d} {batch / workers:10.1f} {rate:10.0f} {rate / one:7.2f}x {rate / one / workers:10.2f}")
        best = max(best, (rate, workers))
        workers *= 2
    lines.append(f"knee: {best[1]} workers ({batch / best[1]:.0f} samples each); beyond it, more workers are slower")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
