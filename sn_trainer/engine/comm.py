"""Collectives between the workers of one node: summing gradients into shards, and barriers.

Every reducer owns the flat gradient buffer its worker's backward pass writes into
(``grad_flat``), may follow the backward pass to start early (``watch``), sums this worker's own
gradient before anything else is added to it (``local_sum``), turns the workers' buffers into
this worker's summed shard (``reduce``), sums small tensors over the node's workers
(``sum_in_node``) and over the nodes (``sum_across_nodes``), and synchronises (``barrier``).
Three kinds inside a node, and one wrapper across nodes:

- ``LocalReducer``: one worker, nothing to do;
- ``GlooReducer``: a gloo process group over loopback (all_reduce or reduce_scatter); with
  all_reduce, buckets of gradients are sent while the backward pass computes the rest;
- ``ShmReducer``: the workers' buffers are rows of one shared-memory tensor; each worker sums
  its own column slice of them, and barriers spin on per-worker counters in shared memory, so
  the hot path makes no system call and moves no byte through a socket;
- ``CrossNodeReducer``: wraps one of those; worker r then all-reduces its summed shard with
  worker r of every other node (one gloo group per shard index, so every core takes part).
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .shared import Shard

# Spinning is the fastest wait while every worker has a core; past this many polls the waiter
# yields its core, so that oversubscribed runs (workers > cores) still progress.
_SPINS_BEFORE_YIELD = 200
# The shm barrier publishes "my data is written" by a plain store to a counter; its peers rely
# on stores becoming visible in program order, which x86-64 guarantees (total store order).
SHM_SAFE = platform.machine().lower() in ("x86_64", "amd64")


@dataclass
class ShmBuffers:
    """Shared tensors for ShmReducer, allocated once by the launcher for all workers."""

    grad_rows: torch.Tensor  # [world, padded numel]: row r is worker r's gradient buffer
    arrivals: torch.Tensor  # [world] int64: barrier generation each worker has reached
    scratch: torch.Tensor  # [2, world, 8] float64: small all-reduces (norms, eval totals), double-buffered

    @classmethod
    def allocate(cls, world_size: int, padded_numel: int, dtype: torch.dtype) -> "ShmBuffers":
        return cls(grad_rows=torch.zeros(world_size, padded_numel, dtype=dtype).share_memory_(),
                   arrivals=torch.zeros(world_size, dtype=torch.int64).share_memory_(),
                   scratch=torch.zeros(2, world_size, 8, dtype=torch.float64).share_memory_())


def gloo_group(store, rank: int, size: int, device, timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group on one given device, used directly (never installed as the global default)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)


class LocalReducer:
    """One worker: its gradient already is the sum, and there is nobody to wait for."""

    name = "local"

    def __init__(self, shard: Shard, padded_numel: int, dtype: torch.dtype):
        self.shard = shard
        self.grad_flat = torch.zeros(padded_numel, dtype=dtype)

    def watch(self, params: list[torch.Tensor], backward_passes: int, bucket_bytes: int) -> None:
        pass

    def local_sum(self) -> float:
        return self.grad_flat.sum().item()

    def reduce(self) -> torch.Tensor:
        return self.grad_flat[self.shard.start : self.shard.stop]

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class GlooReducer:
    """A gloo process group over the node's workers, bound to the loopback interface only.

    The group object is used directly rather than installed as torch.distributed's global
    default group: nothing else in the process can reach it, and two groups never collide.
    all_reduce measured faster than gloo's reduce_scatter here (LeNet's 1.7 MB gradient, 2
    workers: ~3.6 ms vs ~8.5 ms), so it is the default; both stay selectable.
    """

    name = "gloo"

    def __init__(self, store_path: str, rank: int, world_size: int, shard: Shard, padded_numel: int,
                 dtype: torch.dtype, mode: str = "all_reduce", timeout_s: float = 300.0):
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"unknown reduce mode {mode!r}; choose all_reduce or reduce_scatter")
        store = dist.FileStore(store_path, world_size)
        self.group = gloo_group(store, rank, world_size,
                                dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"), timeout_s)
        self.shard, self.mode = shard, mode
        self.grad_flat = torch.zeros(padded_numel, dtype=dtype)
        self._recv = torch.empty(shard.padded_size, dtype=dtype)
        self._buckets: list[_Bucket] = []
        self._next_bucket = 0

    def watch(self, params: list[torch.Tensor], backward_passes: int, bucket_bytes: int) -> None:
        """All-reduce each bucket of gradients as soon as the backward pass has filled it.

        ``params`` are the parameters whose ``.grad`` are views of ``grad_flat``, in flat order;
        ``backward_passes`` is how many backward passes fill them per step (accumulate); a
        bucket closes at ``bucket_bytes`` or more (0: one all-reduce after the backward pass).
        """
        if self.mode != "all_reduce" or bucket_bytes <= 0:
            return
        self._buckets = _buckets_in_backward_order(params, self.grad_flat, backward_passes, bucket_bytes, self.group)
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_gradient, bucket))

    def _on_gradient(self, bucket: "_Bucket", _param: torch.Tensor) -> None:
        bucket.ready += 1
        # gloo pairs the workers' collectives by their order, so buckets leave in one fixed
        # order everywhere: each as soon as it and all before it are complete. The last one
        # (the first parameters) is held for reduce(): every worker publishes its loss and
        # gradient check before its last collective starts, so no peer can finish the step's
        # reduce before they are written.
        while self._next_bucket < len(self._buckets) - 1 and self._buckets[self._next_bucket].complete:
            self._buckets[self._next_bucket].send()
            self._next_bucket += 1

    def local_sum(self) -> float:
        """The sum of this worker's own gradient: of buckets already sent, as it was before sending."""
        if not self._buckets:
            return self.grad_flat.sum().item()
        return sum(bucket.local_sum() for bucket in self._buckets)

    def reduce(self) -> torch.Tensor:
        if self.mode == "all_reduce":
            if self._buckets:
                for bucket in self._buckets:
                    bucket.send()  # those not sent yet (the held one, any with unused parameters), in order
                for bucket in self._buckets:
                    bucket.finish()
                self._next_bucket = 0
            else:
                self.group.allreduce([self.grad_flat]).wait()
            return self.grad_flat[self.shard.start : self.shard.stop]
        self.group._reduce_scatter_base(self._recv, self.grad_flat).wait()
        return self._recv[: self.shard.size]

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([tensor]).wait()
        return tensor

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        self.group.barrier().wait()

    def close(self) -> None:
        self.group.shutdown()


