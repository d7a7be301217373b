"""A plain DDP training script, as people already have one (the shape of pytorch/examples' DDP
tutorial): the group from the launcher's environment, DDP(model), SGD on this rank's part of each
global batch. benchmarks/ddp_bench.py runs it under torchrun and under sn_trainer.launch.

    torchrun --nproc-per-node=2 examples/ddp_train.py --model lenet --batch 64 --backend gloo
    python -m sn_trainer.launch --nproc-per-node=2 examples/ddp_train.py --model lenet --batch 64 --backend sn

Prints (rank 0) one JSON line: samples/s over the timed steps, the slowest rank's time.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sn_trainer.models import build_model

SHAPES = {"lenet": (1, 28, 28), "cifar10_quick": (3, 32, 32), "cifar10_quick_bn": (3, 32, 32)}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="lenet")
    parser.add_argument("--batch", type=int, default=64, help="the global batch, split evenly over the ranks")
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--backend", default="gloo", help="gloo, or sn (sn_trainer's shared-memory backend)")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--out", help="where rank 0 writes its JSON line (default: stdout only)")
    return parser.parse_args()


def train(args: argparse.Namespace, rank: int, world: int) -> float:
    """Seconds of the timed steps on this rank."""
    torch.manual_seed(0)
    model = build_model(args.model, SHAPES[args.model], 10)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(4096, *SHAPES[args.model], generator=g), torch.randint(0, 10, (4096,), generator=g)
    per_rank = args.batch // world
    start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        idx = torch.randint(0, len(inputs), (args.batch,), generator=g)[rank * per_rank:(rank + 1) * per_rank]
        x = inputs[idx].contiguous(memory_format=torch.channels_last) if args.channels_last else inputs[idx]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), targets[idx]).backward()
        optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    args = arguments()
    if args.backend == "sn":
        import sn_trainer.distributed  # noqa: F401  (registers the "sn" backend)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    slowest = torch.tensor([train(args, rank, world)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        line = json.dumps({"samples_per_sec": args.batch // world * world * args.steps / slowest.item(),
                           "world": world, "threads": torch.get_num_threads(),
                           "affinity": sorted(os.sched_getaffinity(0))})
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
