"""One local rank under sn_trainer.launch: pin this process to the cores planned for it, set its
intra-op threads, then run the user's program as torchrun would have run it, and end the process.

Standard library only until the threads are set: OpenMP reads its thread count when torch loads.
Imports are absolute: torchrun's ``--run-path`` runs this file with runpy.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading

# What the launcher decided once, handed to every rank through the environment (plan.py writes them).
CPUS_VARIABLE = "SN_LAUNCH_CPUS"  # each local rank's logical CPUs: "0,1;2,3" (absent: not pinned)
THREADS_VARIABLE = "SN_LAUNCH_THREADS"
CPU_BACKEND_VARIABLE = "SN_LAUNCH_CPU_BACKEND"  # --cpu-backend: "sn" (absent: the program's own choice)


def planned_cpus(environment: dict[str, str], local_rank: int) -> list[int] | None:
    """The logical CPUs planned for ``local_rank``; None when the launcher pins nothing."""
    text = environment.get(CPUS_VARIABLE)
    if not text:
        return None
    per_rank = text.split(";")
    if local_rank >= len(per_rank):
        raise SystemExit(f"error: local rank {local_rank} has no cores planned (the launcher planned "
                         f"{len(per_rank)} ranks)")
    return [int(cpu) for cpu in per_rank[local_rank].split(",")]


def settle(environment: dict[str, str]) -> int:
    """Pin this process as planned and return its intra-op threads."""
    cpus = planned_cpus(environment, int(environment.get("LOCAL_RANK", "0")))
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return int(environment[THREADS_VARIABLE])


def run(target: str, mode: str) -> int:
    """Run the user's program as ``python`` would, and return the exit status it would end with
    (an uncaught exception printed as Python prints it)."""
    try:
        if mode == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if mode == "script":  # as `python script.py`: the script's folder first on the path
                sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        return exit_status(stop.code)
    except KeyboardInterrupt:
        raise  # Python's own ending for it: killed by SIGINT, as the agent expects
    except BaseException:  # noqa: BLE001 - reported as Python reports it, then the exit status says it
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def exit_status(code: object) -> int:
    """What ``sys.exit(code)`` ends a process with: None 0, a number itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def leave(status: int) -> None:
    """End the rank as Python's exit would (the program's threads joined, exit handlers run,
    streams flushed) but without the interpreter's teardown.

    gloo's worker threads outlive the program: each releases its last collective after the caller
    has stopped waiting for it, and a collective made in a backward pass holds a Python object
    (torch stashes the caller's context in the thread's state). Released during the teardown,
    that object needs the GIL, which Python 3.11 answers by ending the thread inside a C++
    destructor: std::terminate, SIGABRT. A rank pinned to its own core loses that race whenever
    its main thread keeps the core; ending the process without a teardown leaves nothing to race.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # the program's non-daemon threads, as Python waits for them at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):  # torchrun's -u leaves C's stdio unbuffered; the program's may not be
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # replaced, or closed by the program
            pass
    os._exit(status & 0xFF)


def main(argv: list[str]) -> None:
    target, mode, *arguments = argv
    threads = settle(os.environ)
    if mode == "exec":  # --no-python: the program inherits the affinity and the thread variables
        os.execvp(target, [target, *arguments])
    import torch

    torch.set_num_threads(threads)
    if os.environ.get(CPU_BACKEND_VARIABLE):
        from sn_trainer.launch import cpu_backend

        cpu_backend.redirect(cpu_backend.announce(int(os.environ.get("LOCAL_RANK", "0"))))
    sys.argv = [target, *arguments]
    if mode == "run_path":  # torchrun runs this file in a process of its making: it reports and ends it
        runpy.run_path(target, run_name="__main__")
        return
    leave(run(target, mode))


if __name__ == "__main__":
    main(sys.argv[1:])
