"""The C core (native.c): built once per machine with its C compiler, loaded through ctypes.

``python -m sn_trainer.shm.native`` builds it (the set-up script runs it) and says which path runs.
Where no compiler is found, or ``SN_TRAINER_NATIVE=0``, ``load()`` returns None and the collectives run
their Python path, which gives the same bits, more slowly.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .layout import NativeGroup

log = logging.getLogger("sn_trainer")

SOURCE = Path(__file__).with_name("native.c")
ABI = 4  # native.c's SN_ABI
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11", "-fno-strict-aliasing"]
_loaded: dict[str, ctypes.CDLL | None] = {}


def library_path() -> Path:
    """Where the library built from this source, with these flags, by this compiler lives."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _compiler().encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sn_trainer"
    return base / f"native-{digest}.so"


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or ""


def build() -> Path:
    """Compile native.c into the cache (atomically: ranks that build it at once each write their own
    file and rename it into place).

    Raises:
        RuntimeError: no C compiler, or it failed (its message).
    """
    target = library_path()
    if target.exists():
        return target
    compiler = _compiler()
    if not compiler:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".native-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load() -> ctypes.CDLL | None:
    """The C core, built if need be; None where it cannot be (said once in the log) or is turned off."""
    if os.environ.get("SN_TRAINER_NATIVE", "1") == "0":
        return None
    if "lib" not in _loaded:
        try:
            _loaded["lib"] = _declare(ctypes.CDLL(str(build())))
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("sn_trainer: the C core of the shared-memory collectives is not built (%s); they run "
                        "their Python path, slower", exc)
            _loaded["lib"] = None
    return _loaded["lib"]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.sn_abi() != ABI:
        raise RuntimeError(f"native.c's ABI is {lib.sn_abi()}, this Python side needs {ABI}")
    group, i64, i32, ptr = ctypes.POINTER(NativeGroup), ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    signatures = {
        "sn_arrive": [group], "sn_wait": [group, i64], "sn_barrier": [group, i64], "sn_break": [group],
        "sn_gone": [group, i32],
        "sn_all_reduce": [group, ptr, i64, i32, i32, i64, i64, i64, i64, i64],
        "sn_reduce_scatter": [group, ptr, ptr, i64, i32, i32, i64, i64, i64, i64],
        "sn_broadcast": [group, ptr, i64, i32, i64, i64, i64, i64],
        "sn_all_gather": [group, ptr, ptr, i64, i64, i64, i64, i64],
        "sn_collective_barrier": [group, i64, i64, i64],
        "sn_sum_rows": [ptr, i64, i32, i64, i64, i32, ptr],
    }
    for name, arguments in signatures.items():
        function = getattr(lib, name)
        function.argtypes = arguments
        function.restype = None if name in ("sn_break", "sn_sum_rows") else ctypes.c_int
    return lib


def main() -> None:
    lib = load()
    if lib is None:
        print("sn_trainer: the shared-memory collectives run their Python path (no C core)", file=sys.stderr)
        sys.exit(1)
    print(f"sn_trainer: the shared-memory collectives' C core is built ({library_path()})")


if __name__ == "__main__":
    main()
