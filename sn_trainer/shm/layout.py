"""Where everything lies in a group's segment: one definition for the Python path and the C one.

    lines[W]      LINE_BYTES each: arrival (int64: the last barrier the rank reached; once it broke the
                  group, -1 - the last barrier it passed), bell (int32 futex word), sleepers (int32),
                  pid (int64), native (int64: its C core loaded)
    mutexes[W]    a process-shared robust mutex each, held by its rank while it runs
    headers[2][W][HEADER_WORDS]  what each rank's current collective is, compared before data is read
    reasons[W]    REASON_BYTES of text each: why a rank broke the group
    data          from ``data_offset`` (page-aligned): what the group's user puts there
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

LINE_BYTES = 64  # a cache line each: a rank's stores never slow a peer's reads of its own line
MUTEX_BYTES = 64
HEADER_WORDS = 8
REASON_BYTES = 512
PAGE = 4096


@dataclass(frozen=True)
class Layout:
    world: int
    data_bytes: int

    @property
    def mutexes(self) -> int:
        return self.world * LINE_BYTES

    @property
    def headers(self) -> int:
        return self.mutexes + self.world * MUTEX_BYTES

    @property
    def reasons(self) -> int:
        return self.headers + 2 * self.world * HEADER_WORDS * 8

    @property
    def data_offset(self) -> int:
        end = self.reasons + self.world * REASON_BYTES
        return (end + PAGE - 1) // PAGE * PAGE

    @property
    def size(self) -> int:
        return self.data_offset + self.data_bytes


class NativeGroup(ctypes.Structure):
    """native.c's ``sn_group``, field by field: pointers into the segment and this rank's counters."""

    _fields_ = [("lines", ctypes.c_void_p), ("mutexes", ctypes.c_void_p), ("headers", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64), ("line_bytes", ctypes.c_int64),
                ("mutex_bytes", ctypes.c_int64), ("header_words", ctypes.c_int64), ("generation", ctypes.c_int64),
                ("chunks", ctypes.c_int64), ("ops", ctypes.c_int64), ("spins", ctypes.c_int64), ("yield_ns", ctypes.c_int64),
                ("world", ctypes.c_int32), ("rank", ctypes.c_int32), ("culprit", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("passed", ctypes.c_int64), ("yield_cost_ns", ctypes.c_int64),
                ("shared_ns", ctypes.c_int64), ("shared_until", ctypes.c_int64), ("shared_spin_ns", ctypes.c_int64)]
