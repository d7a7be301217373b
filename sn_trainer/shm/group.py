"""One rank's handle on a group's segment: the barrier every collective is built of, each rank's
liveness, and the group's broken state.

A failure anywhere (a rank gone, a timeout, ranks that disagree, a bad argument, a wait given up)
breaks the group for every rank: the rank that meets it writes why in its reason slot and makes its
arrival negative (-1 - the last barrier it passed); every rank waiting in a barrier the broken rank had
not passed, now or later, sees that and raises with that reason. A barrier it had passed, its peers pass
too, so that no rank raises in a collective its peer returned from; and no rank completes a collective
after a peer has given up on it: a peer's arrival is read once, and a broken rank never arrives again.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading
import time

import numpy as np

from ..errors import CollectiveFailed
from . import futex, liveness, native
from .layout import HEADER_WORDS, LINE_BYTES, MUTEX_BYTES, REASON_BYTES, Layout, NativeGroup
from .segment import Segment

OK, BROKEN, GONE, TIMEOUT, MISMATCH = range(5)  # native.c's status codes
# Spinning is the fastest wait while every rank has a core. Past this many polls the waiter yields its
# core between polls (the peer it waits for may be queued for it), and after YIELD_S of that it sleeps on
# the late peer's bell (a futex), waking to check the clock, its peers' liveness and the broken state. A
# training step's ranks wait for each other a few milliseconds at times: on an idle machine they keep
# yielding, and go on the moment the peer arrives, where a sleeper would wait for the scheduler to wake it.
# A yield that takes longer than YIELD_COST_S gave the core to another task (other work shares the
# machine): the waiter then sleeps at once, as gloo's do, and for SHARED_S after, waits poll SHARED_SPIN_S
# and sleep, without yielding (a yielding or spinning waiter would spend the time its descheduled peer needs).
SPINS = 2000  # a few microseconds of polls in C
YIELD_S = 0.05
YIELD_COST_S = 100e-6  # an idle core's yield returns in a few microseconds; another task's slice is milliseconds
SHARED_S = 1.0
SHARED_SPIN_S = 50e-6  # meanwhile, polls before a sleep: a peer that runs arrives within a chunk's copy
_SLEEP_S = 0.05
_ARRIVAL, _PID, _NATIVE = 0, 2, 3  # int64 words of a rank's line (word 1: bell and sleepers, int32 each)
# A rank publishes "my data is written" by a store to its arrival word; its peers rely on stores becoming
# visible in program order, which x86-64 guarantees (total store order) to the Python path too.
SHM_SAFE = platform.machine().lower() in ("x86_64", "amd64")


class Group:
    """Rank ``rank`` of ``world`` on ``segment``, laid out by ``layout``; every rank must construct
    it (the constructor ends in the group's first barrier)."""

    def __init__(self, segment: Segment, layout: Layout, rank: int, world: int, timeout_s: float,
                 slot_bytes: int = 0, use_native: bool = True):
        if not SHM_SAFE:
            raise CollectiveFailed("sn_trainer's shared-memory collectives rely on x86-64's store order; use gloo here")
        self.segment, self.layout, self.rank, self.world, self.timeout_s = segment, layout, rank, world, timeout_s
        self._lines = segment.array(0, world * LINE_BYTES // 8, np.int64).reshape(world, LINE_BYTES // 8)
        self._bells = self._lines.view(np.int32)[:, 2]
        self.headers = segment.array(layout.headers, 2 * world * HEADER_WORDS, np.int64).reshape(
            2, world, HEADER_WORDS)
        self._lib = native.load() if use_native else None
        base = segment.address
        self.state = NativeGroup(lines=base, mutexes=base + layout.mutexes, headers=base + layout.headers,
                                 slots=base + layout.data_offset, slot_bytes=slot_bytes, line_bytes=LINE_BYTES,
                                 mutex_bytes=MUTEX_BYTES, header_words=HEADER_WORDS, spins=SPINS,
                                 yield_ns=int(YIELD_S * 1e9), world=world, rank=rank,
                                 yield_cost_ns=int(YIELD_COST_S * 1e9), shared_ns=int(SHARED_S * 1e9),
                                 shared_spin_ns=int(SHARED_SPIN_S * 1e9))
        self.pointer = ctypes.addressof(self.state)  # what the C core's functions take (the struct stays alive)
        liveness.init(self._mutex(rank))
        self._holder = liveness.Holder(self._mutex(rank))
        self._lines[rank, _PID] = os.getpid()
        self._lines[rank, _NATIVE] = self._lib is not None
        self._lock = threading.Lock()  # fail() from another thread against this rank's own arrival
        # Called with a dead rank's pid and what this rank will raise, before it raises it (the "sn"
        # backend's, under an agent that names the first rank it sees end).
        self.before_naming_gone = None
        self.barrier("the group's start", native_path=False)
        if not self._lines[:, _NATIVE].all():  # one path for the whole group: the same protocol, the same bits
            self._lib = None

    @property
    def native(self):
        """The C core, where every rank has it (None: the Python path)."""
        return self._lib

    def _mutex(self, rank: int) -> int:
        return self.segment.address + self.layout.mutexes + rank * MUTEX_BYTES

    # --- the barrier ------------------------------------------------------------------------------

    def deadline(self, timeout_s: float | None = None) -> int:
        """The monotonic nanosecond by which a collective started now must be done."""
        return time.monotonic_ns() + int((self.timeout_s if timeout_s is None else timeout_s) * 1e9)

    def barrier(self, what: str, deadline: int | None = None, native_path: bool = True) -> None:
        """Return when every rank has reached this barrier.

        Raises:
            CollectiveFailed: on every rank, whatever failed (the group is then broken).
        """
        self.check(self.arrive_and_wait(deadline, native_path), what)

    def arrive_and_wait(self, deadline: int | None = None, native_path: bool = True) -> int:
        """The barrier, returning its status (``check`` raises what it says)."""
        deadline = self.deadline() if deadline is None else deadline
        if native_path and self._lib is not None:
            return self._lib.sn_barrier(self.pointer, deadline)
        return self._arrive() or self._wait(deadline)

    def _arrive(self) -> int:
        with self._lock:
            self.state.generation += 1
            if self._lines[self.rank, _ARRIVAL] < 0:
                self.state.culprit = self.rank
                return BROKEN
            self._lines[self.rank, _ARRIVAL] = self.state.generation
            self._bells[self.rank] = self.state.generation % 2**31  # after the arrival: a peer reads both
        futex.wake(self._bell(self.rank))
        return OK

    def _bell(self, rank: int) -> int:
        return self.segment.address + rank * LINE_BYTES + 8

    def _wait(self, deadline: int) -> int:
        """The Python twin of native.c's sn_wait."""
        arrivals, generation, polls, yield_until = self._lines[:, _ARRIVAL], self.state.generation, 0, 0
        shared = False
        while True:
            seen = arrivals.copy()  # each peer's word read once
            # A rank that broke the group after it passed this barrier passed it: so does this one (else
            # one rank would return from a collective its peer raises in). One that broke before never will.
            broken_before = (seen < 0) & (-1 - seen < generation)
            if broken_before.any():
                self.state.culprit = int(np.argmax(broken_before))
                return BROKEN
            if np.where(seen < 0, generation, seen).min() >= generation:
                self.state.passed = generation
                return OK
            polls += 1
            if polls < SPINS // 20:  # a Python poll costs about 20 of C's
                continue
            late = int(np.argmax((seen >= 0) & (seen < generation)))
            if self._lines[late, _PID] and liveness.gone(self._mutex(late)):  # pid 0: not in the group yet
                self.state.culprit = late
                return GONE
            now = time.monotonic_ns()
            if now > deadline:
                self.state.culprit = late
                return TIMEOUT
            state = self.state
            if not yield_until:
                shared = now < state.shared_until
                yield_until = now + (state.shared_spin_ns if shared else state.yield_ns)
            if shared and now < yield_until:  # a peer a chunk's copy away: not worth a sleep
                continue
            if now < yield_until:
                os.sched_yield()
                after = time.monotonic_ns()
                if after - now > state.yield_cost_ns:  # another task had the core: sleep from now on
                    state.shared_until, yield_until = after + state.shared_ns, after
                continue
            bell = int(self._bells[late])
            if 0 <= arrivals[late] < generation:  # read after its bell: it rang since, or the sleep ends at once
                futex.wait(self._bell(late), bell, min(_SLEEP_S, (deadline - now) / 1e9))

    # --- failures ---------------------------------------------------------------------------------

    def check(self, status: int, what: str) -> None:
        """Raise, on a failed barrier's status, what went wrong, breaking the group for every rank."""
        if status == OK:
            return
        culprit = self.state.culprit
        if status == BROKEN:
            if culprit == self.rank:  # earlier, or from another thread: the group was broken already
                self.ensure_usable(what)
            self.fail(f"sn: rank {self.rank} stops in {what}: rank {culprit} broke the group ({self.reason(culprit)})")
        if status == GONE:
            pid = int(self._lines[culprit, _PID])
            message = (f"sn: rank {culprit} (pid {pid}) ended before {what}; rank {self.rank} stops: the group "
                       "cannot continue without it")
            if self.before_naming_gone is not None:
                self.before_naming_gone(pid, message)
            self.fail(message)
        if status == TIMEOUT:
            late = [r for r in range(self.world) if 0 <= self._lines[r, _ARRIVAL] < self.state.generation]
            self.fail(f"sn: rank {self.rank} waited {self.timeout_s:g} s for rank(s) "
                      f"{', '.join(map(str, late or [culprit]))} in {what}; they never arrived (the group's timeout, "
                      "set with init_process_group(timeout=...), or the collective's own)")
        raise AssertionError(f"unknown status {status}")  # MISMATCH is the collectives' to describe

    def fail(self, message: str) -> None:
        """Break the group for every rank with ``message`` as this rank's reason, and raise it here.

        Safe from any thread of this process (a wait given up while a collective runs).

        Raises:
            CollectiveFailed: always, with ``message``.
        """
        self.break_group(message)
        raise CollectiveFailed(message)

    def break_group(self, message: str) -> None:
        """Write ``message`` as this rank's reason and mark the group broken (no raise); the first
        reason stays."""
        with self._lock:
            if self._lines is None or self._lines[self.rank, _ARRIVAL] < 0:
                return
            encoded = message.encode()[: REASON_BYTES - 1] + b"\0"
            slot = self.segment.array(self.layout.reasons + self.rank * REASON_BYTES, REASON_BYTES, np.uint8)
            slot[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
            if self._lib is not None:
                self._lib.sn_break(self.pointer)
                return
            self._lines[self.rank, _ARRIVAL] = -1 - self.state.passed  # the last barrier it passed, kept
            for rank in range(self.world):
                self._bells[rank] += 1
                futex.wake(self._bell(rank))

    def reason(self, rank: int) -> str:
        raw = self.segment.array(self.layout.reasons + rank * REASON_BYTES, REASON_BYTES, np.uint8).tobytes()
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def broken_by(self) -> int | None:
        """The rank that broke the group, if any."""
        arrivals = self._lines[:, _ARRIVAL]
        return int(np.argmax(arrivals < 0)) if (arrivals < 0).any() else None

    def ensure_usable(self, what: str) -> None:
        """Raise at the start of a collective on a group a failure already broke."""
        culprit = self.broken_by()
        if culprit is not None:
            raise CollectiveFailed(f"sn: rank {self.rank} cannot run {what}: rank {culprit} broke the group "
                                   f"({self.reason(culprit)}); make a new group (destroy_process_group, then "
                                   "init_process_group)")

    def close(self, detach: bool = True) -> None:
        """Leave the group: peers that wait for this rank from now on see it gone. ``detach``: unmap the
        segment too (no view of it may be used after); else it goes when this process ends."""
        if self._lines is None:
            return
        self._holder.release()
        self._lines = self._bells = self.headers = None
        if detach:
            self.segment.detach()

