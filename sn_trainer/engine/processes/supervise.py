"""Run workers to their end: start one process per payload, relay their messages, watch that they
progress (heartbeats, the watchdog), say how each one that failed ended, and tear every one down on
any failure."""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from ...errors import InputError, WorkerFailed
from ...node.runtime import Runtime, default_runtime, forget_openmp_registrations
from . import forkserver
from .pickling import dumps
from .signals import StopFlags, paused_together
from .spawn import EXIT_TRAINS_AT_IMPORT, TRAINS_AT_IMPORT, allow_open_files, bootstrap, context, readable
from .stages import STAGES, WAITING

log = logging.getLogger(__name__)

# How long the launcher waits, after a worker failed because of a peer, to see that peer's own end.
_SETTLE_S = 2.0


class Heartbeats:
    """Shared [workers, 3] float64: each worker's step, stage and when it entered that stage.

    Workers write it as they move from stage to stage (a few stores a step); the launcher
    reads it to tell a worker that stopped making progress, and where it stopped.
    """

    def __init__(self, block: torch.Tensor):
        self.block = block
        self._rows = block.numpy()  # numpy: a scalar store costs ~100 ns

    @classmethod
    def allocate(cls, workers: int) -> "Heartbeats":
        block = torch.zeros(workers, 3, dtype=torch.float64).share_memory_()
        block[:, 2] = time.monotonic()
        return cls(block)

    def __reduce__(self):
        return (Heartbeats, (self.block,))

    def beat(self, rank: int, step: int, stage: str) -> None:
        row = self._rows[rank]
        row[0], row[1], row[2] = step, STAGES.index(stage), time.monotonic()

    @contextmanager
    def waiting(self, rank: int):
        """Inside a stage, a wait for the peers (batch norm's sums in a forward pass): marked
        ``sync`` while it lasts, then back in the stage it interrupted."""
        row = self._rows[rank]
        stage = row[1]
        row[1], row[2] = STAGES.index("sync"), time.monotonic()
        try:
            yield
        finally:
            row[1], row[2] = stage, time.monotonic()

    def stalled(self, timeout_s: float, busy_until: float = 0.0) -> list[tuple[int, str]]:
        """Workers without progress for ``timeout_s`` that are not waiting for a peer. While only
        waiting ones are, nobody yet: the peer they wait for went quiet later, and its turn comes;
        when every worker is stuck waiting, all of them. Time before ``busy_until`` (when the
        launcher last came back from the run's callbacks, which the workers may wait for) counts
        against no worker."""
        now = time.monotonic()
        rows = self._rows.tolist()
        quiet = [(rank, int(step), STAGES[int(stage)], now - max(since, busy_until))
                 for rank, (step, stage, since) in enumerate(rows)]
        stuck = [s for s in quiet if s[3] > timeout_s]
        causes = [s for s in stuck if s[2] not in WAITING]
        if not causes and len(stuck) == len(rows):
            causes = stuck
        return [(rank, f"made no progress for {seconds:.0f} s (worker_timeout={timeout_s:g}), in step {step + 1}, "
                       f"stage {stage}") for rank, step, stage, seconds in causes]


def describe_exit(exitcode: int | None) -> str:
    if exitcode == EXIT_TRAINS_AT_IMPORT:
        return TRAINS_AT_IMPORT
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode} before reporting a result"


class Watchdog:
    """What the launcher checks while the workers run: progress (hang) and memory."""

    def __init__(self, heartbeats: Heartbeats | None = None, timeout_s: float | None = None,
                 on_tick: Callable[[list[int]], None] | None = None):
        self.heartbeats, self.timeout_s, self.on_tick = heartbeats, timeout_s, on_tick


