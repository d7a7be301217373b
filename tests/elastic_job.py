"""One node of an elastic job on the Trainer API, for test_elastic.py; run it under torchrun --nnodes=MIN:MAX.

Two holds make the membership change at known steps: ``--victim-step K`` makes the last node of
the first round of ``--victim-nodes`` nodes (default 3) stop after step K and say so (its whole
torchrun is then killed by the test); ``--hold-step M`` makes node 0 of a round of
``--hold-nodes`` nodes (default 2) after that stop after step M and say so, until torchrun's agent
stops it because a node has joined. ``--crash-step C`` kills node 0's process after step C, once
in the job, as a crash would.
"""
import argparse
import functools
import json
import logging
import os
import signal
import threading
import time

import torch

from helpers import SmallConvNet, tiny_dataset
from sn_trainer import Callback, Cluster, Trainer

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)
BATCH, SEED, REWARMUP = 12, 3, 2


class Holds(Callback):
    """Stops this node after a step where the test wants a membership change, and tells the test."""

    def __init__(self, cluster: Cluster, args: argparse.Namespace):
        self.cluster, self.out, self.args = cluster, args.out, args

    def on_step_end(self, trainer, progress) -> None:
        args, nodes, rank = self.args, self.cluster.nodes, self.cluster.node_rank
        if rank == 0 and progress.step >= args.crash_step and self._say("crash", {"step": progress.step}):
            os.kill(os.getpid(), signal.SIGKILL)
        victim = nodes == args.victim_nodes and rank == nodes - 1 and progress.step >= args.victim_step
        if victim and self._say("victim", {"agent": os.getppid(), "step": progress.step}):
            threading.Event().wait()  # until the test kills this node's torchrun
        held = (nodes == args.hold_nodes and self.cluster.is_leader and progress.step >= args.hold_step
                and os.path.exists(os.path.join(self.out, "victim.claimed")))  # the round after the loss, not one before
        if held and self._say("held", {"step": progress.step}):
            while not trainer._stop.signal:  # until torchrun's agent stops this round for the node that joined
                time.sleep(0.05)

        if rank == 1 and progress.step >= args.link_step and self._say("link", {}):
            while not os.path.exists(os.path.join(self.out, "link_down")):  # until the test has taken it down
                time.sleep(0.05)

    def _say(self, name: str, what: dict) -> bool:
        """Write ``out/name`` once for the whole job; False where it was written already."""
        path = os.path.join(self.out, name)
        try:
            os.close(os.open(path + ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        with open(path + ".part", "w") as f:
            json.dump(what, f)
        os.replace(path + ".part", path)  # the test sees it whole or not at all
        return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--victim-step", type=int, default=10**9)
    parser.add_argument("--hold-step", type=int, default=10**9)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--worker-timeout", type=float, default=300.0)
    parser.add_argument("--link-step", type=int, default=10**9)
    parser.add_argument("--victim-nodes", type=int, default=3)
    parser.add_argument("--hold-nodes", type=int, default=2)
    parser.add_argument("--crash-step", type=int, default=10**9)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cluster = Cluster.from_env(os.environ)
    start = f"start-{os.environ['TORCHELASTIC_RESTART_COUNT']}-{cluster.node_rank}"
    open(os.path.join(args.out, start), "w").close()  # this node's process started, after so many restarts
    torch.manual_seed(0)
    model = SmallConvNet().double()
    result = Trainer(cluster=cluster, workers=1, threads=1, batch_size=args.batch_size, max_steps=args.steps,
                     seed=SEED, comm="shm", checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=1, log_every=1,
                     rewarmup_steps=REWARMUP, worker_timeout=args.worker_timeout).fit(model, tiny_dataset(dtype=torch.float64), optimizer=SGD,
                                                   callbacks=[Holds(cluster, args)])
    if cluster.is_leader:
        torch.save(model.state_dict(), os.path.join(args.out, "params.pt"))
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(result.summary(), f, default=str)


if __name__ == "__main__":
    main()
