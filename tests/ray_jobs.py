"""What tests/test_ray.py runs on a local Ray cluster: a Ray Train DDP script as its users write it
(``ray.train.torch.prepare_model`` and ``prepare_data_loader``, a loop per worker), and a machine of its
own for the Ray node a test adds.

Each worker writes OUT/<tag>-rank<r>.pt: the trained parameters, the backend of the group its DDP
wrapper reduced over and the class that ran it, where the training thread runs (its affinity and
intra-op threads) and what ``SNConfig`` chose for it, so that the test can compare "sn" with gloo.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

CLONE_NEWUTS = 0x04000000


def ddp_loop(config: dict) -> None:
    """A Ray Train training function: a small classifier, shuffled batches, SGD with momentum."""
    import ray.train
    import ray.train.torch

    dtype = getattr(torch, config.get("dtype", "float32"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)
    model = ray.train.torch.prepare_model(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=generator, dtype=dtype)
    y = torch.randint(0, 3, (96,), generator=generator)
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    context = ray.train.get_context()
    for epoch in range(config.get("epochs", 2)):
        if context.get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for inputs, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
    record(config, model, context.get_world_rank())


def record(config: dict, model, rank: int) -> None:
    from sn_trainer.integrations.ray import placement

    module = getattr(model, "module", model)
    found = {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
             "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
             "host": socket.gethostname(), "placement": placement()}
    if dist.is_initialized():
        group = getattr(model, "process_group", None) or dist.group.WORLD
        implementation = group._get_backend(torch.device("cpu"))  # gloo's, or sn_trainer's SnBackend
        found.update(backend=dist.get_backend(group), backend_class=type(implementation).__name__)
        if hasattr(implementation, "_collectives"):  # "sn": the machines its ranks run on (members: one list each)
            found["machines"] = len(getattr(implementation._collectives, "members", [[]]))
    torch.save(found, Path(config["out"]) / f"{config['tag']}-rank{rank}.pt")


@contextlib.contextmanager
def another_machine(host: str):
    """Processes started inside the block (a Ray node's raylet, and the workers it starts) run in a
    UTS namespace of their own under ``host``: another machine to the "sn" backend (the boot id
    stays; the host name differs). This thread goes back to its own namespace after the block."""
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/uts", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWUTS) != 0:  # root
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
        socket.sethostname(host)
        yield
    finally:
        if libc.setns(here, CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), "setns back to this process's UTS namespace")
        os.close(here)


def saved(out: Path, tag: str, world: int) -> list[dict]:
    return [torch.load(out / f"{tag}-rank{rank}.pt", weights_only=False) for rank in range(world)]


def train(tag: str, torch_config, out: Path, workers: int, dtype: str = "float32", **scaling) -> None:
    """``ddp_loop`` under Ray Train's TorchTrainer, as a driver script starts it."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(ddp_loop, train_loop_config={"out": str(out), "tag": tag, "dtype": dtype}, torch_config=torch_config,
                 scaling_config=ScalingConfig(num_workers=workers, **scaling),
                 run_config=RunConfig(storage_path=str(out / "ray"), name=tag)).fit()


# Ray Train's own pace, set for the tests: its controller polls the workers every 2 s by default and
# starts a preemption watcher and metrics of its own, none of which these runs need.
QUICK = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
         "RAY_TRAIN_METRICS_ENABLED": "0"}


def per_node(config: dict) -> None:
    """A Ray Train training function that runs sn_trainer's own Trainer on its node's cores, the nodes joined by
    SNNodesConfig, a checkpoint every step; the first node writes OUT/params.pt. With ``lose_node=k``, node k's
    Ray worker (the node's Trainer, whose workers end with it) is SIGKILLed after step 3, once (its flag file
    stays): the node is lost mid-run, as a machine that goes down loses it."""
    import functools
    import signal

    from helpers import SmallConvNet, tiny_dataset
    from sn_trainer import Callback, Trainer
    from sn_trainer.integrations.ray import node_cluster

    class LoseThisNode(Callback):
        def on_step_end(self, trainer, record) -> None:
            if record.step == 3:
                try:
                    os.close(os.open(os.path.join(config["out"], "flag"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
                os.kill(os.getpid(), signal.SIGKILL)

    cluster = node_cluster()
    torch.manual_seed(0)
    model = SmallConvNet()
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)
    lost = [LoseThisNode()] if cluster.node_rank == config.get("lose_node", -1) else []
    result = Trainer(cluster=cluster, workers=config["workers"], threads=1, batch_size=12, max_steps=5, seed=3,
                     comm="shm", log_every=1, checkpoint_dir=config.get("checkpoint_dir"),
                     checkpoint_every_steps=1).fit(model, tiny_dataset(), optimizer=sgd, callbacks=lost)
    if cluster.is_leader:
        torch.save({"state": model.state_dict(), "nodes": cluster.nodes, "restart_count": cluster.restart_count,
                    "first_step": result.history[0]["step"] if result.history else None},
                   os.path.join(config["out"], "params.pt"))
