"""CPU topology: which logical CPUs form which physical cores, and which cores each worker gets."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PhysicalCore:
    """One physical core: its socket, NUMA node and the logical CPUs (hyper-threads) on it."""

    socket: int
    core_id: int
    numa_node: int
    cpus: tuple[int, ...]  # sorted; cpus[0] is the one a worker thread is pinned to


@dataclass(frozen=True)
class Topology:
    cores: tuple[PhysicalCore, ...]  # ordered by (numa node, socket, core id)

    @property
    def physical_cores(self) -> int:
        return len(self.cores)

    @property
    def logical_cpus(self) -> int:
        return sum(len(c.cpus) for c in self.cores)

    @property
    def numa_nodes(self) -> int:
        return len({c.numa_node for c in self.cores})

    @property
    def smt(self) -> bool:
        return any(len(c.cpus) > 1 for c in self.cores)


def parse_cpu_list(text: str) -> list[int]:
    """Parse the kernel's cpulist format ("0-3,8,10-11") into a sorted list."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return sorted(cpus)


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def read_topology(sys_root: str | os.PathLike = "/sys", allowed: set[int] | None = None) -> Topology:
    """Read physical cores, SMT siblings and NUMA nodes from a sysfs tree.

    Args:
        sys_root: the sysfs mount (tests pass a fabricated tree).
        allowed: logical CPUs this process may run on; default: its current affinity when
            reading the real /sys, else every online CPU of the tree.
    Returns:
        The topology restricted to ``allowed``; with no readable sysfs, one core per
        logical CPU that ``allowed`` names.
    """
    cpu_dir = Path(sys_root) / "devices" / "system" / "cpu"
    if allowed is None and Path(sys_root) == Path("/sys") and hasattr(os, "sched_getaffinity"):
        allowed = set(os.sched_getaffinity(0))
    online_file = cpu_dir / "online"
    if online_file.exists():
        online = parse_cpu_list(online_file.read_text())
    else:
        online = sorted(allowed) if allowed else list(range(os.cpu_count() or 1))
    cpus = [c for c in online if allowed is None or c in allowed]

    numa_of: dict[int, int] = {}
    node_dir = Path(sys_root) / "devices" / "system" / "node"
    for node in sorted(node_dir.glob("node[0-9]*")) if node_dir.exists() else []:
        for cpu in parse_cpu_list((node / "cpulist").read_text()):
            numa_of[cpu] = int(node.name[4:])

    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in cpus:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        socket = _read_int(topo / "physical_package_id", 0)
        # Without topology files, treat every logical CPU as its own core.
        core = _read_int(topo / "core_id", cpu) if topo.exists() else cpu
        groups.setdefault((socket, core), []).append(cpu)

    cores = [
        PhysicalCore(socket=s, core_id=c, numa_node=numa_of.get(min(cs), 0), cpus=tuple(sorted(cs)))
        for (s, c), cs in groups.items()
    ]
    cores.sort(key=lambda c: (c.numa_node, c.socket, c.core_id))
    if not cores:
        raise RuntimeError(f"no usable CPU found under {cpu_dir}")
    return Topology(cores=tuple(cores))


def auto_workers(topology: Topology, threads: int) -> int:
    """``workers=auto``: as many workers as fit on the physical cores at ``threads`` each."""
    return max(1, topology.physical_cores // threads)


def oversubscription(topology: Topology, workers: int, threads: int) -> str | None:
    """Why ``workers`` x ``threads`` would share cores here, or None when each gets its own."""
    need = workers * threads
    if need <= topology.physical_cores:
        return None
    return (f"workers x threads = {workers} x {threads} = {need} exceeds the {topology.physical_cores} physical "
            "cores available")


def plan_pinning(topology: Topology, workers: int, threads: int) -> list[tuple[int, ...]]:
    """Give each worker ``threads`` physical cores of its own, one logical CPU per core.

    Consecutive workers take consecutive cores in NUMA order, so a worker's cores share a
    node whenever the counts allow. When workers x threads exceeds the physical cores, cores
    are shared round-robin and a warning says so (it costs speed, not correctness).

    Returns:
        For each worker, the logical CPUs to pin it to.
    """
    cores = topology.cores
    reason = oversubscription(topology, workers, threads)
    if reason:
        log.warning("%s: workers will share cores and each will run slower; use workers=auto or fewer threads",
                    reason)
    plan = []
    for w in range(workers):
        chosen = [cores[(w * threads + t) % len(cores)].cpus[0] for t in range(threads)]
        plan.append(tuple(sorted(set(chosen))))
    return plan
