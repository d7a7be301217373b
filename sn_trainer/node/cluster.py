"""Several nodes under torchrun: which node this is, and where the nodes meet."""
from __future__ import annotations

import dataclasses
import datetime
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ConfigError


# The store this process hosts for its nodes, where torchrun's agent hosts none (node 0 under
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): kept for the process's lifetime, so that nodes finishing
# after this one still reach it and a second fit meets on it again.
_HOSTED: dict[tuple[str, int], dist.TCPStore] = {}


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
    meeting: str | None = None  # the token the nodes agreed on for this fit (``met``); scopes every key

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def spans_nodes(self) -> bool:
        """Whether other nodes take part: a one-node job meets no one and sums in shared memory alone."""
        return self.nodes > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Cluster | None":
        """The cluster torchrun describes in ``env``, one node included: an elastic job shrunk to
        one node, or a one-node job torchrun restarted, is still its job (its checkpoints are the
        ones it resumes). None when not under torchrun.

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
        if nodes == 1 and "TORCHELASTIC_RUN_ID" not in env:
            return None  # one process of another launcher: no torchrun job to go on with
        return cls(node_rank=int(env["RANK"]), nodes=nodes, master_addr=env["MASTER_ADDR"],
                   master_port=int(env["MASTER_PORT"]), run_id=env.get("TORCHELASTIC_RUN_ID", "sn_trainer"),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True",
                   interface=env.get("GLOO_SOCKET_IFNAME") or None)

    def store(self, prefix: str, timeout_s: float = 300.0) -> dist.Store:
        """A client of the nodes' shared store, with keys scoped to this run, this meeting (else
        this restart) and ``prefix``."""
        scope = self.meeting if self.meeting is not None else str(self.restart_count)
        return dist.PrefixStore(f"sn_trainer/{self.run_id}/{scope}/{prefix}", self._client(timeout_s))

    def _client(self, timeout_s: float) -> dist.Store:
        return dist.TCPStore(self.master_addr, self.master_port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    def met(self, timeout_s: float = 300.0, retry_s: float = 5.0) -> "Cluster":
        """This cluster with a token every node of this rendezvous round agreed on, to scope its keys.

        torchrun keeps its store across rounds while node 0's agent lives, and a membership change
        restarts the nodes without counting a restart (a node that joins starts at 0): neither the
        restart count nor a fixed key tells this round's keys from an earlier round's. Node 0 posts
        a fresh token, each other node acknowledges the one it read with a nonce of its own, and
        node 0 answers each acknowledgement; a token left by an earlier round or by a node 0 that
        died mid-meeting gets no answer, so the others read again until this round's comes. Where
        torchrun's agent hosts no store, node 0 hosts it here.

        A one-node cluster has no one to meet: it is returned as it is.

        Raises:
            ClusterError: the nodes did not all meet within ``timeout_s``.
        """
        if not self.spans_nodes:
            return self
        if self.is_leader and not self.agent_store and (self.master_addr, self.master_port) not in _HOSTED:
            _HOSTED[(self.master_addr, self.master_port)] = dist.TCPStore(
                self.master_addr, self.master_port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False)
        store = dist.PrefixStore(f"sn_trainer/{self.run_id}/meeting", self._client(timeout_s))
        try:
            token = self._post(store) if self.is_leader else self._acknowledge(store, timeout_s, retry_s)
        except RuntimeError as exc:  # the store's timeouts (DistStoreError is one)
            raise ClusterError(f"node {self.node_rank} of {self.nodes}: the nodes did not all meet within "
                               f"{timeout_s:.0f} s ({exc}); check that every node runs this job") from None
        return dataclasses.replace(self, meeting=token)

    def _post(self, store: dist.Store) -> str:
        token = uuid.uuid4().hex
        store.set("token", token)
        for node in range(1, self.nodes):
            nonce = store.get(f"ack/{token}/{node}").decode()  # waits for that node
            store.set(f"answer/{token}/{node}/{nonce}", "1")
        return token

    def _acknowledge(self, store: dist.Store, timeout_s: float, retry_s: float) -> str:
        # The nonce, this call's own, tells this meeting's answer from one a node of this rank got
        # in an earlier round for the same token (the token stays: a node that timed out waiting
        # for its answer reads it again and finds the answer given meanwhile).
        nonce, deadline = uuid.uuid4().hex, time.monotonic() + timeout_s
        while True:
            token = store.get("token").decode()
            store.set(f"ack/{token}/{self.node_rank}", nonce)
            try:
                store.wait([f"answer/{token}/{self.node_rank}/{nonce}"], datetime.timedelta(seconds=retry_s))
                return token
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise

    def device(self):
        """The gloo device for traffic between nodes: the named interface, else the host name's address."""
        if self.interface:
            return dist.ProcessGroupGloo.create_device(interface=self.interface)
        return dist.ProcessGroupGloo.create_default_device()
