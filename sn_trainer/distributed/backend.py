"""The "sn" process group: torch.distributed's collectives among the processes of one machine, in shared
memory (and, for a group across machines, in each machine's shared memory, then over gloo between them).

The data moves through sn_trainer's shared-memory core (``sn_trainer.shm``): one segment per group,
found through the group's c10d store. What it does not implement (point-to-point, scatter, gather,
all-to-all, ...) goes to a gloo group made on the same store when the group is made, said once per
operation in the log.
"""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from ..errors import CollectiveFailed
from ..shm.chunked import OPS
from ..shm.group import SHM_SAFE
from .machines import AcrossMachines, group_on_store, machines_of
from .torchrun_agent import reaped_by_the_agent
from .work import Channel, PendingWork

log = logging.getLogger("sn_trainer")

# Each rank's data slot, in each of the two alternating sets: what one chunk of a collective moves. Small
# enough that a chunk's slots stay in the cores' caches between the copy in and the reads.
SLOT_BYTES = 256 << 10
# Synchronous collectives up to this size run in the caller's thread when the group's thread is idle
# (the thread's hand-over costs more than they take).
INLINE_BYTES = 1 << 20
# Operations handed to gloo as they are (same arguments, same Work).
GLOO_OPERATIONS = ("send", "recv", "recv_anysource", "gather", "gather_single", "gather_into_tensor", "scatter",
                   "reduce", "reduce_scatter", "alltoall", "alltoall_base", "all_to_all_single",
                   "allgather_coalesced", "monitored_barrier")
_OPS = {getattr(dist.ReduceOp, name): name for name in OPS}


