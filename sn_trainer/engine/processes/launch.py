"""Start worker processes, relay their messages, watch that they progress, and tear every one down
on any failure.

Workers start warm: a fork server, started once per process (``warm_up``), imports torch and
the worker's code, then forks a fresh worker for each one a run needs. The server itself never
runs torch (no thread exists when it forks); each worker is new, pinned and sized for its run,
and exits with it. ``start_method="spawn"`` starts each worker from a fresh interpreter instead.
"""
from __future__ import annotations

import collections
import ctypes
import io
import logging
import marshal
import os
import pickle
import queue
import resource
import select
import signal
import threading
import time
import traceback
import types
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle
import psutil
import torch
import torch.multiprocessing as mp

from ...errors import InputError, WorkerFailed
from ..collectives import metric_states
from ..node.runtime import Runtime, default_runtime, forget_openmp_registrations
from . import forkserver
from .signals import StopFlags, stop_on_signals
from .stages import STAGES, WAITING

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# How long the launcher waits, after a worker failed because of a peer, to see that peer's own end.
_SETTLE_S = 2.0



def _code_reduce(code: types.CodeType):
    """A code object whole, its file name and line table included: cloudpickle names every file
    ``<dynamic-code>`` (for payloads that pickle the same wherever they were made), and a worker's
    traceback through the user's own code would then name no file and show no line."""
    return marshal.loads, (marshal.dumps(code),)  # the launcher and its workers run one interpreter


class WorkerPickler(cloudpickle.Pickler):
    """How a launch and its workers talk, both ways: cloudpickle, so that classes and functions of
    ``__main__`` (a notebook's cells, a script read from stdin, ``python -c``), lambdas and local
    functions travel by value, as Ray, Dask and joblib send them, and come back as the very classes
    they left as (a result holding a script's own optimizer); with multiprocessing's reducers, so
    that tensors in shared memory travel as handles, never as copies."""

    dispatch_table = collections.ChainMap({types.CodeType: _code_reduce}, ForkingPickler._extra_reducers,
                                          cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        if metric_states.is_metric(obj):  # a torchmetrics Metric: its states each worker's own
            return metric_states.reduce_with_private_states(obj)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    WorkerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(dumps(obj))


def pack(obj: Any) -> bytes:
    """Tensors and plain data as bytes: they cross the pipe by value, holding no shared memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


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


# A worker's exit code when the script it imports (as spawn does) starts training at import.
EXIT_TRAINS_AT_IMPORT = 78
TRAINS_AT_IMPORT = ("the script starts training when it is imported: each worker imports the main module, as "
                    "multiprocessing's spawn does, so put the script's training code under "
                    "`if __name__ == \"__main__\":`")


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


def starts_warm(start_method: str, runtime: Runtime) -> bool:
    """Whether workers with ``runtime`` can come from this process's fork server."""
    return (start_method == "forkserver" and forkserver.available()
            and forkserver.running_runtime() in (None, runtime))


def warm_up(start_method: str, runtime: Runtime) -> None:
    """Start the fork server now (if it is not running), so that it imports torch while this
    process does other work. It runs with ``runtime`` for good: the first call decides."""
    if starts_warm(start_method, runtime):
        if forkserver.running_runtime() is None:  # started late: sn_trainer.warm_up() would have done it early
            log.info("starting the warm workers' server: the first fit waits while it imports torch; call "
                     "sn_trainer.warm_up() before importing torch to overlap that with the script's own import")
        forkserver.start(runtime)


def _context(start_method: str, runtime: Runtime):
    if starts_warm(start_method, runtime):
        warm_up(start_method, runtime)
        return mp.get_context("forkserver")
    forkserver.stop_the_tracker_at_exit()
    return mp.get_context("spawn")


def _die_with_launcher(launcher_pid: int) -> None:
    """End this worker the moment its launcher ends, however it ends: no orphans, ever.

    The kernel kills it when its parent dies (PR_SET_PDEATHSIG); the parent is the fork server
    (or, spawned, the launcher itself). A forked worker also watches the launcher directly: the
    fork server outlives the launcher while any of its children holds its end of the server's
    pipe, which every worker does.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's teardown and the watch below still apply
        pass
    if os.getppid() != parent or not psutil.pid_exists(launcher_pid):  # gone before prctl took effect
        os._exit(1)
    if parent != launcher_pid:
        threading.Thread(target=_exit_with, args=(launcher_pid,), name="launcher-watch", daemon=True).start()


def _allow_open_files() -> None:
    """Raise this process's soft limit of open files to its hard one (the workers inherit it):
    every tensor shared with the workers holds a descriptor, and a model of a thousand tensors
    (resnet152) passes the soft limit of 1,024 many systems set."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an infinite hard limit some kernels refuse as a soft one
            pass


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Whether ``fd`` is readable within ``timeout_s`` (None: wait as long as it takes). poll, not
    select: a process holding a shared tensor's descriptor each has numbers past select's 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))


def _exit_with(pid: int) -> None:
    """Block until process ``pid`` ends, then end this process at once."""
    try:
        handle = os.pidfd_open(pid)  # readable when the process has ended (Linux 5.3+)
        if psutil.pid_exists(pid):
            _readable(handle, None)
    except (AttributeError, OSError):
        while psutil.pid_exists(pid):
            time.sleep(0.5)
    os._exit(1)


def _adopt_environment(environment: dict[str, str]) -> None:
    """Take the launcher's environment as it was at launch: a forked worker inherited its fork
    server's, from when that started (before a script's ``os.environ[...] = ...``, or Hydra's
    ``hydra.job.env_set``). What was preloaded into this process (``LD_PRELOAD``) stays as it is."""
    for name in set(os.environ) - set(environment) - {"LD_PRELOAD"}:
        del os.environ[name]
    for name, value in environment.items():
        if name != "LD_PRELOAD" and os.environ.get(name) != value:
            os.environ[name] = value


def _bootstrap(conn: Connection, launcher_pid: int) -> None:
    _die_with_launcher(launcher_pid)
    _allow_open_files()  # a warm worker's fork server began before the launcher raised its limit
    try:
        # The payload comes through the pipe, not as the process's arguments: its shared tensors are
        # then handed over one descriptor at a time, however many a model has.
        target, payload, stop, environment = pickle.loads(conn.recv_bytes())
        _adopt_environment(environment)
        if stop is not None:
            stop_on_signals(stop)  # a signal to a worker (or its group) stops the run at a step boundary
        result = target(payload, lambda message: _send(conn, ("message", message)))
        _send(conn, ("done", result))
    except BaseException as exc:  # noqa: BLE001 - anything a worker raises is reported, then it exits
        try:
            if isinstance(exc, InputError):  # the user's input, found unusable mid-run (a corrupt file)
                try:
                    _send(conn, ("refused", exc))
                except Exception:  # noqa: BLE001 - one that cannot be pickled is reported by its traceback
                    pass
            _send(conn, ("error", traceback.format_exc()))
        finally:
            os._exit(1)
    finally:
        conn.close()


class Watchdog:
    """What the launcher checks while the workers run: progress (hang) and memory."""

    def __init__(self, heartbeats: Heartbeats | None = None, timeout_s: float | None = None,
                 on_tick: Callable[[list[int]], None] | None = None):
        self.heartbeats, self.timeout_s, self.on_tick = heartbeats, timeout_s, on_tick


def launch(
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
    _allow_open_files()
    ctx = _context(start_method, runtime)
    procs, conns, inbox = [], [], None
    try:
        for _ in payloads:
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_bootstrap, args=(theirs, os.getpid()), daemon=True)
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
        if _readable(self.wakeup, 0):
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
