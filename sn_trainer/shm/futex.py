"""Sleeping on a word of shared memory until another process changes it (Linux futexes, x86-64).

A rank that waits for a slow or descheduled peer gives its core away instead of spinning on it: on a
machine with more processes than cores, the peer it waits for may need that very core.
"""
from __future__ import annotations

import ctypes

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not the _PRIVATE forms
# The C library this process already has loaded: find_library("c") would run ldconfig in a
# subprocess, at every import of the shared-memory core.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` holds ``expected``, ``timeout_s`` at most (or until woken:
    the caller checks again what it waits for)."""
    timeout = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected),
                  ctypes.byref(timeout), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address``."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)
