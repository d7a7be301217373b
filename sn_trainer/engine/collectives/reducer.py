"""What a reducer is: the setup each worker builds one from, and the protocol every kind follows.

A reducer sums the gradients of the workers of one node into shards, and is their barrier. Every
kind follows the ``Reducer`` protocol below and is registered by its name in ``registry.py``
(``comm=`` takes it). Three kinds inside a node, and one wrapper across nodes:

- ``LocalReducer`` (``in_node.py``): one worker, nothing to do;
- ``ShmReducer`` (``in_node.py``): the workers' buffers are rows of one shared-memory segment (the
  shared-memory core's, ``sn_trainer.shm``, which the "sn" backend runs on too); each worker sums
  its own column slice of them after the core's barrier, so the hot path moves no byte through a socket;
- ``GlooReducer`` (``over_gloo.py``): a gloo process group over loopback (all_reduce or
  reduce_scatter); with all_reduce, buckets of gradients are sent while the backward pass computes the rest;
- ``CrossNodeReducer`` (``over_gloo.py``): wraps one of those; worker r then all-reduces its summed
  shard with worker r of every other node (one gloo group per shard index, so every core takes part).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

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


class _Always:
    """A reducer that runs anywhere and shares nothing made by the launcher."""

    fallback = None

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    @classmethod
    def allocate(cls, workers: int, padded_numel: int, dtype: torch.dtype, sum_width: int) -> Any:
        return None
