"""Shared memory that no file names: a System V segment, marked for removal as soon as its creator has
attached it, so that the kernel frees it when the last process detaches it, whatever signal ends them.

Linux lets a process attach a segment already marked for removal (by its id), which is how the other
processes of a group reach it; no name of it exists anywhere, in /dev/shm or elsewhere, at any moment.
"""
from __future__ import annotations

import ctypes
import os
import signal
from contextlib import contextmanager

import numpy as np
import torch

from ..errors import CollectiveFailed

_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmget.argtypes, _libc.shmget.restype = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
_libc.shmat.argtypes, _libc.shmat.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
_libc.shmdt.argtypes, _libc.shmdt.restype = [ctypes.c_void_p], ctypes.c_int
_libc.shmctl.argtypes, _libc.shmctl.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p], ctypes.c_int
_IPC_PRIVATE, _IPC_CREAT, _IPC_RMID = 0, 0o1000, 0
_FAILED = ctypes.c_void_p(-1).value


@contextmanager
def _signals_deferred():
    """Signals that could end this process wait until the block has run (SIGKILL cannot: the window
    it leaves is the three system calls of ``Segment.create``)."""
    catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, catchable)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _error(what: str) -> str:
    code = ctypes.get_errno()
    return f"{what}: {os.strerror(code)}"


class Segment:
    """``size`` bytes of shared memory attached in this process (zero-filled when created)."""

    def __init__(self, shmid: int, size: int, address: int):
        self.shmid, self.size, self.address = shmid, size, address
        self._buffer = (ctypes.c_char * size).from_address(address)

    @classmethod
    def create(cls, size: int) -> "Segment":
        """A new segment, already marked for removal (gone once every process that attaches it has left).

        Raises:
            CollectiveFailed: the kernel refused it (its limits: kernel.shmmax, kernel.shmall).
        """
        with _signals_deferred():
            shmid = _libc.shmget(_IPC_PRIVATE, size, _IPC_CREAT | 0o600)
            if shmid < 0:
                raise CollectiveFailed(_error(f"cannot create {size / 2**20:.1f} MiB of shared memory") +
                                       " (raise the kernel's kernel.shmmax / kernel.shmall limits, or use fewer "
                                       "workers or a smaller model)")
            address = _libc.shmat(shmid, None, 0)
            _libc.shmctl(shmid, _IPC_RMID, None)
        if address in (None, _FAILED):
            raise CollectiveFailed(_error("cannot attach the shared memory just created"))
        return cls(shmid, size, address)

    @classmethod
    def attach(cls, shmid: int, size: int) -> "Segment":
        """The segment ``create`` made in another process of this machine (and IPC namespace).

        Raises:
            CollectiveFailed: it is gone (every process that had it attached has ended) or unreachable.
        """
        address = _libc.shmat(shmid, None, 0)
        if address in (None, _FAILED):
            raise CollectiveFailed(_error(f"cannot attach shared-memory segment {shmid}") +
                                   " (the process that made it has ended, or runs in another IPC namespace)")
        return cls(shmid, size, address)

    def __reduce__(self):
        return Segment.attach, (self.shmid, self.size)

    def bytes(self, offset: int, count: int) -> torch.Tensor:
        """``count`` bytes from ``offset`` as a uint8 tensor (a view: valid while this stays attached)."""
        return torch.frombuffer(self._buffer, dtype=torch.uint8, count=count, offset=offset)

    def array(self, offset: int, count: int, dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` from ``offset`` as a numpy array (a view)."""
        return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)

    def detach(self) -> None:
        """Leave the segment: every view of it must be gone (the memory goes with the last process)."""
        if self.address is not None:
            self._buffer = None
            _libc.shmdt(self.address)
            self.address = None
