"""A collective's work in the "sn" backend: the ``dist.Work`` torch and DDP wait on, the group's thread
that runs collectives in the order they were called, and the threads that complete their futures.
"""
from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from ..errors import CollectiveFailed
from ..shm.group import Group


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


class Channel:
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