class _Bucket:
    """A contiguous run of ``grad_flat`` (whole parameters), all-reduced in one collective."""

    def __init__(self, params: list[torch.Tensor], grad: torch.Tensor, expected: int, group):
        self.params, self.grad, self.group = params, grad, group
        self.expected = expected  # gradients accumulated into it per step: complete after that many
        self.ready, self._work, self._sum = 0, None, None

    @property
    def complete(self) -> bool:
        return self.ready == self.expected

    @property
    def sent(self) -> bool:
        return self._work is not None

    def local_sum(self) -> float:
        return self._sum if self.sent else self.grad.sum().item()

    def send(self) -> None:
        if not self.sent:
            self._sum = self.grad.sum().item()
            self._work = self.group.allreduce([self.grad])

    def finish(self) -> None:
        self._work.wait()
        self.ready, self._work, self._sum = 0, None, None


def _buckets_in_backward_order(params, grad_flat: torch.Tensor, backward_passes: int, bucket_bytes: int,
                               group) -> list[_Bucket]:
    """Group parameters from the last to the first (the order backward fills them) into buckets."""
    spans, offset = [], 0
    for p in params:
        spans.append((p, offset, offset + p.numel()))
        offset += p.numel()
    buckets, current, nbytes = [], [], 0
    for span in reversed(spans):
        current.append(span)
        nbytes += span[0].numel() * grad_flat.element_size()
        if nbytes >= bucket_bytes or span is spans[0]:
            start, stop = current[-1][1], current[0][2]
            buckets.append(_Bucket([p for p, _, _ in current], grad_flat[start:stop], backward_passes * len(current),
                                   group))
            current, nbytes = [], 0
    return buckets


