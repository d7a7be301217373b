"""The tuner's cache: the choice measured for a machine, model, batch and precision, kept in
``~/.cache/sn_trainer/tune.json`` for ``workers=auto`` (and ``allocator=auto``, ``openmp=auto``,
``compile=auto``)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..node.cpu import describe_machine
from .model import Calibration

log = logging.getLogger(__name__)

# 2: the OpenMP runtime is tuned too (entries of format 1 measured only the allocators).
CACHE_FORMAT = 2


def cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "sn_trainer" / "tune.json"


def machine_key() -> dict[str, Any]:
    m = describe_machine()
    return {"cpu_model": m["cpu_model"], "physical_cores": m["physical_cores"],
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def model_key(model) -> str:
    """A model's fingerprint: its class and the names and shapes of its parameters and buffers."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
    return digest.hexdigest()[:16]


def cache_key(model, batch_size: int, accumulate: int, precision: str) -> str:
    parts = {"machine": machine_key(), "model": model_key(model), "batch": batch_size, "accumulate": accumulate,
             "precision": precision}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def versions() -> dict[str, str]:
    import torch

    from .. import __version__

    return {"format": CACHE_FORMAT, "torch": torch.__version__, "sn_trainer": __version__}


def load(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The cached choice for ``key``; None when there is none, or it is stale (another torch or
    sn_trainer, or another cache format): speeds measured with other software do not carry over."""
    path = path or cache_path()
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    if entry.get("versions") != versions():
        log.info("the tuned setting cached for this model was measured with %s, not %s: ignored",
                 entry.get("versions"), versions())
        return None
    return entry


def store(key: str, result, path: Path | None = None) -> Path:
    """Keep ``result`` (a ``TuneResult``) as the choice for ``key``, replacing the file atomically."""
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache[key] = {"workers": result.workers, "threads": result.threads, "allocator": result.allocator,
                  "openmp": result.openmp, "compile_rates": result.compile_rates,
                  "samples_per_sec": result.samples_per_sec, "calibration": asdict(result.calibration),
                  "rows": result.rows, "measured_at": time.strftime("%Y-%m-%d %H:%M"), "versions": versions()}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)
    return path


def calibration_of(entry: dict[str, Any]) -> Calibration:
    raw = entry["calibration"]
    return Calibration({int(k): tuple(v) for k, v in raw["compute"].items()}, raw["sync_two"],
                       raw["sync_per_doubling"], raw.get("bytes_per_sample", 0.0))
