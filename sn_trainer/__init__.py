"""sn_trainer: data-parallel training on the cores of one CPU node, with one shared model."""
from .config import ConfigError
from .engine.cluster import Cluster
from .engine.launch import WorkerFailed
from .trainer import FitResult, Trainer, TrainingDiverged, TrainingInterrupted

__all__ = ["Cluster", "ConfigError", "FitResult", "Trainer", "TrainingDiverged", "TrainingInterrupted", "WorkerFailed"]
__version__ = "0.1.0"
