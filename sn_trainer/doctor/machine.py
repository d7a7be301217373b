"""The machine as the seeds check it before blaming the run: cores and hyper-threads, NUMA nodes,
the container's CPU quota, frequency governors, swap and swappiness, huge pages, free memory,
other processes' CPU and I/O wait, the runtimes installed and torch's kernels.

Every fact is read under a sysfs and a procfs root (tests fabricate both); a file that is not
there makes its check say "not visible" (a VM or a container may hide it), never an error.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ..node.topology import Topology, read_topology
from .findings import Finding, not_visible

SWAPPINESS = 10  # the pipeline checklist's advice: keep a training machine's pages out of swap
HEADROOM = 0.25  # the articles' 20-30% of memory kept for the system and other processes
BUSY_PERCENT = 5.0


def machine_findings(sys_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc",
                     sample_seconds: float = 0.5, need_bytes: int | None = None,
                     kernels: bool = True) -> list[Finding]:
    """Each machine check, in the seeds' order.

    Args:
        sample_seconds: how long other processes' CPU is sampled for.
        need_bytes: what a run needs (its peak memory), if known.
        kernels: also this process's torch: its kernels and the runtimes installed beside it.
    """
    sys_root, proc_root = Path(sys_root), Path(proc_root)
    try:
        topology = read_topology(sys_root, proc_root=proc_root)
    except (OSError, RuntimeError, ValueError) as exc:
        topology, found = None, [not_visible("cores", f"no CPU topology under {sys_root}: {exc}")]
    else:
        found = [cores(topology), numa(topology), quota(topology)]
    found += [governors(sys_root, topology), swap(proc_root), swappiness(proc_root), huge_pages(sys_root),
              memory(proc_root, need_bytes), *cpu_sample(proc_root, sample_seconds)]
    if kernels:
        found += [runtimes(), torch_kernels(proc_root)]
    return found


def cores(topology: Topology) -> Finding:
    physical, logical = topology.physical_cores, topology.logical_cpus
    evidence = f"{physical} physical cores, {logical} logical CPUs"
    if not topology.smt:
        return Finding("cores", evidence + " (no SMT)")
    siblings = next(c.cpus for c in topology.cores if len(c.cpus) > 1)
    return Finding("cores", f"{evidence}: SMT, CPUs {','.join(map(str, siblings))} are hyper-threads of one core",
                   f"workers x threads at most {physical} (workers=auto counts physical cores): a hyper-thread "
                   "is no core for training")


def numa(topology: Topology) -> Finding:
    nodes = topology.numa_nodes
    if nodes <= 1:
        return Finding("NUMA", "1 NUMA node")
    return Finding("NUMA", f"{nodes} NUMA nodes: workers are pinned in node order, a worker's threads on one node "
                           "where the counts allow (threads dividing the cores of a node)")


def quota(topology: Topology) -> Finding:
    if topology.cpu_quota is None:
        return Finding("CPU quota", "no cgroup CPU limit")
    evidence = f"the cgroup allows {topology.cpu_quota:.2f} CPUs of the {topology.physical_cores} cores it sees"
    if topology.usable_cores >= topology.physical_cores:
        return Finding("CPU quota", evidence)
    return Finding("CPU quota", evidence, f"workers x threads at most {topology.usable_cores} (workers=auto does), "
                   "or a larger CPU limit for the container")


def governors(sys_root: Path, topology: Topology | None) -> Finding:
    cpus = [c for core in topology.cores for c in core.cpus] if topology else []
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    if not cpus:
        cpus = sorted(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*")) if cpu_dir.is_dir() else []
    seen: dict[str, list[int]] = {}
    for cpu in cpus:
        try:
            governor = (cpu_dir / f"cpu{cpu}" / "cpufreq" / "scaling_governor").read_text().strip()
        except OSError:
            continue
        seen.setdefault(governor, []).append(cpu)
    if not seen:
        return not_visible("frequency governor", "no cpufreq under sysfs: a VM or container may hide it")
    evidence = "; ".join(f"{g} on CPUs {_cpu_list(sorted(c))}" for g, c in sorted(seen.items()))
    slow = {g: c for g, c in seen.items() if g != "performance"}
    if not slow:
        return Finding("frequency governor", evidence)
    return Finding("frequency governor", evidence, "lock it to performance (as root: cpupower frequency-set -g "
                   "performance); other governors lower the clock between bursts")


def swap(proc_root: Path) -> Finding:
    info = _meminfo(proc_root)
    if "SwapTotal" not in info:
        return not_visible("swap", f"no {proc_root}/meminfo")
    used = info["SwapTotal"] - info.get("SwapFree", info["SwapTotal"])
    evidence = f"{used / 2**20:.2f} GiB of {info['SwapTotal'] / 2**20:.2f} GiB swap in use"
    if used <= 0:
        return Finding("swap", evidence)
    return Finding("swap", evidence, "free memory for the run (a smaller batch_size, fewer workers, or stop other "
                   "programs); pages a worker touches in swap cost a disk read each")


def swappiness(proc_root: Path) -> Finding:
    try:
        value = int((proc_root / "sys" / "vm" / "swappiness").read_text())
    except (OSError, ValueError):
        return not_visible("vm.swappiness", f"no {proc_root}/sys/vm/swappiness")
    if value <= SWAPPINESS:
        return Finding("vm.swappiness", f"vm.swappiness={value}")
    return Finding("vm.swappiness", f"vm.swappiness={value}", f"as root: sysctl vm.swappiness={SWAPPINESS} (keep a "
                   "training machine's memory out of swap, as the pipeline checklist advises)")


def huge_pages(sys_root: Path) -> Finding:
    try:
        text = (sys_root / "kernel" / "mm" / "transparent_hugepage" / "enabled").read_text()
    except OSError:
        return not_visible("transparent huge pages", "no transparent_hugepage under sysfs")
    match = re.search(r"\[(\w+)\]", text)
    mode = match.group(1) if match else text.strip()
    if mode != "never":
        return Finding("transparent huge pages", mode)
    return Finding("transparent huge pages", "never", "as root: echo madvise > "
                   "/sys/kernel/mm/transparent_hugepage/enabled (large tensors get huge pages, fewer TLB misses)")


def memory(proc_root: Path, need_bytes: int | None) -> Finding:
    info = _meminfo(proc_root)
    if "MemTotal" not in info or "MemAvailable" not in info:
        return not_visible("memory", f"no MemTotal and MemAvailable in {proc_root}/meminfo")
    total, available = info["MemTotal"] * 1024, info["MemAvailable"] * 1024
    evidence = f"{available / 2**30:.1f} GiB available of {total / 2**30:.1f} GiB"
    if need_bytes:
        evidence += f"; the run needed {need_bytes / 2**30:.2f} GiB"
        if need_bytes > available - HEADROOM * total:
            return Finding("memory", evidence, f"keep {100 * HEADROOM:.0f}% free: a smaller batch_size, fewer "
                           "workers, or stop other programs")
    elif available < HEADROOM * total:
        return Finding("memory", evidence, "less than the 20-30% the articles keep free: stop other programs")
    return Finding("memory", evidence)


def cpu_sample(proc_root: Path, seconds: float) -> list[Finding]:
    """Other processes' CPU and the I/O wait, over ``seconds`` of /proc/stat (this process left out)."""
    first, own_first = _cpu_times(proc_root), _own_ticks(proc_root)
    if first is None:
        why = f"no {proc_root}/stat"
        return [not_visible("other processes' CPU", why), not_visible("I/O wait", why)]
    time.sleep(seconds)
    second, own_second = _cpu_times(proc_root), _own_ticks(proc_root)
    total = sum(second) - sum(first)
    if second is None or total <= 0:
        evidence = f"{proc_root}/stat did not move over {seconds:g} s"
        return [not_visible("other processes' CPU", evidence), not_visible("I/O wait", evidence)]
    idle = (second[3] - first[3]) + (second[4] - first[4])
    own = (own_second - own_first) if own_first is not None and own_second is not None else 0
    other = max(0.0, 100 * (total - idle - own) / total)
    iowait = 100 * (second[4] - first[4]) / total
    found = [Finding("other processes' CPU", f"{other:.0f}% of the machine's CPU over {seconds:g} s",
                     "measure and train on an idle machine (what runs: top), or on CPUs nothing else uses "
                     "(taskset -c <cpus>); beside other work pin=auto leaves the workers unpinned, so that the OS "
                     "can move each off a shared core" if other > BUSY_PERCENT else None)]
    found.append(Finding("I/O wait", f"{iowait:.0f}% of the CPU time waiting for the disk over {seconds:g} s",
                         "something is reading or writing hard (iotop shows what)" if iowait > BUSY_PERCENT
                         else None))
    return found


