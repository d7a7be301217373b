"""What a worker contributes to a checkpoint: its phases' optimizer states, its random state,
compress=powersgd's states gathered from every node, and from worker 0 the model's."""
from __future__ import annotations

import torch

from ...data import random_state
from ..collectives.reducer import Reducer
from ...recipe.flat_layout import tied_aliases
from ..processes.pickling import pack
from .phases import WorkerPhase
from .worker_spec import WorkerSpec


class CheckpointShare:
    """This worker's share of each checkpoint, and what it keeps for one between steps."""

    def __init__(self, spec: WorkerSpec, phases: list[WorkerPhase], reducer: Reducer):
        self.shared, self.plan, self.rank, self.cluster = spec.shared, spec.shared.plan, spec.rank, spec.cluster
        self.model, self.layout = spec.shared.model, spec.shared.layout
        self.phases, self.reducer = phases, reducer
        self._compression_state: tuple[int, dict] | None = None  # compress=powersgd: (step, every node's state)

    def keep_compression(self, step_done: int) -> None:
        """At a scheduled checkpoint after ``step_done``, with compress=powersgd, every node's worker
        gathers its shard's compression state from all nodes: the leader's checkpoint keeps each node's."""
        compressor = getattr(self.reducer, "compressor", None)
        settings = self.plan.settings
        if compressor is None or settings.checkpoint.dir is None or not self.plan.checkpoint_due(step_done):
            return
        self._compression_state = (step_done, compressor.gathered_state(self.reducer.group, self.cluster.nodes))

    def part(self, step_done: int) -> bytes:
        """What this worker contributes to a checkpoint: its optimizer's state, its random state
        (and, from worker 0, the model's and where the stream goes on after step ``step_done``), as
        tensors and plain data."""
        part = {"rank": self.rank, "phases": [phase.state() for phase in self.phases], "rng": random_state.capture()}
        kept = self._compression_state
        if kept is not None and kept[0] == step_done:  # compress=powersgd: every node's, gathered at this step
            part["compress"] = kept[1]
        if self.rank == 0:
            part["model"] = {k: v.detach().clone(memory_format=torch.contiguous_format)
                             for k, v in self.model.state_dict().items()}
            part["ema"] = self.layout.by_name(self.shared.ema) if self.shared.ema is not None else None
            part["aliases"] = tied_aliases(self.model)
            part["stream"] = self.shared.train.position(step_done) if self.shared.train is not None else None
        return pack(part)
