"""The "sn" process group: torch.distributed's collectives among the processes of one node, in shared memory
(and, for a group across machines, in each machine's shared memory, then over gloo between them).

What it does not implement (point-to-point, scatter, gather, all-to-all, ...) goes to a gloo group made
on the same store when the group is made, said once per operation in the log.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

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


class PendingWork(dist.Work):
    """A collective queued on the group's channel: done when the channel has run it; its future then
    holds its tensors (what DDP's buckets and communication hooks chain on)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self._tensors = tensors
        self._future = torch.futures.Future()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def complete_future(self) -> None:
        if self._error is None:
            self._future.set_result(self._tensors)
        else:
            self._future.set_exception(self._error)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._done.wait()  # the channel's own waits are bounded by the group's timeout
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        return self._future


class _Channel:
    """One thread per group that runs its collectives one at a time in the order they were called, so
    that a bucket's all-reduce proceeds while the backward pass computes the next buckets' gradients.

    Futures are completed on other threads (``_Completions``): a callback chained on one may wait
    for a later collective of this channel (PowerSGD's hook does), which would never run if the
    callback held the channel's thread.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._completions = _Completions()
        self._thread = threading.Thread(target=self._run, name="sn-collectives", daemon=True)
        self._thread.start()

    def submit(self, run, tensors: list[torch.Tensor]) -> PendingWork:
        work = PendingWork(tensors)
        self._queue.put((run, work))
        return work

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            run, work = job
            try:
                run()
            except BaseException as error:  # handed to whoever waits for this collective
                work.finish(error)
            else:
                work.finish(None)
            self._completions.put(work)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._completions.close()


class _Completions:
    """Threads that complete works' futures (running the callbacks chained on them): an idle one takes
    the next, and where none is idle (each blocked in a callback) another is started."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = self._threads = 0

    def put(self, work: PendingWork) -> None:
        with self._lock:
            start = self._idle == 0
            if start:
                self._threads += 1
            else:
                self._idle -= 1  # that idle thread takes it
        self._queue.put(work)
        if start:
            threading.Thread(target=self._serve, name="sn-completions", daemon=True).start()

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            work.complete_future()
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)


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


