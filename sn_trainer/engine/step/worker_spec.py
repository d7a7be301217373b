"""What a worker receives: what the workers of one launch share (``Shared``) and its own part (``WorkerSpec``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...data.source import Source
from ...recipe.flat_layout import FlatLayout
from ...node.cluster import Cluster
from ..plan import Plan
from ..processes.supervise import Heartbeats
from ..processes.signals import StopFlags
from .board import Board
from ...recipe.objective import Objective
from .phases import PhaseSpec


@dataclass
class Shared:
    """What the workers of one launch share. Tensors in it live in shared memory: pickling sends handles."""

    plan: Plan
    model: nn.Module
    layout: FlatLayout
    flat: torch.Tensor
    train: Source | None  # the training set, as the workers read it
    evaluation: Source | None  # the evaluation set
    objective: Objective  # what evaluation computes (the first phase's loss, and the metrics)
    phases: list[PhaseSpec]  # one optimizer each, updated in turn every step
    board: Board
    stop: StopFlags
    heartbeats: Heartbeats
    reducers: dict[str, tuple[type, Any]]  # the reducers the workers may build: each class, what it shares
    ema: torch.Tensor | None = None  # the parameters' moving average, laid out as ``flat`` (ema_decay)
    verify_grads: torch.Tensor | None = None  # laid out as ``flat``: every shard's summed gradient, at a verified step
    verify_bell: torch.Tensor | None = None  # an int32 the other workers sleep on while worker 0 verifies


@dataclass
class WorkerSpec:
    rank: int  # within the node
    store_path: str
    shared: Shared
    share: dict[str, Any] | None = None  # this worker's share of a checkpoint: each phase's state, random state
    cluster: Cluster | None = None  # several nodes under torchrun

    @property
    def global_rank(self) -> int:
        """This worker's rank among every node's workers."""
        placement = self.shared.plan.placement
        return placement.node_rank * placement.workers + self.rank
