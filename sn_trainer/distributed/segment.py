"""One shared-memory segment per process group: found through the c10d store, gone from /dev/shm at once.

Rank 0 creates a file of a random name in /dev/shm readable by its own user only (0600), publishes the
name in the group's store, every rank maps it, and after a store barrier rank 0 unlinks it: the
mapping stays, the name is gone, so nothing is left behind whatever happens to the job afterwards.

Layout, in int64 words then data bytes:
    pids[W]                      each rank's process id, to tell a dead peer from a slow one
    arrivals[W]                  the barrier generation each rank has reached
    bells[W]                     the same generation as an int32 futex word, for peers that sleep
    headers[2][W][HEADER_WORDS]  what each rank's current collective is (compared before any data is read)
    slots[2][W][slot_bytes]      data: two alternating sets, one slot per rank
"""
from __future__ import annotations

import datetime
import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch

from ..errors import CollectiveFailed
from . import futex

HEADER_WORDS = 8
# Spinning is the fastest wait while every rank has a core. Past this many polls the waiter yields its core
# between polls (the peer it waits for may be queued for it), and after _YIELD_S of that it sleeps on the
# late peer's bell (a futex) so that a long wait costs no CPU, waking to check the clock and its peers.
_SPINS_BEFORE_YIELD = 100
_YIELD_S = 0.002
_SLEEP_S = 0.05
# A rank publishes "my data is written" by a plain store to its arrival counter; its peers rely on
# stores becoming visible in program order, which x86-64 guarantees (total store order).
SHM_SAFE = platform.machine().lower() in ("x86_64", "amd64")


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (exited, not yet reaped by its parent) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class Segment:
    """The mapped segment of one group: its barrier, its per-collective headers and its data slots."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta, slot_bytes: int):
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.timeout_s = timeout.total_seconds()
        words = 3 * world_size + 2 * world_size * HEADER_WORDS
        self._data_offset = (words * 8 + 4095) // 4096 * 4096
        size = self._data_offset + 2 * world_size * slot_bytes
        self.path, self._map = _map_through_store(store, rank, world_size, size)  # the path: already unlinked
        ints = np.frombuffer(self._map, dtype=np.int64, count=words)
        self._pids = ints[:world_size]
        self._arrivals = ints[world_size : 2 * world_size]
        self._bells = ints[2 * world_size : 3 * world_size].view(np.int32)[::2]  # the low half of each word
        self._bell_address = ints.ctypes.data + 16 * world_size
        self.headers = ints[3 * world_size :].reshape(2, world_size, HEADER_WORDS)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, offset=self._data_offset,
                                       count=2 * world_size * slot_bytes).view(2, world_size, slot_bytes)
        self._pids[rank] = os.getpid()
        self._generation = 0
        self.barrier("the start")  # every pid is written before anyone checks them

    def slots(self, parity: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``[W, slot_bytes // itemsize]`` data slots of set ``parity`` as ``dtype``."""
        return self._bytes[parity].view(dtype)

    def barrier(self, what: str) -> None:
        """Return when every rank has reached this barrier.

        Raises:
            CollectiveFailed: a rank that has not arrived is no longer running, or has not arrived
                within the group's timeout.
        """
        self._generation += 1
        arrivals, generation = self._arrivals, self._generation
        arrivals[self.rank] = generation
        self._bells[self.rank] = generation % 2**31  # after the arrival: a peer reading it sees both
        futex.wake(self._bell_address + 8 * self.rank)
        polls, deadline = 0, None
        while arrivals.min() < generation:
            polls += 1
            if polls < _SPINS_BEFORE_YIELD:
                continue
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now < deadline - self.timeout_s + _YIELD_S:
                os.sched_yield()
                continue
            late = int(arrivals.argmin())
            bell = int(self._bells[late])
            if arrivals[late] < generation:  # read after its bell: it rang since, or the sleep returns at once
                futex.wait(self._bell_address + 8 * late, bell, _SLEEP_S)
            if polls % 8 == 0:
                self._check_peers(generation, what, deadline)

    def _check_peers(self, generation: int, what: str, deadline: float) -> None:
        late = [r for r in range(self.world_size) if self._arrivals[r] < generation]
        for r in late:
            if self._pids[r] and not _alive(int(self._pids[r])):  # 0: not mapped yet, only late
                raise CollectiveFailed(f"sn backend: rank {r} (pid {int(self._pids[r])}) died before {what}; "
                               f"rank {self.rank} stops: the group cannot continue without it")
        if late and time.monotonic() > deadline:
            raise CollectiveFailed(f"sn backend: rank {self.rank} waited {self.timeout_s:g} s for rank(s) "
                              f"{', '.join(map(str, late))} in {what}; they never arrived (the group's timeout, "
                              "set with init_process_group(timeout=...))")

    def close(self) -> None:
        self._pids = self._arrivals = self._bells = self.headers = self._bytes = None
        try:
            self._map.close()
        except BufferError:  # a tensor a caller still holds views it: the mapping goes with it
            pass


def _map_through_store(store, rank: int, world_size: int, size: int) -> tuple[str, mmap.mmap]:
    """Rank 0 creates the file, all map it, rank 0 unlinks it once every rank has it mapped (the
    last rank to map it says so in the store; rank 0 waits for that within the store's timeout)."""
    path = None
    try:
        if rank == 0:
            path = name = f"/dev/shm/sn-{secrets.token_hex(12)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            store.set("sn/segment", path)
        else:
            name = store.get("sn/segment").decode()
            fd = os.open(name, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if store.add("sn/mapped", 1) == world_size:
            store.set("sn/all-mapped", "1")
        if rank == 0:
            store.wait(["sn/all-mapped"])
        return name, mapped
    finally:
        if path is not None:
            os.unlink(path)
