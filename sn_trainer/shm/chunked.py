"""The collectives of a group, moved in fixed-size chunks through its segment's data slots.

Every element of a reduction is combined in the order rank 0, 1, ..., W-1 by elementwise operations
only: either by one rank whose result all then read, or by every rank from the same values with the
same operations. Either way the ranks' results are bit-identical by construction, and the same for the
same inputs whatever the chunking. float16 and bfloat16 are combined in float32 and rounded once.

Chunks alternate between the segment's two slot sets: a rank writes a set again only after the next
chunk's barrier, which every rank reaches only once it has read the previous chunk. SUM and AVG of
floating tensors, broadcasts and gathers run in the C core where the group has it; the rest, and
everything where no compiler was found, runs the Python loops here, on the same protocol.

Each collective first checks its arguments (a bad one breaks the group, so that every rank raises),
then writes what it is into its header; after the first barrier every rank compares the headers, so
ranks that called different collectives, ops, roots, dtypes or sizes all raise, naming them.
"""
from __future__ import annotations

import torch

from .group import BROKEN, MISMATCH, OK, Group

# Up to this many bytes read per chunk, every rank combines a whole chunk itself (see all_reduce).
WHOLE_CHUNK_BYTES = 1 << 20
KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
# Every dtype torch has, numbered the same way in every rank of one torch: what the headers compare.
DTYPES = sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)
HEADER_DTYPES = {dtype: code for code, dtype in enumerate(DTYPES)}
_ALL_REDUCE, _BROADCAST, _ALL_GATHER, _REDUCE_SCATTER, _BARRIER = range(1, len(KINDS) + 1)  # KINDS' codes
_SUMS = ("SUM", "AVG")
_MISMATCH = "sn: the ranks called"  # how a mismatch's reason begins
REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
             torch.int32, torch.int64, torch.bool)
NATIVE_FLOATS = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}  # native.c's codes
_IN_PLACE = {"SUM": torch.Tensor.add_, "AVG": torch.Tensor.add_, "PRODUCT": torch.Tensor.mul_,
             "MIN": lambda a, b: torch.minimum(a, b, out=a), "MAX": lambda a, b: torch.maximum(a, b, out=a),
             "BAND": torch.Tensor.bitwise_and_, "BOR": torch.Tensor.bitwise_or_, "BXOR": torch.Tensor.bitwise_xor_}


def reduce_problem(dtype: torch.dtype, op: str) -> str | None:
    """Why ``op`` cannot combine ``dtype`` tensors here (None: it can)."""
    if dtype not in REDUCIBLE:
        return f"cannot reduce {dtype} tensors; use a float or integer dtype"
    if op == "AVG" and not dtype.is_floating_point:
        return f"AVG of {dtype} tensors has no exact result; all_reduce with SUM and divide by the world size yourself"
    if op in ("BAND", "BOR", "BXOR") and dtype.is_floating_point:
        return f"{op} needs integer tensors, got {dtype}"
    return None


def combine(rows: torch.Tensor, out: torch.Tensor, op: str) -> None:
    """``out`` = rows[0] op rows[1] op ... op rows[W-1], in that order (``out`` may be ``rows[0]``)."""
    step, count, halves = _IN_PLACE[op], rows.shape[0], rows.dtype in (torch.float16, torch.bfloat16)
    if halves:
        acc = _widened(rows[0])
        for row in rows[1:]:
            step(acc, _widened(row))
    else:
        acc = out
        if op in ("SUM", "AVG") and rows.shape[0] > 1 and out.data_ptr() != rows[1].data_ptr():
            torch.add(rows[0], rows[1], out=out)  # one pass instead of a copy and an add
            rows = rows[1:]
        elif out.data_ptr() != rows[0].data_ptr():
            out.copy_(rows[0])
        for row in rows[1:]:
            step(acc, row)
    if op == "AVG":
        acc.div_(count)
    if acc is not out:
        out.copy_(acc)
    if out.dtype.is_floating_point and (halves or op in ("MIN", "MAX")):
        _canonical_nans(out, acc, op)


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}
_QUIET_NAN = {torch.float64: 0x7FF8000000000000, torch.float32: 0x7FC00000, torch.float16: 0x7E00,
              torch.bfloat16: 0x7FC0}