def runtimes() -> Finding:
    from ..node.runtime import available_allocators, available_openmps

    allocators, openmps = available_allocators(), available_openmps()
    evidence = f"allocators {', '.join(allocators)}; OpenMP runtimes {', '.join(openmps)}"
    if len(allocators) > 1 or len(openmps) > 1:
        return Finding("runtimes", evidence + " (tune=true measures which trains fastest: allocator=auto, openmp=auto)")
    return Finding("runtimes", evidence + " (apt-get install libjemalloc2 or pip install intel-openmp gives tune "
                                          "others to try)")


def torch_kernels(proc_root: Path) -> Finding:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    flags = _cpu_flags(proc_root)
    onednn = torch.backends.mkldnn.is_available()
    bf16 = onednn and bool(flags & {"avx512_bf16", "amx_bf16"})
    amx = "amx_bf16" in flags
    evidence = (f"ATen kernels {capability}, oneDNN {'on' if onednn else 'off'}, bf16 "
                f"{'native' + (' (AMX)' if amx else '') if bf16 else 'not native (precision=bf16 runs fp32)'}")
    best = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else None
    held = os.environ.get("ATEN_CPU_CAPABILITY")
    if held and best and capability.lower() != best:
        return Finding("torch kernels", f"{evidence}; the CPU has {best.upper()}", f"unset ATEN_CPU_CAPABILITY "
                       f"(={held} holds torch to slower kernels than this CPU runs)")
    return Finding("torch kernels", evidence)


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) if len(cpus) < 3 or cpus != list(range(cpus[0], cpus[-1] + 1)) \
        else f"{cpus[0]}-{cpus[-1]}"


def _meminfo(proc_root: Path) -> dict[str, int]:
    """/proc/meminfo in KiB."""
    try:
        text = (proc_root / "meminfo").read_text()
    except OSError:
        return {}
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+):\s+(\d+)", text, re.MULTILINE)}


def _cpu_times(proc_root: Path) -> list[int] | None:
    """The machine's CPU ticks: user nice system idle iowait irq softirq steal."""
    try:
        line = (proc_root / "stat").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = line.split()
    if fields[0] != "cpu" or len(fields) < 6:
        return None
    return [int(x) for x in fields[1:9]]


def _own_ticks(proc_root: Path) -> int | None:
    try:
        fields = (proc_root / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _cpu_flags(proc_root: Path) -> set[str]:
    try:
        text = (proc_root / "cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()

