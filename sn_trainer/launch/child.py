"""One local rank under sn_trainer.launch: pin this process to the cores planned for it, set its
intra-op threads, then run the user's program as torchrun would have run it.

Standard library only until the threads are set: OpenMP reads its thread count when torch loads.
Imports are absolute: torchrun's ``--run-path`` runs this file with runpy.
"""
from __future__ import annotations

import os
import runpy
import sys

# What the launcher decided once, handed to every rank through the environment (plan.py writes them).
CPUS_VARIABLE = "SN_LAUNCH_CPUS"  # each local rank's logical CPUs: "0,1;2,3" (absent: not pinned)
THREADS_VARIABLE = "SN_LAUNCH_THREADS"


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


def main(argv: list[str]) -> None:
    target, mode, *arguments = argv
    threads = settle(os.environ)
    if mode == "exec":  # --no-python: the program inherits the affinity and the thread variables
        os.execvp(target, [target, *arguments])
    import torch

    torch.set_num_threads(threads)
    sys.argv = [target, *arguments]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if mode == "script":  # as `python script.py`: the script's folder first on the path
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
