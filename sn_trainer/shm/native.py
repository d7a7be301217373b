"""The C core (native.c): built once per machine with its C compiler, loaded as a CPython module where
Python's headers are found (a call costs a tenth of a ctypes call), else through ctypes.

``python -m sn_trainer.shm.native`` builds it (the set-up script runs it) and says which path runs.
Where no compiler is found, or ``SN_TRAINER_NATIVE=0``, ``load()`` returns None and the collectives run
their Python path, which gives the same bits, more slowly.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import SimpleNamespace

log = logging.getLogger("sn_trainer")

SOURCE = Path(__file__).with_name("native.c")
ABI = 6  # native.c's SN_ABI
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11", "-fno-strict-aliasing"]
_MODULE = "sn_native"  # native.c's PyInit_sn_native
_loaded: dict[str, SimpleNamespace | None] = {}
# Every function the Python side calls, with its arguments (integers: addresses, sizes, codes; the group
# is the address of its NativeGroup); those a module build has are called through it.
_SIGNATURES = {
    "sn_abi": 0, "sn_barrier": 2, "sn_break": 1, "sn_all_reduce": 10, "sn_reduce_scatter": 10, "sn_broadcast": 8,
    "sn_all_gather": 8, "sn_collective_barrier": 4, "sn_sum_rows": 7,
}


def _python_headers() -> str | None:
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.exists(os.path.join(include, "Python.h")) else None


def library_path() -> Path:
    """Where the library built from this source, with these flags, by this compiler, for this Python lives."""
    key = SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _compiler().encode()
    key += f"{sysconfig.get_config_var('SOABI')}/{_python_headers()}".encode()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sn_trainer"
    return base / f"native-{hashlib.sha256(key).hexdigest()[:16]}.so"


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or ""


def build() -> Path:
    """Compile native.c into the cache (atomically: ranks that build it at once each write their own file
    and rename it into place); as a CPython module too where Python's headers are found.

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
    headers = _python_headers()
    tries = ([["-DSN_PYTHON_MODULE", f"-I{headers}"]] if headers else []) + [[]]
    try:
        for extra in tries:
            done = subprocess.run([compiler, *_FLAGS, *extra, "-o", partial, str(SOURCE)], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load() -> SimpleNamespace | None:
    """The C core's functions, built if need be; None where it cannot be (said once in the log) or is
    turned off."""
    if os.environ.get("SN_TRAINER_NATIVE", "1") == "0":
        return None
    if "lib" not in _loaded:
        try:
            _loaded["lib"] = _functions(build())
        except (OSError, RuntimeError, ImportError, subprocess.TimeoutExpired) as exc:
            log.warning("sn_trainer: the C core of the shared-memory collectives is not built (%s); they run "
                        "their Python path, slower", exc)
            _loaded["lib"] = None
    return _loaded["lib"]


def _functions(path: Path, as_module: bool = True) -> SimpleNamespace:
    """The library's functions: through its CPython module where it was built as one (and ``as_module``),
    else through ctypes."""
    library = ctypes.CDLL(str(path))
    library.sn_abi.restype = ctypes.c_int
    if library.sn_abi() != ABI:
        raise RuntimeError(f"native.c's ABI is {library.sn_abi()}, this Python side needs {ABI}")
    module = _module(path) if as_module and hasattr(library, f"PyInit_{_MODULE}") else None
    functions = {}
    for name, count in _SIGNATURES.items():
        if module is not None and hasattr(module, name):
            functions[name] = getattr(module, name)
            continue
        function = getattr(library, name)
        function.argtypes = [ctypes.c_int64] * count
        function.restype = ctypes.c_int
        functions[name] = function
    return SimpleNamespace(via="a CPython module" if module is not None else "ctypes", **functions)


def _module(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main() -> None:
    lib = load()
    if lib is None:
        print("sn_trainer: the shared-memory collectives run their Python path (no C core)", file=sys.stderr)
        sys.exit(1)
    print(f"sn_trainer: the shared-memory collectives' C core is built ({library_path()}), called through {lib.via}")


if __name__ == "__main__":
    main()