def run_workers(
    target: Callable[[Any, Callable[[Any], None]], Any],
    payloads: list[Any],
    on_message: Callable[[int, Any], None] | None = None,
    watchdog: Watchdog | None = None,
    stop: StopFlags | None = None,
    where: str = "",
    tick_s: float = 1.0,
    start_method: str = "forkserver",
    runtime: Runtime | None = None,
) -> list[Any]:
    """Run ``target(payload, send)`` in one new process per payload; return their results.

    ``send(message)`` in a worker delivers ``on_message(rank, message)`` here. About every
    ``tick_s`` seconds the watchdog gets the workers' pids (memory sampling) and checks their
    heartbeats. ``where`` prefixes worker names in errors (the node, under torchrun). Workers run
    with ``runtime``: from the fork server when it runs that one, else spawned with it.

    Raises:
        WorkerFailed: as soon as one worker raises, dies or hangs; by then every worker is dead.
        InputError: the one a worker raised (a data file it could not read), itself, once every worker is dead.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        # This process is a worker importing the script: a known exit code, rather than
        # multiprocessing's bootstrapping error, lets the launcher say what the user has to change.
        os._exit(EXIT_TRAINS_AT_IMPORT)
    runtime = runtime or default_runtime()
    allow_open_files()
    ctx = context(start_method, runtime)
    procs, conns, inbox = [], [], None
    try:
        for _ in payloads:
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=bootstrap, args=(theirs, os.getpid()), daemon=True)
            spawned = ctx.get_start_method() == "spawn"
            with forkserver.preloading(runtime.libraries() if spawned else []), forkserver.main_as_a_file_only():
                proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(mine)
        environment = dict(os.environ)  # as it is now: a warm worker's server was started earlier
        for conn, payload in zip(conns, payloads):
            sent = dumps((target, payload, stop, environment))
            try:
                conn.send_bytes(sent)
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died before reading its payload: supervision reports how
        inbox = _Inbox(conns)
        with paused_together(lambda: [proc.pid for proc in procs if proc.exitcode is None]):
            return _supervise(procs, inbox, on_message, watchdog or Watchdog(), tick_s, where)
    finally:
        _teardown(procs)
        if inbox is not None:
            inbox.close()  # its readers end: every worker is gone
        for conn in conns:
            conn.close()


class _Inbox:
    """Every worker's messages, each pipe read by a thread of its own.

    A message is read whole or not at all, and a worker stopped halfway through sending one (a
    large checkpoint part, when SIGSTOP strikes) would block a reader forever: here it blocks its
    own thread, while the launcher goes on watching heartbeats. The threads wake the launcher
    through a pipe it waits on beside the workers' sentinels.
    """

    def __init__(self, conns: list[Connection]):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup, self._wake = os.pipe()
        self._threads = [threading.Thread(target=self._read, args=(rank, conn), name=f"inbox-{rank}", daemon=True)
                         for rank, conn in enumerate(conns)]
        for thread in self._threads:
            thread.start()

    def _read(self, rank: int, conn: Connection) -> None:
        try:
            while True:
                self._queue.put((rank, *pickle.loads(conn.recv_bytes())))
                os.write(self._wake, b".")
        except (EOFError, OSError):  # the worker has ended (or its pipe was closed at teardown)
            pass

    def take(self) -> list[tuple[int, str, Any]]:
        """The messages read so far: (rank, kind, body)."""
        if readable(self.wakeup, 0):
            os.read(self.wakeup, 1 << 16)
        taken = []
        while not self._queue.empty():
            taken.append(self._queue.get())
        return taken

    def finish(self, rank: int, timeout_s: float = 5.0) -> None:
        """Wait until worker ``rank``'s pipe has been read to its end (the worker has exited)."""
        self._threads[rank].join(timeout_s)

    def close(self) -> None:
        for thread in self._threads:
            thread.join(1.0)
        os.close(self.wakeup)
        os.close(self._wake)


def _supervise(procs, inbox: _Inbox, on_message, watchdog: Watchdog, tick_s, where) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    refusals: dict[int, InputError] = {}  # what the workers found wrong with the user's input, by rank
    running = set(range(len(procs)))

    busy_until = 0.0  # when the launcher last came back from on_message (the run's callbacks)

    def deliver() -> None:
        nonlocal busy_until
        for rank, kind, body in inbox.take():
            if kind == "message" and on_message is not None:
                on_message(rank, body)
                busy_until = time.monotonic()
            elif kind == "done":
                results[rank] = body
            elif kind == "error":
                failures.append((rank, body))
            elif kind == "refused":
                refusals[rank] = body

    def watch(timeout_s: float) -> None:
        """Deliver what arrives within ``timeout_s``, and reap the workers that ended meanwhile."""
        sentinels = {procs[r].sentinel: r for r in running}
        ready = wait([inbox.wakeup, *sentinels], timeout=timeout_s)
        deliver()
        for rank in [sentinels[r] for r in ready if r in sentinels]:
            procs[rank].join()
            inbox.finish(rank)
            deliver()  # messages sent just before exiting
            running.discard(rank)
            if rank not in results and not any(r == rank for r, _ in failures):
                failures.append((rank, describe_exit(procs[rank].exitcode)))

    while running and not failures:
        watch(tick_s)
        if running and not failures:
            if watchdog.on_tick is not None:
                watchdog.on_tick([procs[r].pid for r in running])
            if watchdog.heartbeats is not None and watchdog.timeout_s is not None:
                failures.extend(watchdog.heartbeats.stalled(watchdog.timeout_s, busy_until))
    # A worker that stopped because a peer ended can tell before the launcher sees that peer's exit: the
    # peer's end is the cause to report, so it gets a moment to be seen.
    # Workers that refuse one input together (a verified step that differs) all end at once: worker
    # 0's refusal, which says the most, gets the same moment to arrive.
    settle_by = time.monotonic() + _SETTLE_S
    while running and failures and (refusals or all(_follows_a_peer(detail) for _, detail in failures)):
        if (left := settle_by - time.monotonic()) <= 0:
            break
        watch(left)
    failures.sort(key=lambda failure: _follows_a_peer(failure[1]))
    if refusals:  # bad input, not a failed worker: no restart mends it, and the user is told it in one line
        raise refusals[min(refusals)]  # the lowest rank's: where all refuse at once, worker 0 says the most
    if failures:
        rank, detail = failures[0]
        raise WorkerFailed(rank, detail, failures[1:], where=where)
    return [results[r] for r in range(len(procs))]


def _follows_a_peer(detail: str) -> bool:
    """Whether a worker's failure is its collectives' report of a peer's (a CollectiveFailed)."""
    return "CollectiveFailed: " in detail


def _teardown(procs) -> None:
    """Kill whatever still runs and reap it. Workers hold nothing that a kill could corrupt, and
    what Intel's OpenMP registered for them goes with them (they end without its exit handler)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)
    forget_openmp_registrations(proc.pid for proc in procs if proc.exitcode is not None)
