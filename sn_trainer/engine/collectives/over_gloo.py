"""Reducers over gloo process groups: the node's workers over loopback, and the nodes' shards between them."""
from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from .reducer import Reducer, ReducerSetup, _Always


def gloo_group(store, rank: int, size: int, device, timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group on one given device, used directly (never installed as the global default)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)


class GlooReducer(_Always):
    """A gloo process group over the node's workers, bound to the loopback interface only.

    The group object is used directly rather than installed as torch.distributed's global
    default group: nothing else in the process can reach it, and two groups never collide.
    """

    name, timed = "gloo", True

    def __init__(self, setup: ReducerSetup):
        store_path, rank, world_size, shard = setup.store_path, setup.rank, setup.world_size, setup.shard
        padded_numel, dtype, mode, timeout_s = setup.padded_numel, setup.dtype, setup.mode, setup.timeout_s
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"unknown reduce mode {mode!r}; choose all_reduce or reduce_scatter")
        store = dist.FileStore(store_path, world_size)
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        self.group = gloo_group(store, rank, world_size, device, timeout_s)
        # Small sums (losses, batch norm's statistics inside the backward pass) go through a group of
        # their own: gloo pairs collectives by their order in a group, and the gradient buckets'
        # order relative to batch norm's sums can differ between workers (a branch one takes).
        self.sums = gloo_group(dist.PrefixStore("sums", store), rank, world_size, device, timeout_s)
        self.shard, self.mode = shard, mode
        self.grad_flat = torch.zeros(padded_numel, dtype=dtype)
        if mode == "all_reduce":
            self.shard_grad = self.grad_flat[shard.start : shard.stop]
        else:
            self._recv = torch.empty(shard.padded_size, dtype=dtype)
            self.shard_grad = self._recv[: shard.size]
        self._buckets: list[_Bucket] = []
        self._next_bucket = 0

    def watch(self, params, layout, backward_passes, bucket_bytes) -> None:
        """All-reduce each bucket of gradients as soon as the backward pass has filled it.

        ``backward_passes`` is how many backward passes fill them per step (accumulate); a
        bucket closes at ``bucket_bytes`` or more (0: one all-reduce after the backward pass).
        """
        if self.mode != "all_reduce" or bucket_bytes <= 0:
            return
        for start, stop, slots in layout.bucket_spans(bucket_bytes, self.grad_flat.element_size()):
            bucket = _Bucket(self.grad_flat[start:stop], backward_passes * len(slots), self.group)
            self._buckets.append(bucket)
            for index in slots:
                params[index].register_post_accumulate_grad_hook(functools.partial(self._on_gradient, bucket))

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
        else:
            self.group._reduce_scatter_base(self._recv, self.grad_flat).wait()
        return self.shard_grad

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sums.allreduce([tensor]).wait()
        return tensor

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        self.group.barrier().wait()

    def close(self) -> None:
        self.sums.shutdown()
        self.group.shutdown()


class _Bucket:
    """A contiguous run of ``grad_flat`` (whole parameters), all-reduced in one collective."""

    def __init__(self, grad: torch.Tensor, expected: int, group):
        self.grad, self.group = grad, group
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


class CrossNodeReducer:
    """A node's reducer, then an all-reduce of each shard with the same shard of the other nodes.

    Every node applies the same update to the same parameters, so the nodes' shared parameters
    stay identical without ever being sent. ``compressor`` (compress=powersgd) sends the shard
    as low-rank factors instead (compression.py): approximate.
    """

    def __init__(self, local: Reducer, store, node_rank: int, nodes: int, device, timeout_s: float = 300.0,
                 compressor=None):
        self.local, self.compressor = local, compressor
        self.name = f"{local.name} in the node, gloo across {nodes} nodes{', powersgd' if compressor else ''}"
        self.grad_flat = local.grad_flat
        self.shard_grad = local.shard_grad
        self.group = gloo_group(store, node_rank, nodes, device, timeout_s)

    def watch(self, params, layout, backward_passes, bucket_bytes) -> None:
        self.local.watch(params, layout, backward_passes, bucket_bytes)

    def local_sum(self) -> float:
        return self.local.local_sum()

    def reduce(self) -> torch.Tensor:
        shard_grad = self.local.reduce()
        if self.compressor is not None:
            return self.compressor.reduce(shard_grad, self.group)
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
