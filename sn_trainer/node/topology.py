"""CPU topology: which logical CPUs form which physical cores, the CPU time a container allows, and
which cores each worker gets."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

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
    cpu_quota: float | None = None  # CPUs' worth of time the cgroup allows (a container's limit), if any

    @property
    def physical_cores(self) -> int:
        return len(self.cores)

    @property
    def usable_cores(self) -> int:
        """Physical cores a run can keep busy: all of them, or as many whole CPUs as the quota allows."""
        if self.cpu_quota is None:
            return self.physical_cores
        return max(1, min(self.physical_cores, math.floor(self.cpu_quota + 1e-9)))

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


def read_topology(sys_root: str | os.PathLike = "/sys", allowed: set[int] | None = None,
                  proc_root: str | os.PathLike = "/proc") -> Topology:
    """Read physical cores, SMT siblings and NUMA nodes from a sysfs tree, and this process's
    cgroup limits (a container's CPU quota and cpuset).

    Args:
        sys_root: the sysfs mount (tests pass a fabricated tree, cgroups under fs/cgroup).
        allowed: logical CPUs this process may run on; default: its current affinity when
            reading the real /sys, else every online CPU of the tree.
        proc_root: where ``self/cgroup`` names this process's cgroups.
    Returns:
        The topology restricted to ``allowed`` and the cgroup's cpuset; with no readable sysfs,
        one core per logical CPU that ``allowed`` names.
    """
    cpu_dir = Path(sys_root) / "devices" / "system" / "cpu"
    if allowed is None and Path(sys_root) == Path("/sys") and hasattr(os, "sched_getaffinity"):
        allowed = set(os.sched_getaffinity(0))
    limits = read_cgroup_limits(Path(sys_root) / "fs" / "cgroup", Path(proc_root) / "self" / "cgroup")
    if limits.cpuset is not None:
        allowed = limits.cpuset if allowed is None else allowed & limits.cpuset
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
    return Topology(cores=tuple(cores), cpu_quota=limits.quota)


@dataclass(frozen=True)
class CgroupLimits:
    quota: float | None  # CPUs' worth of time per period (cpu.max, cpu.cfs_quota_us / cpu.cfs_period_us)
    cpuset: set[int] | None  # the logical CPUs the cgroup allows


def read_cgroup_limits(cgroup_root: Path, self_cgroup: Path) -> CgroupLimits:
    """The CPU limits of this process's cgroup and its ancestors (the tightest applies), v2 or v1.

    With no cgroup files (not Linux, no limit set), no limits.
    """
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return CgroupLimits(None, None)
    quotas, cpusets = [], []
    for line in lines:
        if line.count(":") < 2:
            continue  # not "id:controllers:path": no cgroup this process can be found in
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        if not names:  # v2: one unified hierarchy
            for folder in _ancestors(cgroup_root, path):
                quotas.append(_v2_quota(folder / "cpu.max"))
                cpusets.append(_cpuset(folder / "cpuset.cpus.effective") or _cpuset(folder / "cpuset.cpus"))
        elif "cpu" in names:
            for mount in (cgroup_root / controllers, cgroup_root / "cpu"):
                for folder in _ancestors(mount, path):
                    quota = _read_int(folder / "cpu.cfs_quota_us", -1)
                    period = _read_int(folder / "cpu.cfs_period_us", 0)
                    quotas.append(quota / period if quota > 0 and period > 0 else None)
        elif "cpuset" in names:
            for folder in _ancestors(cgroup_root / "cpuset", path):
                cpusets.append(_cpuset(folder / "cpuset.cpus"))
    known_quotas = [q for q in quotas if q is not None]
    known_sets = [c for c in cpusets if c is not None]
    cpuset = set.intersection(*known_sets) if known_sets else None
    return CgroupLimits(min(known_quotas) if known_quotas else None, cpuset)


def _ancestors(mount: Path, path: str) -> list[Path]:
    """A cgroup's folder and those above it, up to the mount (which exist)."""
    parts = [p for p in path.split("/") if p]
    folders = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [f for f in folders if f.is_dir()]


def _v2_quota(path: Path) -> float | None:
    """cpu.max's quota in CPUs ("350000 100000": 3.5), None for "max" (no limit) or no file. What
    cannot be parsed is taken as no limit, said in one warning line: a quota only bounds the workers
    that workers=auto (and tuning) choose, so not knowing it must not stop a run."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    fields = text.split()
    if fields[:1] == ["max"]:
        return None
    numbers = [int(field) for field in fields if field.isdigit()]
    if len(fields) != 2 or len(numbers) != 2 or 0 in numbers:
        log.warning("%s holds %r, not '<quota> <period>' or 'max <period>': taken as no CPU limit", path, text)
        return None
    return numbers[0] / numbers[1]


def _cpuset(path: Path) -> set[int] | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return set(parse_cpu_list(text)) if text else None
    except ValueError:
        log.warning("%s holds %r, not a list of CPUs such as 0-3,8: taken as no cpuset", path, text)
        return None


def auto_workers(topology: Topology, threads: int) -> int:
    """``workers=auto``: as many workers as fit on the usable cores at ``threads`` each: the
    physical cores, or fewer where a container's CPU quota is smaller than the cores it sees."""
    workers = max(1, topology.usable_cores // threads)
    if topology.usable_cores < topology.physical_cores:
        log.info("workers=auto: %d workers x %d threads: this process's cgroup allows %.2f CPUs of the %d cores it "
                 "sees (a container's CPU limit); more workers would wait for the quota", workers, threads,
                 topology.cpu_quota, topology.physical_cores)
    return workers


def auto_threads(topology: Topology, workers: int) -> int:
    """``threads=auto`` beside a given worker count: the usable cores shared out among the workers
    (at least one thread each)."""
    return max(1, topology.usable_cores // workers)


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


# Other processes' CPU time, in cores, from which pin=auto leaves the workers to the OS.
OTHER_WORK_CORES = 0.5


def other_work(seconds: float = 0.05) -> float:
    """How many of this process's usable CPUs other processes kept busy over the next ``seconds`` (this
    process's own CPU time left out), in cores."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    me = psutil.Process()

    def busy() -> float:
        per_cpu = psutil.cpu_times(percpu=True)
        chosen = [per_cpu[c] for c in allowed if c < len(per_cpu)] if allowed else per_cpu
        return sum(t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) for t in chosen)

    def own() -> float:
        times = me.cpu_times()
        return times.user + times.system

    busy_before, own_before, started = busy(), own(), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return max(0.0, (busy() - busy_before) - (own() - own_before)) / elapsed