class ShmReducer:
    """Gradients summed through shared memory: worker r adds up column slice r of all rows."""

    name = "shm"

    def __init__(self, buffers: ShmBuffers, rank: int, world_size: int, shard: Shard):
        self.rank, self.world_size, self.shard = rank, world_size, shard
        self.rows = buffers.grad_rows
        self.grad_flat = buffers.grad_rows[rank]
        self._columns = buffers.grad_rows[:, shard.start : shard.stop]
        self._recv = torch.empty(shard.size, dtype=buffers.grad_rows.dtype)
        self._arrivals = buffers.arrivals.numpy()  # numpy: a scalar store costs ~100 ns, not ~2 us
        self._scratch = buffers.scratch
        self._generation = 0
        self._sums = 0

    def watch(self, params: list[torch.Tensor], backward_passes: int, bucket_bytes: int) -> None:
        pass  # summing waits for every row: nothing can start before the backward pass ends

    def local_sum(self) -> float:
        return self.grad_flat.sum().item()

    def reduce(self) -> torch.Tensor:
        self.barrier()  # every row is complete
        torch.sum(self._columns, dim=0, out=self._recv)
        return self._recv

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        # Calls alternate between two scratch slots: a peer can write this slot again only two
        # calls later, after the next call's barrier, which waits for this worker's read.
        n = tensor.numel()
        slot = self._scratch[self._sums % 2]
        self._sums += 1
        slot[self.rank, :n] = tensor.reshape(-1)
        self.barrier()
        tensor.copy_(slot[:, :n].sum(dim=0).reshape(tensor.shape))
        return tensor

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        self._generation += 1
        arrivals, generation = self._arrivals, self._generation
        arrivals[self.rank] = generation
        spins = 0
        while arrivals.min() < generation:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()

    def close(self) -> None:
        pass


class CrossNodeReducer:
    """A node's reducer, then an all-reduce of each shard with the same shard of the other nodes.

    Every node applies the same update to the same parameters, so the nodes' shared parameters
    stay identical without ever being sent.
    """

    name = "cross-node"

    def __init__(self, local, store, node_rank: int, nodes: int, device, timeout_s: float = 300.0):
        self.local = local
        self.grad_flat = local.grad_flat
        self.group = gloo_group(store, node_rank, nodes, device, timeout_s)

    def watch(self, params: list[torch.Tensor], backward_passes: int, bucket_bytes: int) -> None:
        self.local.watch(params, backward_passes, bucket_bytes)

    def local_sum(self) -> float:
        return self.local.local_sum()

    def reduce(self) -> torch.Tensor:
        shard_grad = self.local.reduce()
        self.group.allreduce([shard_grad]).wait()
        return shard_grad

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.local.sum_in_node(tensor)

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([tensor]).wait()
        return tensor

    def barrier(self) -> None:
        self.local.barrier()

    def close(self) -> None:
        self.group.shutdown()
        self.local.close()


def calibrate(candidates: list, rounds: int = 8) -> list[float]:
    """Median seconds per reduce + barrier over ``rounds`` for each reducer (same in all workers)."""
    timings = []
    for reducer in candidates:
        samples = []
        for _ in range(rounds):
            reducer.barrier()
            start = time.perf_counter()
            reducer.reduce()
            reducer.barrier()
            samples.append(time.perf_counter() - start)
        samples.sort()
        timings.append(samples[len(samples) // 2])
    return timings


def make_reducer(comm: str, rank: int, world_size: int, shard: Shard, padded_numel: int, dtype: torch.dtype,
                 store_path: str, shm: ShmBuffers | None, reduce_mode: str = "all_reduce"):
    """The reducer ``comm`` names; ``auto`` measures shm against gloo here and keeps the faster.

    Every worker must call this with the same arguments but its own rank.
    """
    if world_size == 1:
        return LocalReducer(shard, padded_numel, dtype)
    if comm == "gloo" or shm is None:
        return GlooReducer(store_path, rank, world_size, shard, padded_numel, dtype, reduce_mode)
    shm_reducer = ShmReducer(shm, rank, world_size, shard)
    if comm == "shm":
        return shm_reducer
    gloo_reducer = GlooReducer(store_path, rank, world_size, shard, padded_numel, dtype, reduce_mode)
    shm_seconds, gloo_seconds = calibrate([shm_reducer, gloo_reducer])
    # Rank 0's measurement decides, so that every worker picks the same reducer.
    decision = torch.tensor([1.0 if shm_seconds <= gloo_seconds else 0.0] if rank == 0 else [0.0],
                            dtype=torch.float64)
    gloo_reducer.sum_in_node(decision)
    shm_reducer.grad_flat.zero_()
    gloo_reducer.grad_flat.zero_()
    if decision.item() > 0:
        gloo_reducer.close()
        return shm_reducer
    return gloo_reducer