def _widened(half: torch.Tensor) -> torch.Tensor:
    """A float16 or bfloat16 row in float32, NaNs keeping their sign (torch's conversion drops it; the C
    core's and gloo's keep it)."""
    wide = half.float()
    nan = torch.isnan(wide)
    if bool(nan.any()):
        negative = half.view(torch.int16) < 0
        wide = torch.where(nan & negative, -torch.abs(wide), wide)
    return wide


def _canonical_nans(out: torch.Tensor, wide: torch.Tensor, op: str) -> None:
    """NaNs as the C core and gloo write them (torch's vector kernels write their own payloads, all ones on
    some CPUs): MIN and MAX the quiet NaN; otherwise, in float16 the quiet NaN with the float32 result's
    (``wide``) sign, in bfloat16 the quiet NaN (float32 and float64 keep the hardware's NaN)."""
    nan = torch.isnan(out)
    if not bool(nan.any()):
        return
    bits = out.view(_BITS[out.dtype])
    quiet = torch.tensor(_QUIET_NAN[out.dtype], dtype=torch.int64).to(bits.dtype)
    if out.dtype == torch.float16 and op not in ("MIN", "MAX"):
        quiet = torch.where(torch.signbit(wide), quiet | -0x8000, quiet)
    bits.copy_(torch.where(nan, quiet, bits))


