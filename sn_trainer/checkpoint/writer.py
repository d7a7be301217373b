"""In the launcher: every worker's part of a checkpoint gathered into one file, written when complete."""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from ..callbacks import Callback, Callbacks
from ..engine.events import CheckpointPart
from ..engine import PhaseSpec, optimizer_state, unpack
from ..recipe.flat_layout import FlatLayout
from ..errors import TrainingDiverged
from . import contents
from .directory import CheckpointDir

log = logging.getLogger(__name__)


class CheckpointWriter(Callback):
    """A callback of the run: gathers the workers' ``CheckpointPart``s of a step and, when every
    worker's has come, writes the checkpoint to ``directory`` and tells ``callbacks`` (``on_checkpoint``).

    ``sample_order`` is what a resume must agree with (``checkpoint.resume.sample_order``);
    ``run_config`` the plain data kept in the file beside it (the command line's config);
    ``carried`` what the launch sets for its checkpoints to carry on (the membership list, the
    torchrun job that wrote them).
    """

    essential = True  # a checkpoint that cannot be written ends the run: it is what a resume needs

    def __init__(self, directory: CheckpointDir | None, layout: FlatLayout, phases: list[PhaseSpec],
                 sample_order: dict[str, Any], run_config: dict[str, Any] | None, callbacks: Callbacks):
        self.directory, self.layout, self.phases = directory, layout, phases
        self.sample_order, self.run_config, self.callbacks = sample_order, run_config, callbacks
        self._parts: dict[int, dict[int, dict[str, Any]]] = {}
        self._states: dict[int, dict[str, Any]] = {}  # by step: the callbacks' states when worker 0's part came
        self.last_saved: Path | None = None
        self.carried: dict[str, Any] = {}

    def on_checkpoint_part(self, trainer, part: CheckpointPart) -> None:
        if self.directory is None:
            return
        parts = self._parts.setdefault(part.step, {})
        parts[part.rank] = unpack(part.data)
        if part.rank == 0:
            # The callbacks as they are at this step: worker 0 sends every event that moves them
            # (progress, evaluations) and its part after its step's events, in order, while another
            # worker's part may come after worker 0's events of later steps.
            self._states[part.step] = copy.deepcopy(self.callbacks.states())
        if len(parts) < self.layout.world_size:
            return
        del self._parts[part.step]
        saved = self._assemble(part.step, [parts[r] for r in range(self.layout.world_size)],
                               self._states.pop(part.step))
        if not contents.is_finite(saved):  # finite gradients, and yet: an update overflowed
            raise TrainingDiverged(part.step, parameters=True)
        try:
            self.last_saved = self.directory.save(saved)
        except OSError as exc:  # a full disk: stop, rather than train on with nothing to resume from
            raise OSError(exc.errno, f"cannot write the checkpoint of step {part.step} to {self.directory.path} "
                                     f"({exc.strerror}); the checkpoints before it are intact") from None
        log.info("checkpoint: %s", self.last_saved)
        self.callbacks.call("on_checkpoint", trainer, self.last_saved)

    def _assemble(self, step: int, ordered: list[dict[str, Any]], callbacks: dict[str, Any]) -> dict[str, Any]:
        """One checkpoint from every worker's part, in rank order: each phase's optimizer state per
        parameter name, the model's, every worker's random state; and the callbacks' states."""
        optimizers, schedules = [], []
        for index, phase in enumerate(self.phases):
            held = [p["phases"][index]["optimizer"] for p in ordered]
            optimizers.append(optimizer_state.gather(held, self.layout, phase.slot_groups)
                              if any(h is not None for h in held) else None)
            # A plateau scheduler's state: the same in every worker that holds one of this phase's pieces.
            schedules.append(next((p["phases"][index]["schedule"] for p in ordered
                                   if p["phases"][index]["schedule"] is not None), None))
        optimizer, schedule = contents.phase_entries(optimizers, schedules)
        run = {**self.sample_order, "workers": self.layout.world_size, "stream": ordered[0].get("stream"),
               **self.carried}
        saved = contents.build(step, ordered[0]["model"], optimizer, [p["rng"] for p in ordered], run,
                               self.run_config, schedule=schedule, ema=ordered[0].get("ema"),
                               aliases=ordered[0].get("aliases"), callbacks=callbacks)
        if all("compress" in p for p in ordered):  # compress=powersgd: each shard's, of every node
            saved["compress"] = [p["compress"] for p in ordered]
        return saved
