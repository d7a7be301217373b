"""What each local rank gets: how many ranks, their cores, their intra-op threads and the
allocator and OpenMP runtime they run with, decided once in the launcher."""
from __future__ import annotations

from dataclasses import dataclass

from ..node.runtime import Runtime
from ..node.topology import Topology, auto_threads, auto_workers, plan_pinning
from ..errors import ConfigError
from . import child


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of one node: ``cpus[r]`` are local rank r's logical CPUs (None: not pinned)."""

    nproc: int
    threads: int
    cpus: tuple[tuple[int, ...], ...] | None
    runtime: Runtime
    unpinned_because: str | None = None  # why ranks are not pinned, when pinning was asked for
    auto_because: str | None = None  # what --nproc-per-node=auto became, and from what
    cpu_backend: str | None = None  # --cpu-backend: what the ranks' CPU gloo groups are made on (None: gloo)

    def environment(self, preloaded: str | None) -> dict[str, str]:
        """The variables every rank starts with (``preloaded``: LD_PRELOAD as it is now)."""
        threads = str(self.threads)
        variables = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, child.THREADS_VARIABLE: threads}
        if self.cpus is not None:
            variables[child.CPUS_VARIABLE] = ";".join(",".join(map(str, cpus)) for cpus in self.cpus)
        if self.cpu_backend is not None:
            variables[child.CPU_BACKEND_VARIABLE] = self.cpu_backend
        libraries = self.runtime.libraries()
        if libraries:
            variables["LD_PRELOAD"] = ":".join([*libraries, preloaded] if preloaded else libraries)
        return variables

    def lines(self) -> list[str]:
        """One line per local rank: its cores and threads; a warning first when ranks share cores."""
        lines = [f"sn_trainer.launch: {self.auto_because}"] if self.auto_because else []
        lines += [f"sn_trainer.launch: warning: {self.unpinned_because}"] if self.unpinned_because else []
        thread_word = "thread" if self.threads == 1 else "threads"
        for rank in range(self.nproc):
            where = "not pinned" if self.cpus is None else f"cpus {','.join(map(str, self.cpus[rank]))}"
            lines.append(f"sn_trainer.launch: local rank {rank} -> {where}, {self.threads} intra-op {thread_word}, "
                         f"{self.runtime}")
        return lines


def resolve_threads(requested: int | None, nproc: str, topology: Topology, environment: dict[str, str]) -> int:
    """Intra-op threads per rank: as asked; else OMP_NUM_THREADS as the user set it; else one per
    rank for ``auto``; else the usable cores shared out among the ranks."""
    if requested is None and environment.get("OMP_NUM_THREADS"):
        try:
            requested = int(environment["OMP_NUM_THREADS"])
        except ValueError:
            raise ConfigError(f"OMP_NUM_THREADS={environment['OMP_NUM_THREADS']!r} is not a whole number; unset "
                              "it or pass --threads-per-proc=N") from None
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads-per-proc={requested}: give at least 1 thread per process")
        return requested
    if nproc == "auto":
        return 1
    return auto_threads(topology, local_world_size(nproc))


def local_world_size(nproc: str) -> int:
    """``--nproc-per-node`` as torchrun reads it (a number, or cpu/gpu/xpu), ``auto`` apart.

    Raises:
        ConfigError: torchrun does not know the value, or it is below 1.
    """
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(nproc)
    except ValueError:
        raise ConfigError(f"--nproc-per-node={nproc}: give a number of processes, or auto (the physical cores "
                          "this process may use, divided by --threads-per-proc)") from None
    if count < 1:
        raise ConfigError(f"--nproc-per-node={nproc}: give at least 1 process per node")
    return count


def resolve(nproc: str, threads: int | None, pin: bool, runtime: Runtime, topology: Topology,
            environment: dict[str, str], cpu_backend: str | None = None) -> LaunchPlan:
    """The plan for one node's ranks.

    Args:
        nproc: ``--nproc-per-node``: ``auto`` is the usable physical cores / threads.
        threads: ``--threads-per-proc`` (None: see resolve_threads).
        pin: pin each rank to its own physical cores (``--no-pin``: False).
        cpu_backend: ``--cpu-backend``: the ranks' CPU gloo groups made on it (None: left as they are).
    Raises:
        ConfigError: a value that cannot be launched, or a runtime library that is not installed.
    """
    per_rank = resolve_threads(threads, nproc, topology, environment)
    count = auto_workers(topology, per_rank) if nproc == "auto" else local_world_size(nproc)
    runtime.libraries()  # installed, or say how to install them
    auto = (f"--nproc-per-node=auto: {count} processes ({topology.usable_cores} usable physical cores / {per_rank} "
            f"intra-op threads each)") if nproc == "auto" else None
    if not pin:
        return LaunchPlan(count, per_rank, None, runtime, auto_because=auto, cpu_backend=cpu_backend)
    if count * per_rank > topology.physical_cores:  # pinned onto shared cores they would only pile up
        return LaunchPlan(count, per_rank, None, runtime, auto_because=auto, cpu_backend=cpu_backend, unpinned_because=
                          f"{count} processes x {per_rank} threads need {count * per_rank} physical cores and "
                          f"{topology.physical_cores} are here: the processes are not pinned and share them; use "
                          "fewer processes or threads (--nproc-per-node=auto fits them)")
    return LaunchPlan(count, per_rank, tuple(plan_pinning(topology, count, per_rank)), runtime, auto_because=auto,
                      cpu_backend=cpu_backend)
