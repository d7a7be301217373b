"""sn_trainer: data-parallel training on the cores of one CPU node, with one shared model.

Importing the package imports no torch: ``python -m sn_trainer`` starts its warm workers' fork
server first, so that it and this process import torch at the same time. The names below load
on first use.
"""
from .errors import (CheckpointError, ConfigError, DataError, InputError, LossDoesNotSplit, NotExact,
                     TrainingDiverged, TrainingInterrupted, UserCodeError, WorkerFailed)

__all__ = ["BestCheckpoint", "Callback", "CheckpointConfig", "CheckpointError", "Cluster", "ConfigError", "DataError",
           "EarlyStopping", "FitResult", "InputError", "LossDoesNotSplit", "NotExact", "Phase", "Trainer",
           "TrainerConfig", "TrainingDiverged", "TrainingInterrupted", "UserCodeError", "VerifyReport", "WorkerFailed",
           "diagnose", "gather", "warm_up"]
__version__ = "0.3.0"

_LAZY = {"Trainer": ".trainer", "FitResult": ".fit.result", "TrainerConfig": ".config", "CheckpointConfig": ".config",
         "Cluster": ".node.cluster", "Callback": ".callbacks", "EarlyStopping": ".callbacks",
         "BestCheckpoint": ".callbacks", "Phase": ".phase", "gather": ".recipe.gather",
         "diagnose": ".doctor", "VerifyReport": ".fit.proof"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def warm_up(allocator: str | None = None, openmp: str | None = None) -> None:
    """Start the warm workers' fork server now: call it first thing in a script (under ``if
    __name__ == "__main__":``), before importing torch, and the server imports torch while the
    script does. A Trainer starts it otherwise, when it is made. Its workers run with
    ``allocator`` and ``openmp`` (default: the settings' defaults; a Trainer that asks for others
    spawns its workers cold)."""
    from .node.runtime import Runtime, default_runtime
    from .engine import forkserver

    default = default_runtime()
    forkserver.start(Runtime(allocator or default.allocator, openmp or default.openmp))
