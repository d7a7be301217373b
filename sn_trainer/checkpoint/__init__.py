"""Checkpoints, the one package that knows them: the file (``files``), the launcher's writer that
gathers every worker's part into one (``writer``), and what a resume loads, checks and hands each
worker (``resume``). The engine hands out tensors and plain data only."""
from __future__ import annotations

from .files import (FORMAT, VERSION, CheckpointDir, build, check_model, check_optimizer, is_finite, load,
                    load_resumable, optimizer_state, phase_entries, phase_states, resolve)

__all__ = ["FORMAT", "VERSION", "CheckpointDir", "build", "check_model", "check_optimizer", "is_finite", "load",
           "load_resumable", "optimizer_state", "phase_entries", "phase_states", "resolve"]
