"""Reducers inside one node that move no byte through a socket: one worker's, and shared memory's."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...shm.chunked import NATIVE_FLOATS, Collectives, combine
from ...shm.group import SHM_SAFE, Group
from ...shm.layout import PAGE, Layout
from ...shm.segment import Segment
from .reducer import ReducerSetup, _Always


class LocalReducer(_Always):
    """One worker: its gradient already is the sum, and there is nobody to wait for."""

    name, timed = "local", False

    def __init__(self, setup: ReducerSetup):
        self.grad_flat = torch.zeros(setup.padded_numel, dtype=setup.dtype)
        self.shard_grad = self.grad_flat[setup.shard.start : setup.shard.stop]

    def watch(self, params, layout, backward_passes, bucket_bytes) -> None:
        pass

    def local_sum(self) -> float:
        return self.grad_flat.sum().item()

    def reduce(self) -> torch.Tensor:
        return self.shard_grad

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class ShmShared:
    """What ShmReducer's workers share, made by the launcher before they start: one segment (the shared-
    memory core's) holding the group's control block, the small sums' slots and every worker's gradient
    row. It travels to the workers by id; each attaches it. Gone when the launcher and its workers have
    all detached it, whatever ends them."""

    segment: Segment
    layout: Layout
    padded_numel: int
    dtype: torch.dtype
    sum_width: int  # float64 elements per worker per chunk of a small sum

    @classmethod
    def allocate(cls, world_size: int, padded_numel: int, dtype: torch.dtype, sum_width: int = 8) -> "ShmShared":
        """The gradient rows untouched: each worker touches its own row first (``ShmReducer``), so that on a
        NUMA machine its row lies on the worker's node."""
        sum_width = max(8, sum_width)
        slots = 2 * world_size * sum_width * 8
        row_bytes = padded_numel * dtype.itemsize
        layout = Layout(world_size, (slots + PAGE - 1) // PAGE * PAGE + world_size * row_bytes)
        return cls(Segment.create(layout.size), layout, padded_numel, dtype, sum_width)

    @property
    def rows_offset(self) -> int:
        return self.layout.data_offset + (2 * self.layout.world * self.sum_width * 8 + PAGE - 1) // PAGE * PAGE

    def release(self) -> None:
        """The launcher's hold on the segment, given up after the run."""
        self.segment.detach()


class ShmReducer:
    """Gradients summed through shared memory: worker r adds up column slice r of all rows, in rank order.

    The rows, the barrier (with each worker's liveness and the broken state) and the small sums are the
    shared-memory core's (``sn_trainer.shm``), as the "sn" backend's are.
    """

    name, timed, fallback = "shm", True, "gloo"

    @classmethod
    def unavailable(cls) -> str | None:
        return None if SHM_SAFE else "the shared-memory barrier relies on x86-64's store order"

    @classmethod
    def allocate(cls, workers: int, padded_numel: int, dtype: torch.dtype, sum_width: int) -> ShmShared:
        return ShmShared.allocate(workers, padded_numel, dtype, sum_width)

    def __init__(self, setup: ReducerSetup):
        shared, rank, world_size, shard = setup.shared, setup.rank, setup.world_size, setup.shard
        self.rank, self.world_size, self.shard = rank, world_size, shard
        self.group = Group(shared.segment, shared.layout, rank, world_size, setup.timeout_s,
                           slot_bytes=shared.sum_width * 8)
        self._sums = Collectives(self.group, shared.sum_width * 8)
        row_bytes = shared.padded_numel * shared.dtype.itemsize
        rows = shared.segment.bytes(shared.rows_offset, world_size * row_bytes).view(shared.dtype).view(
            world_size, shared.padded_numel)
        self.grad_flat = rows[rank]
        self.grad_flat.zero_()  # this worker touches its row first: its pages go on this worker's node
        self._columns = rows[:, shard.start : shard.stop]
        self.shard_grad = torch.empty(shard.size, dtype=shared.dtype)
        self._native_dtype = NATIVE_FLOATS.get(shared.dtype) if self.group.native is not None else None

    def watch(self, params, layout, backward_passes, bucket_bytes) -> None:
        pass  # summing waits for every row: nothing can start before the backward pass ends

    def local_sum(self) -> float:
        return self.grad_flat.sum().item()

    def reduce(self) -> torch.Tensor:
        self.group.barrier("the gradients' sum")  # every row is complete
        if self._native_dtype is None:
            combine(self._columns, self.shard_grad, "SUM")
        else:
            columns = self._columns
            self.group.native.sn_sum_rows(columns.data_ptr(), columns.stride(0) * columns.element_size(),
                                          self.world_size, 0, self.shard.size, self._native_dtype,
                                          self.shard_grad.data_ptr())
        return self.shard_grad

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        values = tensor.reshape(-1).contiguous()
        self._sums.all_reduce(values, "SUM")
        tensor.copy_(values.view(tensor.shape))
        return tensor

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        self.group.barrier("a barrier of the step")

    def close(self) -> None:
        self._sums.close()
        self.group.close(detach=False)  # the model's gradients view this worker's row until the worker ends
