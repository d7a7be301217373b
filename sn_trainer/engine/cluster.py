"""Several nodes under torchrun: which node this is, and where the nodes meet."""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ConfigError


class ClusterError(ConfigError):
    """torchrun's environment is not one sn_trainer can run under; the message says why."""


@dataclass(frozen=True)
class Cluster:
    """One sn_trainer process per node, each with its own local workers."""

    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    run_id: str = "sn_trainer"
    restart_count: int = 0
    agent_store: bool = True  # torchrun's agent hosts the store at master_addr:master_port
    interface: str | None = None  # network interface gloo binds to across nodes (GLOO_SOCKET_IFNAME)

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Cluster | None":
        """The cluster torchrun describes in ``env``; None when not under torchrun (or one node).

        Raises:
            ClusterError: torchrun started more than one process per node.
        """
        if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_WORLD_SIZE" not in env:
            return None
        local = int(env.get("LOCAL_WORLD_SIZE", "1"))
        if local != 1:
            raise ClusterError(f"torchrun started {local} processes on this node; run it with --nproc-per-node=1: "
                               "sn_trainer starts its own workers on each node (workers=...)")
        nodes = int(env["WORLD_SIZE"])
        if nodes == 1:
            return None
        return cls(node_rank=int(env["RANK"]), nodes=nodes, master_addr=env["MASTER_ADDR"],
                   master_port=int(env["MASTER_PORT"]), run_id=env.get("TORCHELASTIC_RUN_ID", "sn_trainer"),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True",
                   interface=env.get("GLOO_SOCKET_IFNAME") or None)

    def store(self, prefix: str, timeout_s: float = 300.0) -> dist.Store:
        """A client of the nodes' shared store, with keys scoped to this run, restart and ``prefix``."""
        store = dist.TCPStore(self.master_addr, self.master_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        return dist.PrefixStore(f"sn_trainer/{self.run_id}/{self.restart_count}/{prefix}", store)

    def device(self):
        """The gloo device for traffic between nodes: the named interface, else the host name's address."""
        if self.interface:
            return dist.ProcessGroupGloo.create_device(interface=self.interface)
        return dist.ProcessGroupGloo.create_default_device()
