"""Command line: ``python -m sn_trainer.launch [torchrun's flags] [ours] script.py args``.

torchrun's own parser, rendezvous, elastic agent and restarts run unchanged; what differs is the
program each rank starts: sn_trainer.launch.child, which pins the rank and sets its threads
before it runs the user's script.
"""
from __future__ import annotations

import os
import sys
from argparse import ArgumentParser, Namespace
from pathlib import Path

from ..config import ALLOCATORS, OPENMPS
from ..node.runtime import Runtime, default_runtime, forget_ended_openmp_registrations, openmp_registrations
from ..node.topology import read_topology
from ..errors import ConfigError
from . import child, cpu_backend
from .ranks import LaunchPlan, resolve


def parser() -> ArgumentParser:
    """torchrun's parser with the launcher's flags added (before the script, as torchrun's are)."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser()
    parsed.prog = "python -m sn_trainer.launch"
    # No abbreviations: a script argument such as --n or --nproc (after the script, REMAINDER)
    # would otherwise be taken as, or refused as ambiguous with, a launcher option.
    parsed.allow_abbrev = False
    parsed.description = ("torchrun, each local rank pinned to its own physical cores with as many intra-op threads. "
                          "--nproc-per-node=auto: the physical cores this process may use / --threads-per-proc.")
    default = default_runtime()
    ours = parsed.add_argument_group("sn_trainer.launch (CPU placement)")
    ours.add_argument("--threads-per-proc", "--threads_per_proc", type=int, default=None,
                      help="intra-op threads (and physical cores) per process; default: OMP_NUM_THREADS if set, "
                           "else 1 with --nproc-per-node=auto, else the usable cores / processes")
    ours.add_argument("--allocator", choices=ALLOCATORS, default=default.allocator,
                      help="the processes' memory allocator, preloaded (default: %(default)s)")
    ours.add_argument("--openmp", choices=OPENMPS, default=default.openmp,
                      help="the processes' OpenMP runtime: gnu (torch's own) or intel (libiomp5, preloaded)")
    ours.add_argument("--no-pin", "--no_pin", dest="pin", action="store_false",
                      help="leave the processes' CPU affinity to the OS (threads are still set)")
    ours.add_argument("--cpu-backend", "--cpu_backend", choices=cpu_backend.CHOICES, default=None,
                      help="make every CPU process group the program makes over gloo (named, or torch's default) "
                           "on this backend instead, the program unchanged (default: the program's choice)")
    parsed.error = _usage_error  # one line, as every sn_trainer command line says what is wrong
    return parsed


def _usage_error(message: str) -> None:
    _exit(2, f"error: {message} (python -m sn_trainer.launch --help lists the flags)")


def _exit(code: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def refuse_conflicts(args: Namespace) -> None:
    """torchrun's flags that would undo the pinning, refused before anything starts."""
    if not args.pin:
        return
    if getattr(args, "numa_binding", None) is not None:
        raise ConfigError("--numa-binding binds ranks to their GPUs' NUMA nodes, which would replace the launcher's "
                          "pinning to physical cores; drop it, or add --no-pin to keep torchrun's binding")
    if getattr(args, "virtual_local_rank", False):
        raise ConfigError("--virtual-local-rank sets every rank's LOCAL_RANK to 0, so the launcher cannot tell the "
                          "ranks' cores apart; drop it, or add --no-pin")


def plan_for(args: Namespace) -> LaunchPlan:
    refuse_conflicts(args)
    return resolve(str(args.nproc_per_node), args.threads_per_proc, args.pin, Runtime(args.allocator, args.openmp),
                   read_topology(), dict(os.environ), args.cpu_backend)


def hand_to_child(args: Namespace) -> None:
    """Make torchrun start sn_trainer.launch.child in each rank, the user's program after it.

    The user's program comes first after the child (``-m`` joined to the child's name): torchrun
    names the first argument that is no flag in its failure report, and that stays the user's.
    """
    if args.run_path:
        mode = "run_path"
    elif args.no_python:
        mode, args.no_python = "exec", False
    else:
        mode = "module" if args.module else "script"
    args.training_script_args = [args.training_script, mode, *args.training_script_args]
    if args.run_path:  # torchrun runs a file with runpy in the rank's own process
        args.training_script = str(Path(child.__file__))
    else:
        args.module, args.training_script = False, f"-m{child.__name__}"


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    args = parser().parse_args(argv)
    try:
        plan = plan_for(args)
    except ConfigError as exc:
        _exit(2, f"error: {exc}")
    args.nproc_per_node = str(plan.nproc)
    os.environ.update(plan.environment(os.environ.get("LD_PRELOAD") or None))
    for line in plan.lines():
        print(line, file=sys.stderr, flush=True)
    hand_to_child(args)
    # Intel's OpenMP registers each rank in /dev/shm and removes that only in its exit handler,
    # which a rank misses when the agent kills it (and the child's ending skips): removed here.
    before = openmp_registrations() if plan.runtime.openmp == "intel" else None
    try:
        record(run)(args)
    finally:
        if before is not None:
            forget_ended_openmp_registrations(before)


if __name__ == "__main__":
    main()
