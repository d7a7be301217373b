"""Collectives between the workers of one node: summing gradients into shards, and barriers."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .shared import Shard


class LocalReducer:
    """One worker: its gradient already is the sum, and there is nobody to wait for."""

    def __init__(self, shard: Shard):
        self.shard = shard

    def reduce(self, grad_flat: torch.Tensor) -> torch.Tensor:
        return grad_flat[self.shard.start : self.shard.stop]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class GlooReducer:
    """A gloo process group over the node's workers, bound to the loopback interface only.

    The group object is used directly rather than installed as torch.distributed's global
    default group: nothing else in the process can reach it, and two groups never collide.
    """

    def __init__(self, store_path: str, rank: int, world_size: int, shard: Shard, mode: str,
                 timeout_s: float = 300.0):
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"unknown reduce mode {mode!r}; choose all_reduce or reduce_scatter")
        store = dist.FileStore(store_path, world_size)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, options)
        self.shard = shard
        self.mode = mode
        self._recv = torch.empty(0)  # reduce_scatter's output, allocated once on first use

    def reduce(self, grad_flat: torch.Tensor) -> torch.Tensor:
        if self.mode == "all_reduce":
            self.group.allreduce([grad_flat]).wait()
            return grad_flat[self.shard.start : self.shard.stop]
        if self._recv.numel() != self.shard.padded_size:
            self._recv = torch.empty(self.shard.padded_size, dtype=grad_flat.dtype)
        self.group._reduce_scatter_base(self._recv, grad_flat).wait()
        return self._recv[: self.shard.size]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([tensor]).wait()
        return tensor

    def barrier(self) -> None:
        self.group.barrier().wait()

    def close(self) -> None:
        self.group.shutdown()


def make_reducer(store_path: str, rank: int, world_size: int, shard: Shard, mode: str):
    if world_size == 1:
        return LocalReducer(shard)
    return GlooReducer(store_path, rank, world_size, shard, mode)
