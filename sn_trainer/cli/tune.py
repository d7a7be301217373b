"""The tuner's command line, ``python -m sn_trainer.tuner --predict cores=32 [numa=2] [bandwidth=120]
--model lenet --batch 128``: the speed the tuner's cost model predicts for 1 to ``cores`` workers on
such a machine, from the calibration tuning cached for this model and batch on this machine (made
now, by the Trainer, when there is none). It lives here, above the Trainer it calibrates with;
``tuner/__main__.py`` only opens it under the tuner's name.
"""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = ("the speed the tuner's cost model predicts for 1 to cores workers on another machine, "
               "from the calibration cached for this model and batch on this one")
SHAPES = {"lenet": (1, 28, 28), "mlp": (1, 28, 28)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.tuner", description=DESCRIPTION)
    parser.add_argument("--predict", nargs="+", metavar="KEY=VALUE", required=True,
                        help="a machine to predict for: cores=N [numa=N] [bandwidth=GB/s]")
    parser.add_argument("--model", default="lenet", help="a model name, as model.name takes")
    parser.add_argument("--batch", type=int, default=128, help="the global batch")
    args = parser.parse_args(argv)
    try:
        machine = _machine(args.predict)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(predict(machine, args.model, args.batch))
    return 0


def _machine(spec: list[str]):
    from ..tuner.model import Machine

    values = dict(item.split("=", 1) for item in spec if "=" in item)
    if set(values) - {"cores", "numa", "bandwidth"} or "cores" not in values:
        raise ValueError(f"--predict takes cores=N [numa=N] [bandwidth=GB/s], got {' '.join(spec)}")
    return Machine(int(values["cores"]), int(values.get("numa", 1)),
                   float(values["bandwidth"]) if "bandwidth" in values else None)


def predict(machine, model_name: str, batch: int) -> str:
    """Predicted samples/s for 1..cores workers (1 thread each) on ``machine``, calibrated on this one."""
    import torch

    from ..models import build_model
    from ..trainer import Trainer
    from ..tuner import cache
    from ..tuner.model import Calibration, bytes_per_sample, prediction_table

    shape = SHAPES.get(model_name, (3, 32, 32))
    torch.manual_seed(0)
    model = build_model(model_name, shape, 10)
    entry = cache.load(cache.cache_key(model, batch, 1, "fp32"))
    if entry is None:
        data = torch.utils.data.TensorDataset(torch.randn(max(2048, 4 * batch), *shape),
                                              torch.randint(0, 10, (max(2048, 4 * batch),)))
        calibration = Trainer(batch_size=batch).tune(model, data, allocators=[], openmps=[]).calibration
        source = "calibrated now"
    else:
        calibration, source = cache.calibration_of(entry), f"calibrated {entry['measured_at']}"
    calibration = Calibration(calibration.compute, calibration.sync_two, calibration.sync_per_doubling,
                              bytes_per_sample(model, (torch.randn(min(batch, 16), *shape), None)))
    title = (f"{model_name}, global batch {batch}, on {machine.cores} cores, {machine.numa_nodes} NUMA node(s)"
             + (f", {machine.bandwidth_gbs:g} GB/s" if machine.bandwidth_gbs else "")
             + f" ({source} on this machine; its per-core speed assumed there)")
    return prediction_table(calibration, machine, batch, title)


if __name__ == "__main__":
    sys.exit(main())
