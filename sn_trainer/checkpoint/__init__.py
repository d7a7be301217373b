"""Checkpoints, the one package that knows them: what the file holds (``contents``), the folder
they are written to (``directory``) and its lock (``lock``), how one is read back and checked
(``loading``), the launcher's writer that gathers every worker's part into one (``writer``), and
what a resume loads, checks and hands each worker (``resume``). The engine hands out tensors and
plain data only."""
from __future__ import annotations

from .contents import FORMAT, VERSION, build, is_finite, optimizer_state, phase_entries, phase_states
from .directory import CheckpointDir
from .loading import check_model, check_optimizer, load, load_resumable, resolve

__all__ = ["FORMAT", "VERSION", "CheckpointDir", "build", "check_model", "check_optimizer", "is_finite", "load",
           "load_resumable", "optimizer_state", "phase_entries", "phase_states", "resolve"]
