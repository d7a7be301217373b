"""The fork server warm workers come from: started once per process, torch imported in it once.

Standard library only: the command line starts it before it imports torch itself, so that the
two imports run at the same time. Each worker is forked from it, new, and never reused.
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import select
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager

from ...node.runtime import Runtime, default_runtime, forget_openmp_registrations

# What the server imports before its first fork: this process's main module (as spawn would),
# the one that makes it ignore SIGTERM, the worker's code (and with it torch), and what torch.optim
# imports on an optimizer's first use.
PRELOAD = ["__main__", "sn_trainer.engine.processes._forkserver_preload", "sn_trainer.engine.worker", "torch._dynamo"]

# The runtime (allocator, OpenMP) the server of this process was started with: it cannot change
# afterwards.
_running: dict[str, Runtime] = {}
_tracker_stops: list[bool] = []  # whether this process ends its resource tracker at exit


def available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def running_runtime() -> Runtime | None:
    return _running.get("runtime")


def start(runtime: Runtime | None = None) -> None:
    """Start this process's fork server (once) with ``runtime``'s libraries preloaded.

    Not while a main module is imported into a new process (the server preloads it, as spawn
    does): a script that calls this unguarded by ``if __name__ == "__main__"`` starts no chain.
    """
    if not available() or _running or getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    runtime = runtime or default_runtime()
    preload = PRELOAD if _main_is_a_file() else [m for m in PRELOAD if m != "__main__"]
    # What the user imported that is slow to import (torchmetrics: seconds), once here rather than in every worker.
    heavy = [name for name in ("torchvision", "torchmetrics") if name in sys.modules]
    multiprocessing.set_forkserver_preload(preload + heavy)
    _own_temp_dir()
    with preloading(runtime.libraries()):
        multiprocessing.forkserver.ensure_running()
    _running["runtime"] = runtime
    stop_the_tracker_at_exit()
    atexit.register(_stop)  # first at exit (handlers run last registered first): the server holds the tracker's pipe


def _main_is_a_file() -> bool:
    """Whether the main module is a file a new process can import (not a script read from stdin,
    nor ``python -c``: their code reaches the workers by value)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(path) and os.path.isfile(path)


@contextmanager
def main_as_a_file_only():
    """While processes start: a main module whose ``__file__`` names no file (``<stdin>``) shows
    none, so that multiprocessing does not tell the new process to run it again."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hidden = path is not None and not _main_is_a_file()
    if hidden:
        del main.__file__
    try:
        yield
    finally:
        if hidden:
            main.__file__ = path


@contextmanager
def preloading(libraries: Sequence[str]):
    """Processes started inside run with ``libraries`` preloaded; this process's environment is restored."""
    before = os.environ.get("LD_PRELOAD")
    if libraries:
        os.environ["LD_PRELOAD"] = ":".join([*libraries, before] if before else libraries)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def _own_temp_dir() -> None:
    """Give multiprocessing (the server's socket) a temporary directory named after this process.

    Its own would be an anonymous ``pymp-*`` that a SIGKILLed launcher leaves behind; this one
    the next run recognises as a dead process's and removes (``trainer._rendezvous_dir``).
    """
    config = getattr(multiprocessing.current_process(), "_config", None)
    if config is not None and "tempdir" not in config:
        config["tempdir"] = tempfile.mkdtemp(prefix=f"sn_trainer-{os.getpid()}-mp-")
        # Removed at exit after multiprocessing's own finalizers, as it removes its own.
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(config["tempdir"], True), exitpriority=-100)


def _stop() -> None:
    """At exit, end the server and reap it, rather than leave it to notice on its own.

    It holds nothing worth a graceful exit (its own teardown of torch takes a second or two),
    and whoever watches this process's children sees none left once this process is gone; what
    Intel's OpenMP registered for it, when preloaded, goes with it.
    """
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (OSError, ChildProcessError):
        pass
    forget_openmp_registrations([pid])


# How long the exit waits for multiprocessing's resource tracker to finish: it unlinks what a
# killed worker registered and left, then ends.
TRACKER_ENDS_S = 5.0


def stop_the_tracker_at_exit() -> None:
    """Once per process: at exit, end multiprocessing's resource tracker and reap it.

    Started with the first worker (either start method), it ends by itself only when it reads the
    end of its pipe, after this process is gone: whoever watches this run's processes would still
    see it, running, just after the run ended.
    """
    if not _tracker_stops:
        _tracker_stops.append(True)
        atexit.register(_stop_tracker)


def _stop_tracker() -> None:
    tracker = multiprocessing.resource_tracker._resource_tracker
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    tracker._fd = tracker._pid = None
    try:
        ended = os.pidfd_open(pid)
    except OSError:
        ended = None
    os.close(fd)  # the tracker reads its pipe's end once every worker, and the server, is gone
    if ended is None:
        return
    try:
        # Bounded: a process that still holds the pipe (none should) must not hold up this exit.
        if select.select([ended], [], [], TRACKER_ENDS_S)[0]:
            os.waitpid(pid, 0)
    except (OSError, ChildProcessError):
        pass
    finally:
        os.close(ended)


def leave(code: int) -> None:
    """End this process now: exit handlers run and streams are flushed, but Python's own teardown,
    which with torch loaded takes seconds and frees nothing an exit does not, is skipped."""
    import logging

    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None:
        sys.exit(code)
    run_exit_handlers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
