"""What this machine is: its CPU, its instruction sets, whether it computes bfloat16; enough to
compare, nothing private."""
from __future__ import annotations

import platform
import re
from pathlib import Path

import psutil
import torch


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or "unknown")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def bf16_supported() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), where oneDNN uses it."""
    flags = cpu_flags()
    return torch.backends.mkldnn.is_available() and bool(flags & {"avx512_bf16", "amx_bf16"})


def describe_machine() -> dict:
    """CPU model, cores, memory and software versions (no host name, no user, no paths)."""
    flags = cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False) or psutil.cpu_count(),
        "logical_cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "isa": sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def machine_slug(machine: dict) -> str:
    """A short folder name for results from this machine, e.g. ``amd-epyc-2c``."""
    model = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*$", "", machine["cpu_model"].lower())
    model = re.sub(r"[^a-z0-9]+", "-", model).strip("-")[:40]
    return f"{model}-{machine['physical_cores']}c"
