"""Collectives between the workers of one node: summing gradients into shards, and barriers.

Every reducer follows the ``Reducer`` protocol below and is registered by its name (``comm=``
takes it; a new reducer is one class here, ``@registered``). Three kinds inside a node, and one
wrapper across nodes:

- ``LocalReducer``: one worker, nothing to do;
- ``GlooReducer``: a gloo process group over loopback (all_reduce or reduce_scatter); with
  all_reduce, buckets of gradients are sent while the backward pass computes the rest;
- ``ShmReducer``: the workers' buffers are rows of one shared-memory segment (the shared-memory
  core's, ``sn_trainer.shm``, which the "sn" backend runs on too); each worker sums its own column
  slice of them after the core's barrier, so the hot path moves no byte through a socket;
- ``CrossNodeReducer``: wraps one of those; worker r then all-reduces its summed shard with
  worker r of every other node (one gloo group per shard index, so every core takes part).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from ...errors import ConfigError
from ...shm.chunked import NATIVE_FLOATS, Collectives, combine
from ...shm.group import SHM_SAFE, Group
from ...shm.layout import PAGE, Layout
from ...shm.segment import Segment
from ...recipe.flat_layout import FlatLayout, Shard


@dataclass(frozen=True)
class ReducerSetup:
    """What every worker builds its reducer from: the same in all of them but the rank."""

    rank: int
    world_size: int
    shard: Shard  # this worker's
    padded_numel: int
    dtype: torch.dtype
    store_path: str  # a FileStore's file, for a rendezvous in the node
    mode: str  # the collective (settings.reduce)
    timeout_s: float  # a backstop behind the launcher's watchdog
    shared: Any = None  # what the launcher allocated for this kind of reducer (``allocate``)


class Reducer(Protocol):
    """How the workers of a run turn their gradients into summed shards, and synchronise."""

    name: ClassVar[str]  # what comm= calls it
    timed: ClassVar[bool]  # comm=auto times it against the others, where it is available
    fallback: ClassVar[str | None]  # what runs where it is not available (None: it always is)
    grad_flat: torch.Tensor  # this worker's gradient buffer: backward writes into it
    shard_grad: torch.Tensor  # where reduce() leaves the summed gradient of this worker's shard

    @classmethod
    def unavailable(cls) -> str | None:
        """Why it cannot run on this machine (None: it can)."""

    @classmethod
    def allocate(cls, workers: int, padded_numel: int, dtype: torch.dtype, sum_width: int) -> Any:
        """What its workers share, made by the launcher before they start (None: nothing);
        ``sum_width`` is the widest small sum of the run (batch norm's statistics, evaluation's)."""

    def __init__(self, setup: ReducerSetup) -> None:
        ...

    def watch(self, params: list[torch.Tensor], layout: FlatLayout, backward_passes: int, bucket_bytes: int) -> None:
        """Follow the backward pass (``params`` in layout order), to start sending early where it can."""

    def local_sum(self) -> float:
        """The sum of this worker's own gradient, before anything is added to it."""

    def reduce(self) -> torch.Tensor:
        """Sum every worker's gradient; return ``shard_grad`` holding this worker's shard of the sum."""

    def sum_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 tensor over this node's workers, in place."""

    def sum_across_nodes(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the nodes, in place (nothing to do on one node)."""

    def barrier(self) -> None:
        """Return when every worker of the node has called it."""

    def close(self) -> None:
        ...


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


REDUCERS: dict[str, type] = {}  # by name, in the order comm=auto times them


def registered(kind: type) -> type:
    """Make a reducer class one that ``comm=<its name>`` runs."""
    REDUCERS[kind.name] = kind
    return kind


def auto_candidates() -> list[str]:
    """The reducers comm=auto times against each other here."""
    return [name for name, kind in REDUCERS.items() if kind.timed and kind.unavailable() is None]


def choose_reducer(comm: str, workers: int, notes: list[str]) -> str:
    """What ``comm`` runs with ``workers`` workers here: the one-worker reducer for one, a
    registered reducer's name, or ``auto`` (the workers time the candidates at start-up); a
    fallback goes in ``notes``.

    Raises:
        ConfigError: no reducer of that name, or the one-worker reducer for several workers.
    """
    if comm != "auto" and comm not in REDUCERS:
        raise ConfigError(f"comm must be one of auto, {', '.join(REDUCERS)}, got {comm!r}")
    if workers == 1:
        return LocalReducer.name
    if comm == LocalReducer.name:
        raise ConfigError(f"comm={comm} sums nothing: it is one worker's; with workers={workers} use auto, "
                          f"{', '.join(name for name in REDUCERS if name != comm)}")
    why = REDUCERS[comm].unavailable() if comm != "auto" else None
    if why:
        fallback = REDUCERS[comm].fallback
        notes.append(f"comm={comm} asked for, {fallback} ran: {why}")
        return fallback
    return comm


def gloo_group(store, rank: int, size: int, device, timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group on one given device, used directly (never installed as the global default)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)


class _Always:
    """A reducer that runs anywhere and shares nothing made by the launcher."""

    fallback = None

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    @classmethod
    def allocate(cls, workers: int, padded_numel: int, dtype: torch.dtype, sum_width: int) -> Any:
        return None


@registered
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


@registered
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


@registered
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


def calibrate(candidates: list[Reducer], rounds: int = 8) -> list[float]:
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


def make_reducer(comm: str, setup: ReducerSetup, kinds: dict[str, tuple[type, Any]]) -> Reducer:
    """The reducer ``comm`` names, of the ``kinds`` the launcher chose for the run (by name: each
    class, and what the launcher allocated for it); ``auto`` times them against each other here and
    keeps the fastest. Every worker must call this with the same arguments but its own rank in
    ``setup``.
    """
    if comm != "auto":
        kind, shared = kinds[comm]
        return kind(dataclasses.replace(setup, shared=shared))
    candidates = [kind(dataclasses.replace(setup, shared=shared)) for kind, shared in kinds.values()]
    if len(candidates) == 1:
        return candidates[0]
    seconds = calibrate(candidates)
    # Rank 0's measurement decides, so that every worker picks the same reducer.
    decision = torch.tensor([1.0 + seconds.index(min(seconds)) if setup.rank == 0 else 0.0], dtype=torch.float64)
    candidates[-1].sum_in_node(decision)
    chosen = candidates[int(decision.item()) - 1]
    for candidate in candidates:
        candidate.grad_flat.zero_()
        if candidate is not chosen:
            candidate.close()
    return chosen
