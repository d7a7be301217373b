"""Ray Train on the "sn" backend: ``TorchTrainer(train_func, torch_config=SNConfig(), ...)``; and
sn_trainer's own Trainer across Ray's nodes: ``torch_config=SNNodesConfig()``.

Ray Train starts one process per worker, pins none of them and makes their default process group
over gloo on CPUs. ``SNConfig`` is Ray's ``TorchConfig`` whose backend, before Ray makes the group,
runs in every worker: the workers of each machine numbered among themselves, each pinned to
physical cores of its own with its Ray CPU allotment in threads (``ray_placement``), "sn"
registered; then Ray's own set-up makes the default group on "sn": shared memory among the workers
of one node, gloo between nodes. Each node's first worker says what its workers got, once, on
stderr. The training function is left as its users write it (``ray.train.torch.prepare_model``, a
loop per worker).

``SNNodesConfig`` makes no group: it runs one Ray worker per node, whose training function runs
sn_trainer's ``Trainer(cluster=node_cluster(), ...)`` with that node's cores, the nodes joined as
under torchrun (``ray_nodes``); Ray Train's ``FailureConfig`` restarts them, and each resumes from
the run's last checkpoint.

Needs Ray Train (``pip install 'sn_trainer[ray]'``); the rest of sn_trainer never imports Ray.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional

try:
    import ray
    from ray.train.backend import Backend
    from ray.train.torch.config import TorchConfig, _TorchBackend
except ImportError as missing:
    raise ImportError(f"sn_trainer.integrations.ray needs Ray Train, which is not installed here ({missing}): "
                      "pip install 'sn_trainer[ray]'") from None

from . import ray_nodes, ray_placement
from .ray_nodes import node_cluster
from .ray_placement import WorkerPlacement, placement

__all__ = ["SNConfig", "SNNodesConfig", "WorkerPlacement", "node_cluster", "placement"]


@dataclass
class SNConfig(TorchConfig):
    """Ray Train's ``TorchConfig`` for CPU workers on sn_trainer's "sn" backend, each worker pinned.

    ``TorchTrainer(train_func, torch_config=SNConfig(), scaling_config=ScalingConfig(num_workers=4))``.
    ``init_method`` and ``timeout_s`` are ``TorchConfig``'s; the backend is "sn". Each worker takes its
    ``resources_per_worker`` CPUs (whole ones, default 1) as intra-op threads, pinned to as many of its
    machine's physical cores; a machine runs at most as many workers as it has physical cores, and
    ``use_gpu=True`` is refused (both before any group is made, in one line).
    """

    backend: Optional[str] = "sn"

    @property
    def backend_cls(self):
        return _SNBackend


class _SNBackend(_TorchBackend):
    """Ray's torch backend, with the workers placed and "sn" registered before the group is made."""

    def on_start(self, worker_group, backend_config: SNConfig):
        allotment = ray_placement.whole_cpus(worker_group.get_resources_per_worker())
        machines = worker_group.execute(ray_placement.machine)
        ranks = ray_placement.local_ranks(machines)
        ray.get([worker_group.execute_single_async(index, ray_placement.settle, local_rank, local_world_size,
                                                   allotment)
                 for index, (local_rank, local_world_size) in enumerate(ranks)])
        super().on_start(worker_group, backend_config)


@dataclass
class SNNodesConfig(TorchConfig):
    """Ray Train's ``TorchConfig`` for sn_trainer's own Trainer, one Ray worker per node.

    ``TorchTrainer(per_node, torch_config=SNNodesConfig(), scaling_config=ScalingConfig(num_workers=<nodes>,
    placement_strategy="STRICT_SPREAD", resources_per_worker={"CPU": <a node's cores>}))``, where
    ``per_node`` runs ``Trainer(cluster=node_cluster(), ...).fit(...)``. No process group is made: each
    node's Trainer starts its workers and meets the other nodes itself. ``use_gpu=True``, a part of a
    CPU and two of the run's workers on one machine are refused in one line.
    """

    @property
    def backend_cls(self):
        return _NodesBackend


class _NodesBackend(Backend):
    """Joins the Ray workers as the nodes of one sn_trainer run, anew at each start of the workers."""

    def on_start(self, worker_group, backend_config: SNNodesConfig):
        ray_placement.whole_cpus(worker_group.get_resources_per_worker())
        ray_nodes.one_per_machine(worker_group.execute(ray_placement.machine))
        # The config lives in Ray Train's controller for the whole run: the run's id is made at its first
        # start, and each start after it is a restart of the same run (which resumes its checkpoints).
        run = backend_config.__dict__.setdefault("_sn_run", {"id": uuid.uuid4().hex, "starts": 0})
        master_addr, master_port = worker_group.execute_single(0, ray_nodes.address)
        ray.get([worker_group.execute_single_async(node, ray_nodes.join, node, len(worker_group), master_addr,
                                                   master_port, run["id"], run["starts"])
                 for node in range(len(worker_group))])
        run["starts"] += 1
