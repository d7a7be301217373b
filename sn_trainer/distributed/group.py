"""The "sn" process group: torch.distributed's collectives among the processes of one node, in shared memory
(and, for a group across machines, in each machine's shared memory, then over gloo between them).

What it does not implement (point-to-point, scatter, gather, all-to-all, ...) goes to a gloo group made
on the same store when the group is made, said once per operation in the log.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

from ..errors import CollectiveFailed
from .collectives import Collectives, reduce_op_name
from .machines import AcrossMachines
from .segment import SHM_SAFE, Segment

log = logging.getLogger("sn_trainer")

# Each rank's data slot, in each of the two alternating sets: what one chunk of a collective moves.
SLOT_BYTES = 4 << 20
# Operations handed to gloo as they are (same arguments, same Work).
GLOO_OPERATIONS = ("send", "recv", "recv_anysource", "gather", "gather_single", "gather_into_tensor", "scatter",
                   "reduce", "reduce_scatter", "alltoall", "alltoall_base", "all_to_all_single",
                   "allgather_coalesced", "monitored_barrier")


class DoneWork(dist.Work):
    """A collective that has already completed when it is returned; its future holds its tensors."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self._tensors = tensors
        self._future = torch.futures.Future()
        self._future.set_result(tensors)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        return self._future


def _node_identity() -> str:
    """This machine: its host name and its boot, which two containers of one host share."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def machines_of(store, rank: int, size: int) -> list[str]:
    """The machine each rank of the group runs on, in rank order."""
    store.set(f"sn/node/{rank}", _node_identity())
    return [store.get(f"sn/node/{r}").decode() for r in range(size)]


class SnProcessGroup(dist.ProcessGroup):
    """A process group whose collectives run through one shared-memory segment of the node."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        if not SHM_SAFE:
            raise CollectiveFailed("the 'sn' backend relies on x86-64's store order; use backend='gloo' here")
        self._rank, self._size = rank, size
        machines = machines_of(store, rank, size)
        if len(set(machines)) == 1:
            self._collectives = Collectives(Segment(store, rank, size, timeout, SLOT_BYTES))
        else:  # in each machine's shared memory, then between the machines over gloo
            self._collectives = AcrossMachines(store, rank, size, timeout, machines, SLOT_BYTES)
        self._segment = self._collectives.segment
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("sn/gloo", store), rank, size, timeout)
        self._handed_to_gloo: set[str] = set()

    def getBackendName(self) -> str:
        return "sn"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def allreduce(self, tensors, opts=None):
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for tensor in tensors:
            _in_place(tensor, lambda t: self._collectives.all_reduce(t, op))
        return DoneWork(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for tensor in tensors:
            _in_place(tensor, lambda t: self._collectives.broadcast(t, root))
        return DoneWork(tensors)

    def allgather(self, output_lists, input_tensors, opts=None):
        for outputs, tensor in zip(output_lists, input_tensors):
            _check_gather(outputs, tensor, self._size)
            gathered = torch.empty((self._size, *tensor.shape), dtype=tensor.dtype)
            self._collectives.all_gather(list(gathered), tensor.contiguous())
            for output, part in zip(outputs, gathered):
                output.copy_(part)
        return DoneWork([t for outputs in output_lists for t in outputs])

    def _allgather_base(self, output, tensor, opts=None):
        if output.numel() != tensor.numel() * self._size or output.dtype != tensor.dtype:
            raise CollectiveFailed(f"sn backend: all_gather_into_tensor needs an output of {self._size} x "
                                   f"{tensor.numel()} {tensor.dtype}, got {output.numel()} {output.dtype}")
        _in_place(output, lambda out: self._collectives.all_gather(list(out.view(self._size, -1)),
                                                                   tensor.contiguous()), copy_in=False)
        return DoneWork([output])

    def _reduce_scatter_base(self, output, tensor, opts=None):
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if tensor.numel() != output.numel() * self._size or output.dtype != tensor.dtype:
            raise CollectiveFailed(f"sn backend: reduce_scatter_tensor needs an input of {self._size} x "
                                   f"{output.numel()} {output.dtype}, got {tensor.numel()} {tensor.dtype}")
        _in_place(output, lambda out: self._collectives.reduce_scatter(out, tensor.contiguous(), op), copy_in=False)
        return DoneWork([output])

    all_gather_single = _allgather_base  # what torch's all_gather_into_tensor calls
    reduce_scatter_single = _reduce_scatter_base  # and reduce_scatter_tensor

    def all_gather_single_coalesced(self, outputs, tensors, opts=None):
        for output, tensor in zip(outputs, tensors):
            self._allgather_base(output, tensor, opts)
        return DoneWork(list(outputs))

    def reduce_scatter_single_coalesced(self, outputs, tensors, opts=None):
        for output, tensor in zip(outputs, tensors):
            self._reduce_scatter_base(output, tensor, opts)
        return DoneWork(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        self._collectives.barrier()
        return DoneWork([])

    def _to_gloo(self, name: str, *args):
        if name not in self._handed_to_gloo:
            self._handed_to_gloo.add(name)
            log.info("sn backend: %s is not implemented in shared memory; gloo on the same store runs it", name)
        return getattr(self._gloo, name)(*args)

    def shutdown(self) -> None:
        self._gloo.shutdown()
        if isinstance(self._collectives, AcrossMachines):
            self._collectives.close()
        self._segment.close()

    def __repr__(self) -> str:
        return f"SnProcessGroup(rank={self._rank}, size={self._size}, pid={os.getpid()})"


def _handed_to_gloo(name: str):
    def operation(self, *args):
        return self._to_gloo(name, *args)
    operation.__name__ = name
    operation.__doc__ = f"``{name}`` through the gloo group made on the same store."
    return operation


for _name in GLOO_OPERATIONS:
    setattr(SnProcessGroup, _name, _handed_to_gloo(_name))


def _in_place(tensor: torch.Tensor, collective, copy_in: bool = True) -> None:
    """Run ``collective`` on ``tensor`` itself, or on a contiguous copy written back after."""
    if tensor.device.type != "cpu":
        raise CollectiveFailed(f"the 'sn' backend moves CPU tensors, got one on {tensor.device}; "
                               "use backend='cpu:sn,cuda:nccl' for accelerator tensors")
    if tensor.is_contiguous():
        collective(tensor)
        return
    work = tensor.contiguous() if copy_in else torch.empty(tensor.shape, dtype=tensor.dtype)
    collective(work)
    tensor.copy_(work)


def _check_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, size: int) -> None:
    if len(outputs) != size or any(o.numel() != tensor.numel() or o.dtype != tensor.dtype for o in outputs):
        raise CollectiveFailed(f"sn backend: all_gather needs {size} outputs of {tensor.numel()} {tensor.dtype} "
                               "elements, one per rank")


def create_sn_group(store, rank: int, size: int, timeout: datetime.timedelta) -> SnProcessGroup:
    """What ``torch.distributed.init_process_group(backend="sn")`` calls (registered as ``"sn"``)."""
    return SnProcessGroup(store, rank, size, timeout)
