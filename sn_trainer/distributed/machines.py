"""Where the ranks of an "sn" group run: which machine each is on, the segment the ranks of one machine
share, and the group's collectives where its ranks run on several machines.

Across machines, each machine's ranks combine in their own shared memory; then one rank per machine
(its lowest) combines the machines' results with the other machines' over gloo, and hands the result
back to its machine's ranks through their shared memory. Every rank gets the same bits: within a machine
one summation order, between machines gloo's result, which its ring hands every rank alike. Between
machines, failures and argument checks are gloo's.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from ..shm.chunked import Collectives, reduce_problem
from ..shm.group import Group
from ..shm.layout import Layout
from ..shm.segment import Segment


def machine_identity() -> str:
    """This machine as shared memory sees it: host name, boot, and IPC namespace (processes that share
    all three can attach each other's segments)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = ""
    return f"{socket.gethostname()}/{boot_id}/{ipc}"


def machines_of(store, rank: int, size: int) -> list[str]:
    """The machine each rank of the group runs on, in rank order."""
    store.set(f"machine/{rank}", machine_identity())
    return [store.get(f"machine/{r}").decode() for r in range(size)]


def group_on_store(store, rank: int, world: int, timeout: datetime.timedelta, slot_bytes: int) -> Collectives:
    """The collectives of ranks that share a machine, on one segment: rank 0 makes it, publishes its id in
    ``store``, and every rank attaches it. Nothing names it: it is gone when the last rank leaves."""
    layout = Layout(world, 2 * world * slot_bytes)
    if rank == 0:
        segment = Segment.create(layout.size)
        store.set("segment", str(segment.shmid))
    else:
        segment = Segment.attach(int(store.get("segment").decode()), layout.size)
    group = Group(segment, layout, rank, world, timeout.total_seconds(), slot_bytes)
    return Collectives(group, slot_bytes)


class AcrossMachines:
    """The collectives of ``Collectives``, for a group whose ranks run on several machines."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, machines_of: list[str],
                 slot_bytes: int):
        order = sorted(set(machines_of), key=machines_of.index)  # machines in the order of their lowest rank
        self.members = [[r for r in range(size) if machines_of[r] == machine] for machine in order]
        self.machine = order.index(machines_of[rank])
        mine = self.members[self.machine]
        self.rank, self.world_size = rank, size
        self.local = group_on_store(dist.PrefixStore(f"machine/{self.machine}", store), mine.index(rank), len(mine),
                                    timeout, slot_bytes)
        self.group = self.local.group
        self.between = (dist.ProcessGroupGloo(dist.PrefixStore("between", store), self.machine, len(order), timeout)
                        if self.local.rank == 0 else None)

    def all_reduce(self, tensor: torch.Tensor, op: str, timeout_s: float | None = None) -> None:
        problem = reduce_problem(tensor.dtype, op)
        if problem:
            self.group.fail(f"sn: rank {self.rank} called all_reduce with a bad argument: {problem}")
        if tensor.dtype in (torch.float16, torch.bfloat16):  # combined in float32 and rounded once, as in one machine
            wide = tensor.float()
            self.all_reduce(wide, op, timeout_s)
            tensor.copy_(wide)
            return
        summed = "SUM" if op == "AVG" else op  # the mean is the sum over all ranks, divided once at the end
        self.local.all_reduce(tensor, summed, timeout_s)
        if self.between is not None and tensor.numel():
            options = dist.AllreduceOptions()
            options.reduceOp = getattr(dist.ReduceOp, summed)
            self.between.allreduce([tensor], options).wait()
        self.local.broadcast(tensor, 0, timeout_s)
        if op == "AVG":
            tensor.div_(self.world_size)

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float | None = None) -> None:
        if not 0 <= root < self.world_size:
            self.group.fail(f"sn: rank {self.rank} called broadcast with a bad argument: root {root} is not a rank "
                            f"of this group of {self.world_size}")
        held_by = next(m for m, ranks in enumerate(self.members) if root in ranks)
        if self.machine == held_by:
            self.local.broadcast(tensor, self.members[held_by].index(root), timeout_s)
        if self.between is not None and tensor.numel():
            options = dist.BroadcastOptions()
            options.rootRank = held_by
            self.between.broadcast([tensor], options).wait()
        if self.machine != held_by:
            self.local.broadcast(tensor, 0, timeout_s)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        """Every rank's ``tensor`` into ``output`` in rank order; machines with fewer ranks pad their block."""
        most = max(len(ranks) for ranks in self.members)
        blocks = torch.zeros((len(self.members), most, tensor.numel()), dtype=tensor.dtype)
        mine = blocks[self.machine, : len(self.members[self.machine])]
        self.local.all_gather(mine, tensor.reshape(-1), timeout_s)
        if self.between is not None and tensor.numel():
            self.between.allgather([list(blocks)], [blocks[self.machine].clone()]).wait()
        self.local.broadcast(blocks, 0, timeout_s)
        rows = output.view(self.world_size, -1)
        for machine, ranks in enumerate(self.members):
            for index, rank in enumerate(ranks):
                rows[rank].copy_(blocks[machine, index])

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str, timeout_s: float | None = None) -> None:
        whole = tensor.clone()
        self.all_reduce(whole, op, timeout_s)
        output.view(-1).copy_(whole.view(self.world_size, -1)[self.rank])

    def barrier(self, timeout_s: float | None = None) -> None:
        self.local.barrier(timeout_s)
        if self.between is not None:
            self.between.barrier(dist.BarrierOptions()).wait()
        self.local.barrier(timeout_s)

    def close(self) -> None:
        if self.between is not None:
            self.between.shutdown()
        self.local.close()
