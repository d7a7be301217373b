"""The collectives of the "sn" backend, moved in fixed-size chunks through one group's segment.

Every element of a reduction is combined in the order rank 0, 1, ..., W-1, by elementwise operations
only: either by one rank whose result all then read, or by every rank from the same values with the
same operations. Either way the ranks' results are bit-identical by construction, and the same for the
same inputs whatever the chunking. float16 and bfloat16 are combined in float32 and rounded once at the
end (the exact sum of W values rounded to the dtype once, where float32 holds it exactly).

Chunks alternate between the segment's two slot sets: a rank writes a set again only after the
next chunk's barrier, which every rank reaches only once it has read the previous chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import CollectiveFailed
from .segment import Segment

# Up to this many bytes read per chunk, every rank combines a whole chunk itself (see all_reduce).
_WHOLE_CHUNK_BYTES = 1 << 20
# Codes written in the segment's headers, compared across ranks before any data is read.
_DTYPES = {dtype: code for code, dtype in enumerate((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool))}
_KINDS = {name: code for code, name in enumerate(
    ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"), start=1)}
_OPS = {dist.ReduceOp.SUM: "SUM", dist.ReduceOp.AVG: "AVG", dist.ReduceOp.PRODUCT: "PRODUCT",
        dist.ReduceOp.MIN: "MIN", dist.ReduceOp.MAX: "MAX", dist.ReduceOp.BAND: "BAND",
        dist.ReduceOp.BOR: "BOR", dist.ReduceOp.BXOR: "BXOR"}
_IN_PLACE = {"SUM": torch.Tensor.add_, "AVG": torch.Tensor.add_, "PRODUCT": torch.Tensor.mul_,
             "MIN": lambda a, b: torch.minimum(a, b, out=a), "MAX": lambda a, b: torch.maximum(a, b, out=a),
             "BAND": torch.Tensor.bitwise_and_, "BOR": torch.Tensor.bitwise_or_, "BXOR": torch.Tensor.bitwise_xor_}


def reduce_op_name(op) -> str:
    """The name of a ``dist.ReduceOp`` this backend combines; a premultiplied sum is refused."""
    for known, name in _OPS.items():
        if op == known:
            return name
    if op == dist.ReduceOp.PREMUL_SUM:  # what FSDP2 asks for under a gradient divide factor of its own
        raise CollectiveFailed("sn backend: ReduceOp.PREMUL_SUM is not supported (nor by gloo); scale the tensors "
                               "and use SUM (FSDP2: call set_force_sum_reduction_for_comms(True) on the module)")
    raise CollectiveFailed(f"sn backend: reduce op {op} is not supported; use SUM, AVG, PRODUCT, MIN, MAX, "
                           "BAND, BOR or BXOR")


def check_reducible(dtype: torch.dtype, op: str) -> None:
    if dtype not in _DTYPES:
        raise CollectiveFailed(f"sn backend: cannot reduce {dtype} tensors; use a float or integer dtype")
    if op == "AVG" and not dtype.is_floating_point:
        raise CollectiveFailed(f"sn backend: AVG of {dtype} tensors has no exact result; all_reduce with SUM "
                               "and divide by the world size yourself")
    if op in ("BAND", "BOR", "BXOR") and dtype.is_floating_point:
        raise CollectiveFailed(f"sn backend: {op} needs integer tensors, got {dtype}")


def combine(rows: torch.Tensor, out: torch.Tensor, op: str) -> None:
    """``out`` = rows[0] op rows[1] op ... op rows[W-1], in that order (``out`` may be ``rows[0]``)."""
    step, count = _IN_PLACE[op], rows.shape[0]
    if rows.dtype in (torch.float16, torch.bfloat16):
        acc = rows[0].float()
        for row in rows[1:]:
            step(acc, row.float())
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


class Collectives:
    """One group's collectives over its segment; every rank must call them in the same order."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.rank, self.world_size = segment.rank, segment.world_size
        self._ops = 0  # collectives so far: the header set they use
        self._chunks = 0  # chunks so far: the slot set they use

    # --- the per-collective header ---------------------------------------------------------------

    def _begin(self, kind: str, dtype: torch.dtype, numel: int, extra: int = 0) -> None:
        """Write what this rank is about to do; ``_check`` compares it after the first barrier."""
        self._header = self.segment.headers[self._ops % 2]
        self._ops += 1
        self._header[self.rank, :5] = (self._ops, _KINDS[kind], _DTYPES.get(dtype, 99), numel, extra)

    def _check(self, kind: str) -> None:
        rows = self._header[:, :5]
        if (rows == rows[self.rank]).all():
            return
        described = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows.tolist()))
        raise CollectiveFailed(f"sn backend: the ranks called {kind} differently ({described}); every rank "
                               "must call the same collectives in the same order, with tensors of the same "
                               "size and dtype")

    def _next_slots(self, dtype: torch.dtype) -> torch.Tensor:
        slots = self.segment.slots(self._chunks % 2, dtype)
        self._chunks += 1
        return slots

    def _post(self, kind: str, piece: torch.Tensor, dtype: torch.dtype, first: bool) -> torch.Tensor:
        """This rank's ``piece`` into its slot of the next set; once every rank has posted, that set's
        slots (after the first chunk, the headers compared)."""
        slots = self._next_slots(dtype)
        slots[self.rank, : piece.numel()].copy_(piece)
        self.segment.barrier(kind)
        if first:
            self._check(kind)
        return slots

    def _chunk_elements(self, dtype: torch.dtype, per_rank_parts: int = 1) -> int:
        return max(1, self.segment.slot_bytes // dtype.itemsize // per_rank_parts)

    # --- collectives -----------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Combine ``tensor`` over the ranks in place (contiguous).

        A chunk is combined whole by every rank (one barrier; every rank runs the same elementwise
        operations in the same order on the same values, so the results are bit-identical) while that
        reads little: at two ranks, or for small chunks. Otherwise each rank combines its own part of the
        chunk and all read the parts (a second barrier, but each rank reads each value once).
        """
        check_reducible(tensor.dtype, op)
        flat = tensor.view(-1)
        self._begin("all_reduce", tensor.dtype, flat.numel(), list(_IN_PLACE).index(op))
        chunk = self._chunk_elements(tensor.dtype)
        for start in range(0, max(flat.numel(), 1), chunk):
            piece = flat[start : start + chunk]
            n = piece.numel()
            slots = self._post("all_reduce", piece, tensor.dtype, first=start == 0)
            if self.world_size <= 2 or n * tensor.dtype.itemsize * self.world_size <= _WHOLE_CHUNK_BYTES:
                combine(slots[:, :n], piece, op)
                continue
            lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
            combine(slots[:, lo:hi], slots[0, lo:hi], op)
            self.segment.barrier("all_reduce")
            piece.copy_(slots[0, :n])

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """``tensor`` of rank ``root`` into every rank's ``tensor`` (contiguous)."""
        flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(-1)
        self._begin("broadcast", tensor.dtype, tensor.numel(), root)
        chunk = self.segment.slot_bytes * self.world_size
        for start in range(0, max(flat.numel(), 1), chunk):
            piece = flat[start : start + chunk]
            buffer = self._next_slots(torch.uint8).view(-1)[: piece.numel()]
            if self.rank == root:
                buffer.copy_(piece)
            self.segment.barrier("broadcast")
            if start == 0:
                self._check("broadcast")
            if self.rank != root:
                piece.copy_(buffer)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into ``outputs[rank]`` on every rank (all contiguous, same size)."""
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.reshape(-1)
        out = [o.view(-1).view(torch.uint8) if o.numel() else o.view(-1) for o in outputs]
        self._begin("all_gather", tensor.dtype, tensor.numel())
        chunk = self.segment.slot_bytes
        for start in range(0, max(flat.numel(), 1), chunk):
            piece = flat[start : start + chunk]
            n = piece.numel()
            slots = self._post("all_gather", piece, torch.uint8, first=start == 0)
            for r in range(self.world_size):
                out[r][start : start + n].copy_(slots[r, :n])

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str) -> None:
        """Part ``rank`` of the combination of every rank's ``tensor`` (``W * output.numel()``) into ``output``."""
        check_reducible(tensor.dtype, op)
        size, world = output.numel(), self.world_size
        parts, out = tensor.view(world, size), output.view(-1)
        self._begin("reduce_scatter", tensor.dtype, size, list(_IN_PLACE).index(op))
        chunk = self._chunk_elements(tensor.dtype, world)
        for start in range(0, max(size, 1), chunk):
            n = min(chunk, size - start)
            slots = self._next_slots(tensor.dtype)
            slots[self.rank, : world * n].view(world, n).copy_(parts[:, start : start + n])
            self.segment.barrier("reduce_scatter")
            if start == 0:
                self._check("reduce_scatter")
            mine = slots[:, self.rank * n : (self.rank + 1) * n]
            combine(mine, out[start : start + n], op)

    def barrier(self) -> None:
        self._begin("barrier", torch.uint8, 0)
        self.segment.barrier("barrier")
        self._check("barrier")


def _describe(row: list[int]) -> str:
    """A header row in words: the collective, the dtype and the number of elements."""
    seq, kind, dtype, numel, _ = row
    kinds = {code: name for name, code in _KINDS.items()}
    dtypes = {code: str(d).replace("torch.", "") for d, code in _DTYPES.items()}
    return f"collective #{seq} {kinds.get(kind, '?')} of {dtypes.get(dtype, '?')}[{numel}]"
