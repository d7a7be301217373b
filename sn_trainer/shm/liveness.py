"""Whether a rank still runs, without a process id: each rank holds a process-shared robust mutex in the
segment for as long as it is in the group. The kernel marks a robust mutex whose holder ended, whatever
signal ended it and whatever PID namespace it ran in, so a peer's trylock tells a rank that is gone
from one that is only slow (and costs one compare-and-swap while the holder lives)."""
from __future__ import annotations

import ctypes
import errno
import threading

_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("pthread_mutexattr_init", "pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust",
              "pthread_mutex_init", "pthread_mutex_lock", "pthread_mutex_trylock", "pthread_mutex_unlock"):
    getattr(_libc, _name).restype = ctypes.c_int
_PTHREAD_PROCESS_SHARED, _PTHREAD_MUTEX_ROBUST = 1, 1


def init(address: int) -> None:
    """Make the (zeroed) bytes at ``address`` a process-shared robust mutex."""
    attributes = ctypes.create_string_buffer(64)
    _libc.pthread_mutexattr_init(attributes)
    _libc.pthread_mutexattr_setpshared(attributes, _PTHREAD_PROCESS_SHARED)
    _libc.pthread_mutexattr_setrobust(attributes, _PTHREAD_MUTEX_ROBUST)
    if _libc.pthread_mutex_init(ctypes.c_void_p(address), attributes):
        raise OSError("pthread_mutex_init failed for the group's liveness lock")


def gone(address: int) -> bool:
    """Whether the mutex at ``address`` is no longer held by a live holder (the caller then keeps it)."""
    return _libc.pthread_mutex_trylock(ctypes.c_void_p(address)) != errno.EBUSY


class Holder:
    """This process's hold on its rank's mutex: a thread that locks it and waits to be released (a
    thread of its own, because a robust mutex belongs to a thread: the caller's could end first)."""

    def __init__(self, address: int):
        self._address = ctypes.c_void_p(address)
        self._locked, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, name="sn-liveness", daemon=True)
        self._thread.start()
        self._locked.wait()

    def _hold(self) -> None:
        _libc.pthread_mutex_lock(self._address)
        self._locked.set()
        self._release.wait()
        _libc.pthread_mutex_unlock(self._address)

    def release(self) -> None:
        self._release.set()
        self._thread.join()
