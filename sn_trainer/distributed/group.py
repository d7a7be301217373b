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
import queue
import sys
import threading
import time

import psutil
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from ..errors import CollectiveFailed
from ..shm.chunked import OPS
from ..shm.group import SHM_SAFE, Group
from .machines import AcrossMachines, group_on_store, machines_of

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
# Under torchrun, how long a rank that found a peer dead waits for the agent to collect it (torchrun looks
# every --monitor-interval, 0.1 s by default) before it raises.
AGENT_REAPS_S = 10.0
DYING_S = 1.0  # how long a killed process takes to end, at most


_FINISHED = threading.Event()  # the done event of every work run in its caller's thread
_FINISHED.set()


class PendingWork(dist.Work):
    """A collective: done when it has run. Its future (what DDP's buckets and communication hooks chain
    on) holds its tensors, or, when it failed, the error, as a C++ future DDP reads (torch's Python
    ``Future.set_exception`` would hand DDP a "result" holding no tensors)."""

    _futures = threading.Lock()  # guards each work's future against its completion (rarely contended)

    def __init__(self, tensors: list[torch.Tensor], kind: str, group: Group, inline: bool = False):
        super().__init__()
        self._tensors, self._kind, self._group = tensors, kind, group
        self._done = _FINISHED if inline else threading.Event()  # inline: run before anyone can wait
        self._error: BaseException | None = None
        self._outcome: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        self._completed = False

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        if self._done is not _FINISHED:
            self._done.set()

    def has_future(self) -> bool:
        return self._outcome is not None

    def complete_future(self) -> None:
        """Complete the future once both it exists and the collective is done (either side may be last)."""
        with self._futures:
            if self._outcome is None or not self._done.is_set() or self._completed:
                return
            self._completed = True
        self._outcome.set_result(None)

    def _tensors_or_error(self, _outcome) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        with self._futures:
            if self._future is None:
                self._outcome = torch.futures.Future()
                self._future = self._outcome.then(self._tensors_or_error)
        self.complete_future()
        return self._future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the collective; past ``timeout`` (if given and not zero), give up on it: the group is
        broken for every rank, and this raises.

        Raises:
            CollectiveFailed: the collective failed, or did not finish within ``timeout``.
        """
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):
            self._group.break_group(f"sn: rank {self._group.rank} gave up waiting for its {self._kind} after "
                                    f"{seconds:g} s (Work.wait(timeout=...))")
            self._done.wait()  # the collective sees the group broken at once and stops
            if self._error is None:  # it completed just as the wait gave up: the group is broken all the same
                raise CollectiveFailed(self._group.reason(self._group.rank))
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


class _Channel:
    """The group's collectives, one at a time in the order they were called. Asynchronous ones run on a
    thread of the group's own, so that a bucket's all-reduce proceeds while the backward pass computes
    the next buckets' gradients; a small synchronous one runs in the caller's thread when nothing is
    queued before it.

    Futures are completed on other threads (``_Completions``): a callback chained on one may wait for a
    later collective of this channel (PowerSGD's hook does), which would never run if the callback held
    the channel's thread.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._completions = _Completions()
        self._lock, self._running = threading.Lock(), threading.Lock()
        self._pending = 0  # collectives submitted and not finished
        self._thread: threading.Thread | None = None

    def submit(self, run, tensors: list[torch.Tensor], kind: str, group: Group, inline: bool) -> PendingWork:
        """The work of a collective ``run`` that runs now in this thread (``inline``, where nothing is
        queued before it) or on the channel's thread."""
        with self._lock:
            inline = inline and self._pending == 0
            self._pending += 1
            work = PendingWork(tensors, kind, group, inline)
            if not inline:
                self._queue.put((run, work))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name="sn-collectives", daemon=True)
                    self._thread.start()
        if inline:  # nobody holds the work yet: no future to complete
            with self._running:
                work.finish(_outcome(run))
            with self._lock:
                self._pending -= 1
        return work

    def _execute(self, run, work: PendingWork) -> None:
        with self._running:
            work.finish(_outcome(run))
        with self._lock:
            self._pending -= 1
        if work.has_future():
            self._completions.put(work)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            self._execute(*job)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        self._completions.close()


def _outcome(run) -> BaseException | None:
    """Run a collective: None, or the error to hand whoever waits for it."""
    try:
        run()
    except BaseException as error:  # noqa: BLE001 - raised to the waiter, in its thread
        return error
    return None


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
        machines = machines_of(store, rank, size)
        if len(set(machines)) == 1:
            self._collectives = group_on_store(store, rank, size, timeout, SLOT_BYTES)
        else:  # in each machine's shared memory, then between the machines over gloo
            self._collectives = AcrossMachines(store, rank, size, timeout, machines, SLOT_BYTES)
        self._group = self._collectives.group
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun's agent
            self._group.before_naming_gone = _reaped_by_the_agent
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
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


def _reaped_by_the_agent(pid: int, message: str) -> None:
    """Say ``message`` on stderr, and return once the parent of dead rank ``pid``, where it is this rank's
    parent too (torchrun's agent), has collected its exit; ``AGENT_REAPS_S`` at most, and ``DYING_S`` where
    the process does not end (a rank that left the group and runs on). The agent stops this rank meanwhile.

    The agent names as the run's root cause the first rank it finds ended (by whole seconds, then by local
    rank): a survivor that raised at once, within milliseconds of the death, could end before the agent's
    next look and be named instead of the rank that died.
    """
    started = time.monotonic()
    try:
        peer = psutil.Process(pid)
        if peer.ppid() != os.getppid():  # not a sibling (another machine's pid, another namespace's)
            return
        print(message, file=sys.stderr, flush=True)
        while True:  # a process's end and its reaping have no event another process can wait on
            waited = time.monotonic() - started
            if waited > AGENT_REAPS_S or (waited > DYING_S and peer.status() != psutil.STATUS_ZOMBIE):
                return
            time.sleep(0.002)
            peer.status()  # raises once it is reaped
    except psutil.Error:  # reaped, or gone
        return


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
