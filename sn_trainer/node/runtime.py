"""What a worker's kernels run with besides torch: the memory allocator and the OpenMP runtime.

Each is chosen by preloading a shared library into the worker's process when it starts (the
fork server's, or a spawned worker's). Standard library only: the command line starts the fork
server with the default before it imports torch.
"""
from __future__ import annotations

import ctypes.util
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..config import ALLOCATORS, OPENMPS, TrainerConfig
from ..errors import ConfigError

# The library each memory allocator a worker may run with needs, preloaded (system: the C library's).
_LIBRARIES = {"system": None, "jemalloc": "jemalloc", "tcmalloc": "tcmalloc_minimal"}
_PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
# The OpenMP runtimes (config.OPENMPS): torch's own (GNU, linked in), or Intel's, preloaded in its
# place (it answers the GNU entry points torch calls), as PyTorch's own CPU launcher does.
# Intel's registers each process it runs in (to find a second copy of itself loaded there) as a file
# /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>, and removes it only in its exit handler: a process that
# leaves with os._exit or is killed leaves the file behind. No setting of the library avoids it.
_REGISTRY = Path("/dev/shm")
_REGISTRATION = re.compile(r"__KMP_REGISTERED_LIB_(\d+)_(\d+)")


# glibc's malloc gives freed memory back to the kernel once the free space at the top of its heap
# passes a threshold, and maps blocks past another threshold from the kernel afresh; both thresholds
# follow the largest block freed so far. A training step frees its activations and allocates the same
# sizes again in the next: where they pass those thresholds, every step faults its memory back in page
# by page (benchmarks/heap_bench.py). A worker keeps what it freed, up to these sizes, for the next step.
# By glibc's name for each, its mallopt parameter (malloc.h) and the value a worker sets.
_KEPT = {"MMAP_THRESHOLD": (-3, 32 << 20),  # glibc's own ceiling for its moving mmap threshold
         "TRIM_THRESHOLD": (-1, 128 << 20)}
_MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def kept_malloc_environment() -> dict[str, str]:
    """What ``keep_freed_memory`` sets, as glibc reads it from the environment of a process it starts."""
    return {f"MALLOC_{name}_": str(value) for name, (_, value) in _KEPT.items()}


def keep_freed_memory(allocator: str) -> bool:
    """In a worker about to train with ``allocator``: where that is the C library's and the C library
    is glibc, keep freed memory for the next step instead of giving it back to the kernel. Left as it
    is where the environment sets glibc's malloc itself (``MALLOC_*_``, ``GLIBC_TUNABLES``): those are
    the user's. Whether it changed anything."""
    if allocator != "system":  # jemalloc and tcmalloc keep freed memory in their own caches
        return False
    if any(name in os.environ for name in _MALLOC_ENVIRONMENT) or "glibc.malloc." in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # another C library: its malloc has no such thresholds
        return False
    return all(libc.mallopt(parameter, value) for parameter, value in _KEPT.values())


def allocator_library(allocator: str) -> str | None:
    """The shared library to preload for ``allocator`` (None: the C library's own malloc).

    Raises:
        ConfigError: the library is not installed.
    """
    if _LIBRARIES[allocator] is None:
        return None
    library = ctypes.util.find_library(_LIBRARIES[allocator])
    if library is None:
        raise ConfigError(f"allocator={allocator}: lib{_LIBRARIES[allocator]} is not installed; install it "
                          f"(Debian: apt-get install {_PACKAGES[allocator]}) or use allocator=system")
    return library


def _intel_openmp() -> str | None:
    """libiomp5: where the intel-openmp package puts it (this environment's lib/), else the system's."""
    bundled = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(bundled) if bundled.exists() else ctypes.util.find_library("iomp5")


def openmp_library(openmp: str) -> str | None:
    """The shared library to preload for ``openmp`` (None: torch's own GNU OpenMP).

    Raises:
        ConfigError: Intel's is not installed.
    """
    if openmp == "gnu":
        return None
    library = _intel_openmp()
    if library is None:
        raise ConfigError("openmp=intel: libiomp5 is not installed; install it (pip install intel-openmp) "
                          "or use openmp=gnu")
    return library


def openmp_registrations() -> set[int]:
    """The processes of this user that Intel's OpenMP has registered, by pid (ended ones included)."""
    try:
        names = os.listdir(_REGISTRY)
    except OSError:
        return set()
    found = (_REGISTRATION.fullmatch(name) for name in names)
    return {int(m.group(1)) for m in found if m is not None and int(m.group(2)) == os.getuid()}


def forget_openmp_registrations(pids: Iterable[int]) -> None:
    """Remove what Intel's OpenMP registered for each of ``pids``, processes that have ended without
    its exit handler (their registrations are garbage: the library would itself remove one it found
    for a dead process of its own pid)."""
    for pid in pids:
        try:
            os.unlink(_REGISTRY / f"__KMP_REGISTERED_LIB_{pid}_{os.getuid()}")
        except FileNotFoundError:  # none: GNU's OpenMP, or the library never started in it
            pass


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: alive
        pass
    return False


def forget_ended_openmp_registrations(known: set[int]) -> None:
    """Remove Intel's OpenMP's registrations of processes that have ended, those in ``known`` (a
    snapshot of ``openmp_registrations()``, for processes this one did not start) apart."""
    forget_openmp_registrations(pid for pid in openmp_registrations() - known if _ended(pid))


def available_allocators() -> list[str]:
    return [name for name, lib in _LIBRARIES.items() if lib is None or ctypes.util.find_library(lib)]


def available_openmps() -> list[str]:
    return ["gnu"] + (["intel"] if _intel_openmp() else [])


@dataclass(frozen=True)
class Runtime:
    """What a worker's kernels run with besides torch: its memory allocator and OpenMP runtime,
    both chosen by preloading a library when the worker's process starts."""

    allocator: str
    openmp: str

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS or self.openmp not in OPENMPS:
            raise ConfigError(f"no runtime allocator={self.allocator} openmp={self.openmp}: the allocators are "
                              f"{', '.join(ALLOCATORS)}; the OpenMP runtimes {', '.join(OPENMPS)}")

    def libraries(self) -> list[str]:
        """What to preload, in order.

        Raises:
            ConfigError: a library is not installed.
        """
        return [lib for lib in (allocator_library(self.allocator), openmp_library(self.openmp)) if lib]

    def __str__(self) -> str:
        return f"allocator={self.allocator} openmp={self.openmp}"


def default_runtime() -> Runtime:
    """What workers run with unless told otherwise: the settings' defaults."""
    return Runtime(TrainerConfig.allocator, TrainerConfig.openmp)
