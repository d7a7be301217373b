"""The "sn" group's collectives where its ranks run on several machines.

Each machine's ranks combine in their own shared memory; then one rank per machine (its lowest)
combines the machines' results with the other machines' over gloo, and hands the result back to
its machine's ranks through their shared memory. Every rank gets the same bits: within a machine
one summation order, between machines gloo's result, which its ring hands every rank alike.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .collectives import Collectives, check_reducible
from .segment import Segment


class AcrossMachines:
    """The collectives of ``Collectives``, for a group whose ranks run on several machines."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, machines_of: list[str],
                 slot_bytes: int):
        order = sorted(set(machines_of), key=machines_of.index)  # machines in the order of their lowest rank
        self.members = [[r for r in range(size) if machines_of[r] == machine] for machine in order]
        self.machine = order.index(machines_of[rank])
        mine = self.members[self.machine]
        self.rank, self.world_size = rank, size
        self.segment = Segment(dist.PrefixStore(f"sn/machine/{self.machine}", store), mine.index(rank), len(mine),
                               timeout, slot_bytes)
        self.local = Collectives(self.segment)
        self.between = (dist.ProcessGroupGloo(dist.PrefixStore("sn/between", store), self.machine, len(order), timeout)
                        if self.local.rank == 0 else None)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        check_reducible(tensor.dtype, op)
        if tensor.dtype in (torch.float16, torch.bfloat16):  # combined in float32 and rounded once, as in one machine
            wide = tensor.float()
            self.all_reduce(wide, op)
            tensor.copy_(wide)
            return
        summed = "SUM" if op == "AVG" else op  # the mean is the sum over all ranks, divided once at the end
        self.local.all_reduce(tensor, summed)
        if self.between is not None and tensor.numel():
            options = dist.AllreduceOptions()
            options.reduceOp = getattr(dist.ReduceOp, summed)
            self.between.allreduce([tensor], options).wait()
        self.local.broadcast(tensor, 0)
        if op == "AVG":
            tensor.div_(self.world_size)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        held_by = next(m for m, ranks in enumerate(self.members) if root in ranks)
        if self.machine == held_by:
            self.local.broadcast(tensor, self.members[held_by].index(root))
        if self.between is not None and tensor.numel():
            options = dist.BroadcastOptions()
            options.rootRank = held_by
            self.between.broadcast([tensor], options).wait()
        if self.machine != held_by:
            self.local.broadcast(tensor, 0)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into ``outputs[rank]``; machines with fewer ranks pad their block."""
        most = max(len(ranks) for ranks in self.members)
        blocks = torch.zeros((len(self.members), most, tensor.numel()), dtype=tensor.dtype)
        mine = blocks[self.machine, : len(self.members[self.machine])]
        self.local.all_gather(list(mine), tensor.reshape(-1))
        if self.between is not None and tensor.numel():
            self.between.allgather([list(blocks)], [blocks[self.machine].clone()]).wait()
        self.local.broadcast(blocks, 0)
        for machine, ranks in enumerate(self.members):
            for index, rank in enumerate(ranks):
                outputs[rank].view(-1).copy_(blocks[machine, index])

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str) -> None:
        whole = tensor.clone()
        self.all_reduce(whole, op)
        output.view(-1).copy_(whole.view(self.world_size, -1)[self.rank])

    def barrier(self) -> None:
        self.local.barrier()
        if self.between is not None:
            self.between.barrier(dist.BarrierOptions()).wait()
        self.local.barrier()

    def close(self) -> None:
        if self.between is not None:
            self.between.shutdown()