class SnBackend(C10dBackend):
    """The backend of an "sn" process group: its collectives run through one shared-memory segment of the node.

    torch wraps it in a ``ProcessGroup`` of its own, as it wraps gloo's backend: that group holds what
    torch keeps per group (its name, for functional collectives and DeviceMesh; its device; its hooks).
    """

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        if not SHM_SAFE:
            raise CollectiveFailed("the 'sn' backend relies on x86-64's store order; use backend='gloo' here")
        store = _scoped_to_this_creation(store, size)
        self._rank, self._size = rank, size
        self._options = C10dBackend.Options("sn", timeout)
        machines = machines_of(store, rank, size)
        if len(set(machines)) == 1:
            self._collectives = Collectives(Segment(store, rank, size, timeout, SLOT_BYTES))
        else:  # in each machine's shared memory, then between the machines over gloo
            self._collectives = AcrossMachines(store, rank, size, timeout, machines, SLOT_BYTES)
        self._segment = self._collectives.segment
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("sn/gloo", store), rank, size, timeout)
        self._handed_to_gloo: set[str] = set()
        self._channel = _Channel()

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

    def allreduce(self, tensors, opts=None):
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._channel.submit(lambda: [_in_place(t, lambda t: self._collectives.all_reduce(t, op))
                                             for t in tensors], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        return self._channel.submit(lambda: [_in_place(t, lambda t: self._collectives.broadcast(t, root))
                                             for t in tensors], tensors)

    def allgather(self, output_lists, input_tensors, opts=None):
        for outputs, tensor in zip(output_lists, input_tensors):
            _check_gather(outputs, tensor, self._size)

        def run():
            for outputs, tensor in zip(output_lists, input_tensors):
                gathered = torch.empty((self._size, *tensor.shape), dtype=tensor.dtype)
                self._collectives.all_gather(list(gathered), tensor.contiguous())
                for output, part in zip(outputs, gathered):
                    output.copy_(part)
        return self._channel.submit(run, [t for outputs in output_lists for t in outputs])

    def _allgather_base(self, output, tensor, opts=None):
        return self._channel.submit(self._gather_into(output, tensor), [output])

    def _reduce_scatter_base(self, output, tensor, opts=None):
        return self._channel.submit(self._scatter_into(output, tensor, opts), [output])

    all_gather_single = _allgather_base  # what torch's all_gather_into_tensor calls
    reduce_scatter_single = _reduce_scatter_base  # and reduce_scatter_tensor

    def all_gather_single_coalesced(self, outputs, tensors, opts=None):
        runs = [self._gather_into(output, tensor) for output, tensor in zip(outputs, tensors)]
        return self._channel.submit(lambda: [run() for run in runs], list(outputs))

    def reduce_scatter_single_coalesced(self, outputs, tensors, opts=None):
        runs = [self._scatter_into(output, tensor, opts) for output, tensor in zip(outputs, tensors)]
        return self._channel.submit(lambda: [run() for run in runs], list(outputs))

    def _gather_into(self, output, tensor):
        """The all-gather of ``tensor`` into ``output``, to run on the channel (its sizes checked here)."""
        if output.numel() != tensor.numel() * self._size or output.dtype != tensor.dtype:
            raise CollectiveFailed(f"sn backend: all_gather_into_tensor needs an output of {self._size} x "
                                   f"{tensor.numel()} {tensor.dtype}, got {output.numel()} {output.dtype}")
        return lambda: _in_place(output, lambda out: self._collectives.all_gather(
            list(out.view(self._size, -1)), tensor.contiguous()), copy_in=False)

    def _scatter_into(self, output, tensor, opts):
        """The reduce-scatter of ``tensor`` into ``output``, to run on the channel (its sizes checked here)."""
        op = reduce_op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if tensor.numel() != output.numel() * self._size or output.dtype != tensor.dtype:
            raise CollectiveFailed(f"sn backend: reduce_scatter_tensor needs an input of {self._size} x "
                                   f"{output.numel()} {output.dtype}, got {tensor.numel()} {tensor.dtype}")
        return lambda: _in_place(output, lambda out: self._collectives.reduce_scatter(out, tensor.contiguous(), op),
                                 copy_in=False)

    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        return self._channel.submit(self._collectives.barrier, [])

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
        self._collectives = None  # its views of the segment would keep the mapping alive past close()
        self._segment.close()

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


def _scoped_to_this_creation(store, size: int):
    """The group's store under a prefix of this creation's own.

    torch gives a group the same name, hence the same store prefix, again after
    ``destroy_process_group()`` (the default group is "0" each time), and the keys of the earlier
    group of that name are still in the store: read as this one's, they would name a segment long
    unlinked. Every rank adds 1 to one counter when it starts making the group; none finishes before
    all have added (making the group waits for every rank), so the ranks of one creation agree on it.
    """
    joined = store.add("sn/created", 1)
    return dist.PrefixStore(f"sn/{(joined - 1) // size}", store)


def create_sn_group(store, rank: int, size: int, timeout: datetime.timedelta) -> SnBackend:
    """What ``torch.distributed.init_process_group(backend="sn")`` and ``new_group(backend="sn")`` call
    (registered as ``"sn"``); torch wraps what it returns in a ``ProcessGroup`` named by torch.

    Raises:
        CollectiveFailed: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose checking wrapper torch puts
            around a backend loses a Python one's methods (and asks it for sequence numbers).
    """
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        raise CollectiveFailed("the 'sn' backend does not run under TORCH_DISTRIBUTED_DEBUG=DETAIL; set it to INFO "
                               "or unset it (sn itself checks that every rank calls the same collective on the "
                               "same sizes and dtypes), or debug over backend='gloo'")
    return SnBackend(store, rank, size, timeout)
