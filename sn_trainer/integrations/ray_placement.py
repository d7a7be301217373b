"""Where each Ray Train worker runs under ``SNConfig``: its machine, its cores and its intra-op threads.

Ray starts one process per worker and pins nothing. Here the workers that share a machine (as the
"sn" backend tells machines apart: host name, boot id, IPC namespace) are numbered in world-rank
order, and that number takes its share of the machine's physical cores, as ``sn_trainer.launch``
gives a local rank its share (``node.topology.plan_pinning``: one logical CPU per core, in NUMA
order). A worker's threads are its Ray CPU allotment, as many as its share of the physical cores
holds. Ray is not imported here: these functions run inside the workers, and the decisions are
plain functions of what they are given.
"""
from __future__ import annotations

import math
import os
import socket
import sys
from dataclasses import dataclass

from ..errors import ConfigError
from ..node.topology import Topology, plan_pinning, read_topology

# What a worker reports before anything is decided: its machine as the "sn" backend sees it, its host
# name (for messages) and the physical cores it may use.
Machine = tuple[str, str, int]


@dataclass(frozen=True)
class WorkerPlacement:
    """What ``SNConfig`` chose for one Ray Train worker."""

    local_rank: int  # its place among the workers of its machine, in world-rank order
    local_world_size: int  # the workers on its machine
    cpus: tuple[int, ...]  # the logical CPUs it is pinned to, one per physical core
    threads: int  # its intra-op threads
    line: str | None = None  # what it logged for its machine (local rank 0 only)


_PLACED: list[WorkerPlacement] = []  # this process's placement, once SNConfig has made it


def whole_cpus(resources: dict) -> int:
    """A worker's CPU allotment (Ray's ``resources_per_worker``), as whole cores.

    Raises:
        ConfigError: a GPU is asked for, or the CPUs are not a whole number of at least one.
    """
    if resources.get("GPU", 0):
        raise ConfigError("SNConfig trains on CPUs: ScalingConfig(use_gpu=True) gives each worker a GPU; use "
                          "ScalingConfig(use_gpu=False) with SNConfig, or Ray's own TorchConfig() for GPU training")
    cpus = resources.get("CPU", 1)
    if cpus < 1 or not math.isclose(cpus, round(cpus)):
        raise ConfigError(f"SNConfig pins each worker to whole physical cores, and resources_per_worker="
                          f"{{'CPU': {cpus}}} is {'a part of one' if cpus < 1 else 'not a whole number'}: give "
                          f"each worker a whole number of CPUs, e.g. ScalingConfig(resources_per_worker="
                          f"{{'CPU': {max(1, math.floor(cpus))}}})")
    return int(round(cpus))


def machine() -> Machine:
    """This worker's machine, host name and usable physical cores (run in each worker first)."""
    from ..distributed.machines import machine_identity

    return machine_identity(), socket.gethostname(), read_topology().physical_cores


def local_ranks(machines: list[Machine]) -> list[tuple[int, int]]:
    """Each worker's (local rank, local world size), the workers given in world-rank order.

    Raises:
        ConfigError: a machine holds more workers than physical cores.
    """
    counts: dict[str, int] = {}
    for identity, _, _ in machines:
        counts[identity] = counts.get(identity, 0) + 1
    for identity, host, cores in machines:
        if counts[identity] > cores:
            raise ConfigError(f"{counts[identity]} Ray workers run on {host}, which has {cores} physical cores: "
                              "SNConfig gives each worker cores of its own; start that node's Ray with at most "
                              f"--num-cpus={cores}, or ask for more CPUs per worker (ScalingConfig("
                              "resources_per_worker={'CPU': k}))")
    seen: dict[str, int] = {}
    ranks = []
    for identity, _, _ in machines:
        ranks.append((seen.get(identity, 0), counts[identity]))
        seen[identity] = seen.get(identity, 0) + 1
    return ranks


def plan(topology: Topology, local_rank: int, local_world_size: int, allotment: int) -> tuple[tuple[int, ...], int]:
    """The logical CPUs and intra-op threads of local rank ``local_rank``: its Ray CPU allotment in
    threads, as many as the machine's physical cores shared out among its workers hold."""
    threads = max(1, min(allotment, topology.physical_cores // local_world_size))
    return plan_pinning(topology, local_world_size, threads)[local_rank], threads


def settle(local_rank: int, local_world_size: int, allotment: int) -> WorkerPlacement:
    """Pin this worker's process to its cores, set its threads and register "sn" (run in each worker
    before its process group is made); local rank 0 says on stderr what its machine's workers got."""
    import torch

    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    topology = read_topology()
    cpus, threads = plan(topology, local_rank, local_world_size, allotment)
    pin_process(cpus)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    line = None
    if local_rank == 0:
        shares = plan_pinning(topology, local_world_size, threads)
        fitted = "" if threads == allotment else f" (Ray allots {allotment} CPUs each; the physical cores hold {threads})"
        thread_word = "thread" if threads == 1 else "threads"
        line = (f'sn_trainer SNConfig: {socket.gethostname()}: {local_world_size} Ray workers on process group "sn" '
                f"(shared memory here, gloo to other nodes), pinned to cpus "
                f"{' | '.join(','.join(map(str, share)) for share in shares)}, {threads} intra-op {thread_word} "
                f"each{fitted}")
        sys.stderr.write(line + "\n")  # not print: Ray Train sends a worker's print to its log and to stderr
        sys.stderr.flush()
    _PLACED[:] = [WorkerPlacement(local_rank, local_world_size, cpus, threads, line)]
    return _PLACED[0]


def pin_process(cpus: tuple[int, ...]) -> None:
    """Every thread of this process on ``cpus``: a Ray worker already runs threads of its own, and the
    affinity of a thread is its own (threads started later inherit their starter's)."""
    for _ in range(3):  # a thread started while the others were being pinned is caught on the next pass
        moved = False
        for task in os.listdir("/proc/self/task"):
            try:
                if os.sched_getaffinity(int(task)) != set(cpus):
                    os.sched_setaffinity(int(task), cpus)
                    moved = True
            except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
                continue
        if not moved:
            return


def placement() -> WorkerPlacement | None:
    """What ``SNConfig`` chose for this Ray Train worker (None outside one, or under another config)."""
    return _PLACED[0] if _PLACED else None
