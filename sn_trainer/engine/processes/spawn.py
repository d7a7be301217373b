"""Start one worker process and run its first lines: warm from the fork server or spawned cold,
tied to the launcher's life (no orphans), with the launcher's open-files limit and environment, then
the worker's target, whose result or error goes back through the pipe.

Workers start warm: a fork server, started once per process (``warm_up``), imports torch and
the worker's code, then forks a fresh worker for each one a run needs. The server itself never
runs torch (no thread exists when it forks); each worker is new, pinned and sized for its run,
and exits with it. ``start_method="spawn"`` starts each worker from a fresh interpreter instead.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import resource
import select
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import psutil
import torch.multiprocessing as mp

from ...errors import InputError
from ...node.runtime import Runtime
from . import forkserver
from .pickling import send
from .signals import stop_on_signals

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# A worker's exit code when the script it imports (as spawn does) starts training at import.
EXIT_TRAINS_AT_IMPORT = 78
TRAINS_AT_IMPORT = ("the script starts training when it is imported: each worker imports the main module, as "
                    "multiprocessing's spawn does, so put the script's training code under "
                    "`if __name__ == \"__main__\":`")


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


def context(start_method: str, runtime: Runtime):
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


def _own_session() -> None:
    """Lead a session of its own. Where the kernel shares CPU time between sessions before the
    processes in them (autogroup: /proc/sys/kernel/sched_autogroup_enabled), all of a run's workers
    in the launcher's session weigh together as much as one busy program in a session of its own:
    each worker, beside such a program, gets a third of its core where a process of its own would
    get half. Signals still reach the run through the launcher, still in its caller's session: it
    sets the stop flags every worker reads, and pauses and continues the workers with itself
    (signals.paused_together); the kernel still ends a worker with its parent, and the watch above
    with its launcher."""
    try:
        os.setsid()
    except OSError:  # a session leader already (it cannot be here: it was forked or spawned)
        pass


def allow_open_files() -> None:
    """Raise this process's soft limit of open files to its hard one (the workers inherit it):
    every tensor shared with the workers holds a descriptor, and a model of a thousand tensors
    (resnet152) passes the soft limit of 1,024 many systems set."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an infinite hard limit some kernels refuse as a soft one
            pass


def readable(fd: int, timeout_s: float | None) -> bool:
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
            readable(handle, None)
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


def bootstrap(conn: Connection, launcher_pid: int) -> None:
    _die_with_launcher(launcher_pid)
    _own_session()
    allow_open_files()  # a warm worker's fork server began before the launcher raised its limit
    try:
        # The payload comes through the pipe, not as the process's arguments: its shared tensors are
        # then handed over one descriptor at a time, however many a model has.
        target, payload, stop, environment = pickle.loads(conn.recv_bytes())
        _adopt_environment(environment)
        if stop is not None:
            stop_on_signals(stop)  # a signal to a worker (or its group) stops the run at a step boundary
        result = target(payload, lambda message: send(conn, ("message", message)))
        send(conn, ("done", result))
    except BaseException as exc:  # noqa: BLE001 - anything a worker raises is reported, then it exits
        try:
            if isinstance(exc, InputError):  # the user's input, found unusable mid-run (a corrupt file)
                try:
                    send(conn, ("refused", exc))
                except Exception:  # noqa: BLE001 - one that cannot be pickled is reported by its traceback
                    pass
            send(conn, ("error", traceback.format_exc()))
        finally:
            os._exit(1)
    finally:
        conn.close()
