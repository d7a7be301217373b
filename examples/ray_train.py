"""A Ray Train script on sn_trainer's "sn" backend: LeNet on Fashion-MNIST, written as Ray's PyTorch
guide writes one (a training function run by every worker, ``prepare_model``, ``prepare_data_loader``,
``TorchTrainer``).

The one line that differs from the same script on Ray's default (gloo on CPUs) is
``torch_config=SNConfig()``: each node's workers sum their gradients through shared memory and reach
other nodes over gloo, each pinned to physical cores of its own with its CPU allotment in threads.
``--backend gloo`` runs the script as Ray would without it. benchmarks/ray_bench.py times both.

    python examples/ray_train.py [--workers 2] [--epochs 1]          # a local Ray of this machine's CPUs
    python examples/ray_train.py --address auto --workers 8          # on a Ray cluster, from its head node

Needs ``pip install 'sn_trainer[ray]'`` on every node. The data comes from Debian's
dataset-fashion-mnist (or ``--root``), read by each worker; ``--data synthetic`` trains on random
images instead. Prints the test accuracy (synthetic: none) and samples/s over the steps after the
warm-up, timed by the slowest worker.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F


def train_func(config: dict) -> None:
    """What every Ray Train worker runs."""
    import ray.train
    import ray.train.torch

    from sn_trainer.models import build_model

    train_set, test_set = datasets(config)
    context = ray.train.get_context()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(build_model("lenet", (1, 28, 28), 10))
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(train_set, batch_size=config["batch_size"] // context.get_world_size(),
                                    shuffle=True, drop_last=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    steps, started, timed = 0, 0.0, 0.0
    for epoch in range(config["epochs"]):
        if context.get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for images, labels in loader:
            if steps == config["warmup"]:
                started = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            steps += 1
            if steps == config["max_steps"]:
                break
        if steps == config["max_steps"]:
            break
    timed = time.perf_counter() - started if steps > config["warmup"] else float("nan")
    slowest = torch.tensor([timed], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_worker = config["batch_size"] // context.get_world_size()
    metrics = {"samples_per_sec": per_worker * context.get_world_size() * (steps - config["warmup"]) / slowest.item(),
               "steps": steps, "test_accuracy": accuracy(model, test_set),
               "backend": dist.get_backend() if dist.is_initialized() else None, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as folder:  # the first worker's weights, with the metrics the run returns
        checkpoint = None
        if context.get_world_rank() == 0:
            torch.save(getattr(model, "module", model).state_dict(), f"{folder}/model.pt")
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)


def datasets(config: dict):
    """Fashion-MNIST's train and test sets (the first ``limit`` images), or random images of its shape."""
    if config["data"] == "synthetic":
        generator = torch.Generator().manual_seed(0)
        n = config["limit"] or 4096
        images, labels = torch.randn(n, 1, 28, 28, generator=generator), torch.randint(0, 10, (n,), generator=generator)
        return torch.utils.data.TensorDataset(images, labels), None
    from sn_trainer.cli.named_datasets import load_datasets
    from sn_trainer.cli.run_config import DatasetConfig

    data = load_datasets(DatasetConfig(name="fashion_mnist", root=config["root"]))
    limit = config["limit"]
    train = torch.utils.data.Subset(data.train, range(min(limit or len(data.train), len(data.train))))
    return train, data.test


@torch.no_grad()
def accuracy(model, test_set) -> float | None:
    if test_set is None:
        return None
    model.eval()
    loader = torch.utils.data.DataLoader(test_set, batch_size=1000)
    right = sum((model(images).argmax(1) == labels).sum().item() for images, labels in loader)
    return right / len(test_set)


def fit(backend: str, workers: int, config: dict, threads: int = 1, storage: str | None = None) -> dict:
    """One Ray Train run of ``train_func`` on ``workers`` workers of ``threads`` CPUs each, over "sn"
    (SNConfig) or gloo (Ray's own TorchConfig); the metrics its first worker reported with its checkpoint."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from sn_trainer.integrations.ray import SNConfig

    torch_config = SNConfig() if backend == "sn" else TorchConfig(backend="gloo")
    with tempfile.TemporaryDirectory() as scratch:
        trainer = TorchTrainer(train_func, train_loop_config=config, torch_config=torch_config,
                               scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": threads}),
                               run_config=RunConfig(storage_path=storage or scratch, name=f"lenet-{backend}"))
        return trainer.fit().metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (the cluster's, on all nodes)")
    parser.add_argument("--threads", type=int, default=1, help="CPUs per worker: its intra-op threads")
    parser.add_argument("--backend", choices=("sn", "gloo"), default="sn")
    parser.add_argument("--address", default=None, help="the Ray cluster to join (ray.init's address: auto, "
                                                        "host:port; default: Ray's own choice, a local one if none)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timing starts")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the workers")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--data", choices=("fashion_mnist", "synthetic"), default="fashion_mnist")
    parser.add_argument("--limit", type=int, default=None, help="use only this many training images")
    parser.add_argument("--root", default=None, help="a folder with Fashion-MNIST's IDX files")
    args = parser.parse_args()

    import ray

    ray.init(address=args.address)
    config = {"epochs": args.epochs, "max_steps": args.max_steps or -1, "warmup": args.warmup,
              "batch_size": args.batch_size, "lr": args.lr, "data": args.data, "limit": args.limit, "root": args.root}
    metrics = fit(args.backend, args.workers, config, args.threads)
    tested = "" if metrics["test_accuracy"] is None else f"test accuracy {metrics['test_accuracy']:.4f}, "
    print(f"{tested}{metrics['samples_per_sec']:.0f} samples/s ({args.workers} Ray workers, {metrics['threads']} "
          f"intra-op thread(s) each, on \"{metrics['backend']}\", batch {args.batch_size}, {metrics['steps']} steps)")


if __name__ == "__main__":
    main()