class Collectives:
    """One group's collectives over its segment's slots; every rank must call them in the same order,
    each on contiguous CPU tensors."""

    def __init__(self, group: Group, slot_bytes: int):
        self.group, self.slot_bytes = group, slot_bytes
        self.rank, self.world_size = group.rank, group.world
        layout = group.layout
        self._slots = group.segment.bytes(layout.data_offset, 2 * group.world * slot_bytes).view(
            2, group.world, slot_bytes)

    # --- the per-collective header ---------------------------------------------------------------

    def _begin(self, kind: str, dtype: torch.dtype, numel: int, extra: int = 0) -> int:
        """Write what this rank is about to do (the Python path; the C core writes its own); the first
        barrier compares it. Returns the header set's index."""
        self.group.ensure_usable(kind)
        state = self.group.state
        index = state.ops
        state.ops += 1
        self.group.headers[index % 2, self.rank, :6] = (
            index + 1, KINDS.index(kind) + 1, HEADER_DTYPES[dtype], numel, numel * dtype.itemsize, extra)
        return index

    def _refuse(self, kind: str, problem: str | None) -> None:
        """A bad argument breaks the group, so that every rank raises."""
        if problem is not None:
            self.group.fail(f"sn: rank {self.rank} called {kind} with a bad argument: {problem}")

    def _check(self, kind: str, index: int, passed: bool) -> None:
        """Fail if another rank's header differs from this rank's: after the barrier every rank ``passed``
        (each wrote its header before it arrived), any rank's, its collective's number included (ranks at
        different collectives, whose barriers met); else, of the ranks that wrote this collective's."""
        rows = self.group.headers[index % 2, :, :6]
        written = (rows[:, 0] == index + 1) | passed
        if (rows[written] == rows[self.rank]).all():
            return
        described = "; ".join(f"rank {r}{' (this one)' if r == self.rank else ''}: {_describe(row)}"
                              for r, row in enumerate(rows.tolist()) if written[r])
        self.group.fail(f"{_MISMATCH} {kind} differently ({described}); every rank must call the same "
                        "collectives in the same order, with the same op, root, dtype and size")

    def _done(self, status: int, kind: str, index: int | None) -> None:
        """Raise what a barrier's status says went wrong; after a collective's first barrier (``index``
        given) ranks that called different collectives are named as such, from this rank's side, also
        when a peer found it first and broke the group."""
        mismatch_found = status == BROKEN and self.group.reason(self.group.state.culprit).startswith(_MISMATCH)
        if index is not None and (status in (OK, MISMATCH) or mismatch_found):
            self._check(kind, index, passed=status in (OK, MISMATCH))
        self.group.check(status, kind)

    def _native_done(self, status: int, kind: str) -> None:
        """Raise what a C collective's status says went wrong (it wrote its header: the latest one)."""
        if status:
            self._done(status, kind, self.group.state.ops - 1)

    def _barrier(self, kind: str, deadline: int, index: int | None = None) -> None:
        self._done(self.group.arrive_and_wait(deadline), kind, index)

    def _next_slots(self, dtype: torch.dtype) -> torch.Tensor:
        state = self.group.state
        slots = self._slots[state.chunks % 2].view(dtype)
        state.chunks += 1
        return slots

    def _post(self, kind: str, piece: torch.Tensor, dtype: torch.dtype, index: int, first: bool,
              deadline: int) -> torch.Tensor:
        """This rank's ``piece`` into its slot of the next set; once every rank has posted, that set's
        slots (after the first chunk, the headers compared)."""
        slots = self._next_slots(dtype)
        slots[self.rank, : piece.numel()].copy_(piece)
        self._barrier(kind, deadline, index if first else None)
        return slots

    def _chunk_elements(self, dtype: torch.dtype, per_rank_parts: int = 1) -> int:
        return max(1, self.slot_bytes // dtype.itemsize // per_rank_parts)

    # --- collectives -----------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str, timeout_s: float | None = None) -> None:
        """Combine ``tensor`` over the ranks in place.

        A chunk is combined whole by every rank (one barrier; every rank runs the same elementwise
        operations in the same order on the same values, so the results are bit-identical) while that
        reads little: at two ranks, or for small chunks. Otherwise each rank combines its own part of the
        chunk and all read the parts (a second barrier, but each rank reads each value once).
        """
        dtype, lib = tensor.dtype, self.group.native
        code = NATIVE_FLOATS.get(dtype) if lib is not None and op in _SUMS else None
        if code is not None:  # the C core writes and compares the headers, and sees a broken group itself
            self._native_done(lib.sn_all_reduce(
                self.group.pointer, tensor.data_ptr(), tensor.numel(), code, op == "AVG", WHOLE_CHUNK_BYTES,
                _ALL_REDUCE, HEADER_DTYPES[dtype], OPS.index(op), self.group.deadline(timeout_s)), "all_reduce")
            return
        self._refuse("all_reduce", reduce_problem(dtype, op))
        flat = tensor.view(-1)
        index = self._begin("all_reduce", dtype, flat.numel(), OPS.index(op))
        deadline = self.group.deadline(timeout_s)
        chunk = self._chunk_elements(dtype)
        for start in range(0, max(flat.numel(), 1), chunk):
            piece = flat[start : start + chunk]
            n = piece.numel()
            slots = self._post("all_reduce", piece, dtype, index, start == 0, deadline)
            if self.world_size <= 2 or n * dtype.itemsize * self.world_size <= WHOLE_CHUNK_BYTES:
                combine(slots[:, :n], piece, op)
                continue
            lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
            combine(slots[:, lo:hi], slots[0, lo:hi], op)
            self._barrier("all_reduce", deadline)
            piece.copy_(slots[0, :n])

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float | None = None) -> None:
        """``tensor`` of rank ``root`` into every rank's ``tensor``."""
        self._refuse("broadcast", None if 0 <= root < self.world_size else
                     f"root {root} is not a rank of this group of {self.world_size}")
        flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(-1)
        lib = self.group.native
        if lib is not None:
            self._native_done(lib.sn_broadcast(self.group.pointer, flat.data_ptr(), flat.numel(), root, _BROADCAST,
                                               HEADER_DTYPES[tensor.dtype], tensor.numel(),
                                               self.group.deadline(timeout_s)), "broadcast")
            return
        index = self._begin("broadcast", tensor.dtype, tensor.numel(), root)
        deadline = self.group.deadline(timeout_s)
        chunk = self.slot_bytes * self.world_size
        for start in range(0, max(flat.numel(), 1), chunk):
            piece = flat[start : start + chunk]
            buffer = self._next_slots(torch.uint8).view(-1)[: piece.numel()]
            if self.rank == root:
                buffer.copy_(piece)
            self._barrier("broadcast", deadline, index if start == 0 else None)
            if self.rank != root:
                piece.copy_(buffer)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        """Every rank's ``tensor`` into ``output`` (``world * tensor.numel()`` elements, in rank order)."""
        if output.numel() != tensor.numel() * self.world_size or output.dtype != tensor.dtype:
            self._refuse("all_gather", f"all_gather needs an output of {self.world_size} x {tensor.numel()} "
                                       f"{tensor.dtype}, got {output.numel()} {output.dtype}")
        flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(-1)
        out = output.view(-1).view(torch.uint8) if output.numel() else output.view(-1)
        lib = self.group.native
        if lib is not None:
            self._native_done(lib.sn_all_gather(self.group.pointer, flat.data_ptr(), out.data_ptr(), flat.numel(),
                                                _ALL_GATHER, HEADER_DTYPES[tensor.dtype], tensor.numel(),
                                                self.group.deadline(timeout_s)), "all_gather")
            return
        index = self._begin("all_gather", tensor.dtype, tensor.numel())
        deadline = self.group.deadline(timeout_s)
        rows = out.view(self.world_size, -1)
        for start in range(0, max(flat.numel(), 1), self.slot_bytes):
            piece = flat[start : start + self.slot_bytes]
            n = piece.numel()
            slots = self._post("all_gather", piece, torch.uint8, index, start == 0, deadline)
            rows[:, start : start + n].copy_(slots[:, :n])

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str,
                       timeout_s: float | None = None) -> None:
        """Part ``rank`` of the combination of every rank's ``tensor`` (``W * output.numel()``) into ``output``."""
        dtype, size, world = tensor.dtype, output.numel(), self.world_size
        problem = reduce_problem(dtype, op)
        if tensor.numel() != size * world or output.dtype != dtype:
            problem = (f"reduce_scatter needs an input of {world} x {size} {output.dtype}, got {tensor.numel()} "
                       f"{dtype}")
        self._refuse("reduce_scatter", problem)
        lib = self.group.native
        code = NATIVE_FLOATS.get(dtype) if lib is not None and op in _SUMS else None
        if code is not None:
            self._native_done(lib.sn_reduce_scatter(
                self.group.pointer, tensor.data_ptr(), output.data_ptr(), size, code, op == "AVG", _REDUCE_SCATTER,
                HEADER_DTYPES[dtype], OPS.index(op), self.group.deadline(timeout_s)), "reduce_scatter")
            return
        index = self._begin("reduce_scatter", dtype, size, OPS.index(op))
        deadline = self.group.deadline(timeout_s)
        parts, out = tensor.view(world, size), output.view(-1)
        chunk = self._chunk_elements(dtype, world)
        for start in range(0, max(size, 1), chunk):
            n = min(chunk, size - start)
            slots = self._next_slots(dtype)
            slots[self.rank, : world * n].view(world, n).copy_(parts[:, start : start + n])
            self._barrier("reduce_scatter", deadline, index if start == 0 else None)
            combine(slots[:, self.rank * n : (self.rank + 1) * n], out[start : start + n], op)

    def barrier(self, timeout_s: float | None = None) -> None:
        lib = self.group.native
        if lib is not None:
            self._native_done(lib.sn_collective_barrier(self.group.pointer, _BARRIER, HEADER_DTYPES[torch.uint8],
                                                        self.group.deadline(timeout_s)), "barrier")
            return
        index = self._begin("barrier", torch.uint8, 0)
        self._barrier("barrier", self.group.deadline(timeout_s), index)

    def close(self) -> None:
        self._slots = None


def _describe(row: list[int]) -> str:
    """A header row in words: the collective, its op or root, the dtype and the number of elements."""
    seq, kind, dtype, numel, nbytes, extra = row
    name = KINDS[kind - 1] if 0 < kind <= len(KINDS) else "?"
    detail = {"all_reduce": f" {OPS[extra]}" if 0 <= extra < len(OPS) else "",
              "reduce_scatter": f" {OPS[extra]}" if 0 <= extra < len(OPS) else "",
              "broadcast": f" from root {extra}"}.get(name, "")
    dtype_name = str(DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(DTYPES) else "?"
    return f"collective #{seq} {name}{detail} of {dtype_name}[{numel}] ({nbytes} bytes)"

