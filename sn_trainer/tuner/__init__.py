"""Choosing workers x threads (and the runtime, and compile) for a model, batch and machine, as the
paper advises: a cost model calibrated on the spot predicts every candidate (``model``), the best
few are verified by short real runs (``search``), and the answer is cached for ``workers=auto``
(``cache``). ``python -m sn_trainer.tuner --predict ...`` shows what the model predicts for
another machine.
"""
from __future__ import annotations

from .cache import cache_key, cache_path, calibration_of, load, store, versions
from .model import Calibration, Machine, bytes_per_sample, candidates, compute_seconds, fit_line, predict, \
    prediction_table, sync_seconds
from .search import TuneResult, search, tune, winner

__all__ = ["Calibration", "Machine", "TuneResult", "bytes_per_sample", "cache_key", "cache_path", "calibration_of",
           "candidates", "compute_seconds", "fit_line", "load", "predict", "prediction_table", "search", "store",
           "sync_seconds", "tune", "versions", "winner"]
