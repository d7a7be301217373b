"""What the doctor reads of a folder: one command-line run's (summary.json, metrics.csv) or a
sweep's (one such folder per job), and the knee the sweep's jobs measured."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from ..errors import InputError
from .run import Knee, RunFacts


class NotARun(InputError):
    """The folder holds no run the doctor can read; the message says what was looked for."""


def read_folder(folder: str | Path) -> list[tuple[str, RunFacts]]:
    """Each run under ``folder`` (itself, or a sweep's jobs), named by its folder relative to it.

    Raises:
        NotARun: not a folder, no summary.json in it or below it, or one that is not a summary.
    """
    root = Path(folder)
    if not root.is_dir():
        raise NotARun(f"{root} is not a folder; pass the folder a run printed ('results in ...') or a sweep's")
    own = root / "summary.json"
    try:
        paths = [own] if own.is_file() else sorted(root.rglob("summary.json"))
    except OSError as exc:
        raise NotARun(f"{root} cannot be searched for runs ({exc.strerror}); pass a run's own folder") from None
    if not paths:
        raise NotARun(f"{root} is not a run's folder: no summary.json in it or below it; pass the folder a run "
                      "printed ('results in ...') or a multirun's folder")
    runs = [(path.parent.relative_to(root).as_posix() or ".", _facts(path)) for path in paths]
    _add_sweep_knees([facts for _, facts in runs])
    return runs


def _facts(path: Path) -> RunFacts:
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotARun(f"{path} is not readable JSON ({exc}); rerun that job or remove it") from None
    if not isinstance(summary, dict) or not ({"samples_per_sec", "skipped"} & set(summary)):
        raise NotARun(f"{path} is not a run's summary (no samples_per_sec); pass the folder of a run of "
                      "python -m sn_trainer")
    return RunFacts(summary, cli=True, losses=_losses(path.parent / "metrics.csv"))


def _losses(path: Path) -> list[float]:
    """The training losses metrics.csv logged, in order (none where there is no such file)."""
    try:
        with open(path, newline="") as f:
            return [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss") not in (None, "")]
    except (OSError, KeyError, ValueError):
        return []


def _add_sweep_knees(runs: list[RunFacts]) -> None:
    """In a sweep, each job's knee: the fastest job of the same model and global batch."""
    measured = [r for r in runs if "samples_per_sec" in r.summary and r.get("per_worker_batch") is not None]
    groups: dict[tuple[Any, Any], list[RunFacts]] = {}
    for r in measured:
        groups.setdefault((_model(r), r.get("batch_size")), []).append(r)
    for group in groups.values():
        if len({r.get("per_worker_batch") for r in group}) < 2:
            continue
        best = max(group, key=lambda r: r.get("samples_per_sec") or -math.inf)
        for r in group:
            r.knee = Knee(best.get("per_worker_batch"), best.get("samples_per_sec"), "the sweep's")


def _model(facts: RunFacts) -> Any:
    return facts.get("model") or (facts.config.get("model") or {}).get("name")
