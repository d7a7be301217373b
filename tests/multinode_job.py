"""One node of a multi-node job on the Trainer API, for test_multinode.py; run it under torchrun."""
import argparse
import functools
import logging
import os

import sn_trainer

if __name__ == "__main__":
    sn_trainer.warm_up()  # before torch, as a script that wants its workers warm early does

import torch  # noqa: E402

from helpers import Bomb, SmallConvNet, tiny_dataset
from sn_trainer import Cluster, Trainer

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-on-node", type=int, default=-1)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cluster = Cluster.from_env(os.environ)
    torch.manual_seed(0)
    model = SmallConvNet()
    # Every node wraps the model alike (the checkpoint's names must fit all of them); the bomb
    # goes off on one node only, and once: its flag file stays.
    armed = cluster.node_rank == args.kill_on_node
    model = Bomb(model, os.path.join(args.out, "flag"), "kill", at_call=3 if armed else 10**9)
    Trainer(cluster=cluster, workers=args.workers, threads=1, batch_size=12, max_steps=args.steps, seed=3, comm="shm",
            checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=1).fit(model, tiny_dataset(), optimizer=SGD)
    if cluster.is_leader:
        state = {k.removeprefix("inner."): v for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(args.out, "params.pt"))


if __name__ == "__main__":
    main()