class SnBackend(C10dBackend):
    """The backend of an "sn" process group: its collectives run through one shared-memory segment of the
    machine.

    torch wraps it in a ``ProcessGroup`` of its own, as it wraps gloo's backend: that group holds what torch
    keeps per group (its name, for functional collectives and DeviceMesh; its device; its hooks).
    """

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        if not SHM_SAFE:
            raise CollectiveFailed("the 'sn' backend relies on x86-64's store order; use backend='gloo' here")
        self._rank, self._size = rank, size
        self._options = C10dBackend.Options("sn", timeout)
        # Every group made on this store gets keys of its own: the ranks make groups in the same order,
        # so each rank's own count of them names the same group in every rank.
        store = dist.PrefixStore(f"sn/{store.add(f'sn/made/{rank}', 1)}", store)
        # Made first: a rank whose gloo mesh is complete could otherwise leave (and close its end) while a
        # slower rank's is still connecting; the roll call of machines below waits for every rank's entry.
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        machines = machines_of(store, rank, size)
        if len(set(machines)) == 1:
            self._collectives = group_on_store(store, rank, size, timeout, SLOT_BYTES)
        else:  # in each machine's shared memory, then between the machines over gloo
            self._collectives = AcrossMachines(store, rank, size, timeout, machines, SLOT_BYTES)
        self._group = self._collectives.group
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun's agent
            self._group.before_naming_gone = reaped_by_the_agent
        self._handed_to_gloo: set[str] = set()
        self._channel = Channel()

    def getBackendName(self) -> str:
        return "sn"

    @property
    def options(self) -> C10dBackend.Options:
        """What torch reads back from a group's backend (the base class's own would call itself)."""
        return self._options

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def _submit(self, kind: str, run, tensors: list[torch.Tensor], opts) -> PendingWork:
        """``run`` on the group's channel; in the caller's thread if it is synchronous, small and first."""
        inline = opts is not None and not opts.asyncOp and (
            tensors[0].numel() * tensors[0].element_size() <= INLINE_BYTES if len(tensors) == 1
            else sum(t.numel() * t.element_size() for t in tensors) <= INLINE_BYTES)
        return self._channel.submit(run, tensors, kind, self._group, inline)

    def allreduce(self, tensors, opts=None):
        op, timeout, collectives = self._op(opts), _timeout(opts), self._collectives

        def run():
            for tensor in tensors:
                if tensor.is_cpu and tensor.is_contiguous():  # the common case, without a closure
                    collectives.all_reduce(tensor, op, timeout)
                else:
                    self._in_place(tensor, lambda t: collectives.all_reduce(t, op, timeout))
        return self._submit("all_reduce", run, tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root, timeout = opts.rootRank if opts is not None else 0, _timeout(opts)
        return self._submit("broadcast", lambda: [self._in_place(t, lambda t: self._collectives.broadcast(
            t, root, timeout)) for t in tensors], tensors, opts)

    def allgather(self, output_lists, input_tensors, opts=None):
        timeout = _timeout(opts)

        def run():
            for outputs, tensor in zip(output_lists, input_tensors):
                if len(outputs) != self._size:
                    self._group.fail(f"sn: rank {self._rank} called all_gather with {len(outputs)} outputs for "
                                     f"{self._size} ranks; give one output tensor per rank")
                gathered = torch.empty((self._size, *tensor.shape), dtype=tensor.dtype)
                self._collectives.all_gather(gathered, tensor.contiguous(), timeout)
                for output, part in zip(outputs, gathered):
                    if output.shape != part.shape or output.dtype != part.dtype:
                        self._group.fail(f"sn: rank {self._rank}'s all_gather output of {output.dtype}"
                                         f"{list(output.shape)} cannot hold a rank's {part.dtype}{list(part.shape)}")
                    output.copy_(part)
        return self._submit("all_gather", run, [t for outputs in output_lists for t in outputs], opts)

    def _allgather_base(self, output, tensor, opts=None):
        return self._submit("all_gather", self._gather_into(output, tensor, opts), [output], opts)

    def _reduce_scatter_base(self, output, tensor, opts=None):
        return self._submit("reduce_scatter", self._scatter_into(output, tensor, opts), [output], opts)

    all_gather_single = _allgather_base  # what torch's all_gather_into_tensor calls
    reduce_scatter_single = _reduce_scatter_base  # and reduce_scatter_tensor

    def all_gather_single_coalesced(self, outputs, tensors, opts=None):
        runs = [self._gather_into(output, tensor, opts) for output, tensor in zip(outputs, tensors)]
        return self._submit("all_gather", lambda: [run() for run in runs], list(outputs), opts)

    def reduce_scatter_single_coalesced(self, outputs, tensors, opts=None):
        runs = [self._scatter_into(output, tensor, opts) for output, tensor in zip(outputs, tensors)]
        return self._submit("reduce_scatter", lambda: [run() for run in runs], list(outputs), opts)

    def _gather_into(self, output, tensor, opts):
        timeout = _timeout(opts)
        return lambda: self._in_place(output, lambda out: self._collectives.all_gather(
            out, tensor.contiguous(), timeout), copy_in=False)

    def _scatter_into(self, output, tensor, opts):
        op, timeout = self._op(opts), _timeout(opts)
        return lambda: self._in_place(output, lambda out: self._collectives.reduce_scatter(
            out, tensor.contiguous(), op, timeout), copy_in=False)

    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        timeout = _timeout(opts)
        return self._submit("barrier", lambda: self._collectives.barrier(timeout), [], opts)

    def _op(self, opts) -> str:
        """The name of the ``dist.ReduceOp`` in ``opts`` (SUM where none is given). One the backend does not
        have is refused in the call, as gloo refuses it, and breaks the group, so that every rank raises."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if op == dist.ReduceOp.SUM:  # the common case, first
            return "SUM"
        for known, name in _OPS.items():
            if op == known:
                return name
        if op == dist.ReduceOp.PREMUL_SUM:  # what FSDP2 asks for under a gradient divide factor of its own
            self._group.fail(f"sn: rank {self._rank} asked for ReduceOp.PREMUL_SUM, which the 'sn' backend does not "
                             "have (nor gloo); scale the tensors and use SUM (FSDP2: call "
                             "set_force_sum_reduction_for_comms(True) on the module)")
        self._group.fail(f"sn: rank {self._rank} asked for reduce op {op}, which the 'sn' backend does not have; "
                         f"use one of {', '.join(OPS)}")

    def _in_place(self, tensor: torch.Tensor, collective, copy_in: bool = True) -> None:
        """Run ``collective`` on ``tensor`` itself, or on a contiguous copy written back after."""
        if not tensor.is_cpu:
            self._group.fail(f"sn: the 'sn' backend moves CPU tensors, rank {self._rank} gave one on "
                             f"{tensor.device}; use backend='cpu:sn,cuda:nccl' for accelerator tensors")
        if tensor.is_contiguous():
            collective(tensor)
            return
        work = tensor.contiguous() if copy_in else torch.empty(tensor.shape, dtype=tensor.dtype)
        collective(work)
        tensor.copy_(work)

    def _to_gloo(self, name: str, *args):
        if name not in self._handed_to_gloo:
            self._handed_to_gloo.add(name)
            log.info("sn backend: %s is not implemented in shared memory; gloo on the same store runs it", name)
        return getattr(self._gloo, name)(*args)

    def shutdown(self) -> None:
        self._channel.close()
        self._gloo.shutdown()
        if isinstance(self._collectives, AcrossMachines):
            self._collectives.close()
        self._collectives.close()
        self._group.close()

    def __repr__(self) -> str:
        return f"SnBackend(rank={self._rank}, size={self._size}, pid={os.getpid()})"


def _handed_to_gloo(name: str):
    def operation(self, *args):
        return self._to_gloo(name, *args)
    operation.__name__ = name
    operation.__doc__ = f"``{name}`` through the gloo group made on the same store."
    return operation


for _name in GLOO_OPERATIONS:
    setattr(SnBackend, _name, _handed_to_gloo(_name))


def _left_out_of_compiled_graphs(*classes: type) -> None:
    """Make torch.compile run these classes' methods, and all they call, as plain Python.

    Dynamo looks at every Python frame that runs while a compiled function does, those that torch's C++
    calls into included (DDP's reducer calling this backend's collectives, waiting on its works): it would
    try to trace them and break its graph at each lock and event, where gloo's backend, all C++, shows
    it nothing. Said per code object through torch's C extension, without importing torch._dynamo (which
    takes seconds) in every process that makes a group.
    """
    try:
        from torch._C._dynamo import eval_frame
        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    except (ImportError, AttributeError):  # a torch without it: Dynamo traces (and breaks) as before
        return
    for cls in classes:
        for value in vars(cls).values():
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            if code is not None:
                eval_frame.set_code_exec_strategy(code, skip)


_left_out_of_compiled_graphs(SnBackend, PendingWork)


def _timeout(opts) -> float | None:
    """The collective's own timeout in seconds, where its options set one (else the group's)."""
    timeout = getattr(opts, "timeout", None)
    if timeout is None or timeout == _UNSET:
        return None
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None


_UNSET = dist.AllreduceOptions().timeout  # what options hold where no timeout was set


def create_sn_group(store, rank: int, size: int, timeout: datetime.timedelta) -> SnBackend:
    """What ``torch.distributed.init_process_group(backend="sn")`` and ``new_group(backend="sn")`` call
    (registered as ``"sn"``); torch wraps what it returns in a ``ProcessGroup`` named by torch.

    Raises:
        CollectiveFailed: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose checking wrapper torch puts around
            a backend loses a Python one's methods (and asks it for sequence numbers).
    """
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        raise CollectiveFailed("the 'sn' backend does not run under TORCH_DISTRIBUTED_DEBUG=DETAIL; set it to INFO "
                               "or unset it (sn itself checks that every rank calls the same collective on the "
                               "same sizes and dtypes), or debug over backend='gloo'")
    return SnBackend(store, rank, size, timeout)
