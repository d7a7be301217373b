"""sn_trainer: data-parallel training on the cores of one CPU node, with one shared model."""
from .engine.cluster import Cluster
from .errors import (CheckpointError, ConfigError, DataError, InputError, TrainingDiverged, TrainingInterrupted,
                     UserCodeError, WorkerFailed)
from .trainer import FitResult, Trainer

__all__ = ["CheckpointError", "Cluster", "ConfigError", "DataError", "FitResult", "InputError", "Trainer",
           "TrainingDiverged", "TrainingInterrupted", "UserCodeError", "WorkerFailed"]
__version__ = "0.2.0"
