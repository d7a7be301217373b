"""sn_trainer's own Trainer across the nodes of a Ray cluster: one Ray worker per node, joined as torchrun
joins one sn_trainer process per node.

Under torchrun each node's process reads its node rank, the node count and where node 0 hosts the
nodes' store from torchrun's environment (``node.cluster.Cluster.from_env``). Under Ray Train the
backend of ``SNNodesConfig`` hands each Ray worker the same facts before the training function runs
(``join``): its node rank (its world rank), the nodes, node 0's address and a free port there (node
0's Trainer hosts the store, as it does where torchrun's agent hosts none), and a run id that stays
the same while Ray Train restarts the workers after a failure, with the count of those restarts, so
that every node's Trainer resumes from the run's last checkpoint as after a torchrun restart. The
training function passes ``node_cluster()`` to its Trainer. Ray is imported here only inside the
functions the workers run.
"""
from __future__ import annotations

import os
import socket

from ..errors import ConfigError
from ..node.cluster import Cluster

_JOINED: list[Cluster] = []  # this Ray worker's node among the run's nodes, once SNNodesConfig has joined it


def one_per_machine(machines: list[tuple[str, str, int]]) -> None:
    """Refuse two Ray workers on one machine: each node's Trainer starts that node's workers itself.

    Raises:
        ConfigError: a machine runs more than one of the run's Ray workers.
    """
    for identity, host, cores in machines:
        count = sum(1 for other, _, _ in machines if other == identity)
        if count > 1:
            raise ConfigError(f"{count} Ray workers run on {host}: SNNodesConfig runs one per node, whose Trainer "
                              f"starts that node's workers itself; use ScalingConfig(num_workers=<nodes>, "
                              f"placement_strategy='STRICT_SPREAD', resources_per_worker={{'CPU': {cores}}})")


def address() -> tuple[str, int]:
    """Where node 0's Trainer will host the nodes' store: this node's address for Ray, a free port."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        return ray.util.get_node_ip_address(), probe.getsockname()[1]


def join(node_rank: int, nodes: int, master_addr: str, master_port: int, run_id: str, restart_count: int) -> None:
    """Make this Ray worker node ``node_rank`` of ``nodes`` (run in each worker before the training function)."""
    _JOINED[:] = [Cluster(node_rank=node_rank, nodes=nodes, master_addr=master_addr, master_port=master_port,
                          run_id=run_id, restart_count=restart_count, agent_store=False,
                          interface=os.environ.get("GLOO_SOCKET_IFNAME") or None)]


def node_cluster() -> Cluster:
    """This node among the run's nodes, for ``Trainer(cluster=node_cluster(), ...)`` in a Ray Train
    training function run with ``torch_config=SNNodesConfig()``.

    Raises:
        ConfigError: called outside such a training function.
    """
    if not _JOINED:
        raise ConfigError("node_cluster() is for a Ray Train training function run with "
                          "TorchTrainer(..., torch_config=SNNodesConfig()): its backend joins the nodes first")
    return _JOINED[0]
