"""One node of a two-node job with compress=..., for test_compress.py; run it under torchrun.

Every node saves its own weights and its summary, so that the test can compare the nodes."""
import argparse
import functools
import json
import logging
import os

import torch
from torch import nn

from helpers import tiny_dataset
from sn_trainer import Cluster, Trainer

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def model() -> nn.Module:
    """A hidden layer wide enough to be worth compressing, and an output layer too thin to be."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compress", default="none")
    parser.add_argument("--after", type=int, default=0)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cluster = Cluster.from_env(os.environ)
    net = model()
    result = Trainer(cluster=cluster, workers=args.workers, threads=1, batch_size=12, max_steps=args.steps, seed=3,
                     comm="shm", compress=args.compress, compress_rank=args.rank, compress_after=args.after,
                     checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=1,
                     resume=args.resume).fit(net, tiny_dataset(), optimizer=SGD)
    torch.save(net.state_dict(), os.path.join(args.out, f"params{cluster.node_rank}.pt"))
    with open(os.path.join(args.out, f"summary{cluster.node_rank}.json"), "w") as f:
        json.dump({"compression": result.compression, "plan": result.plan["compression"], "comm": result.comm}, f)


if __name__ == "__main__":
    main()
