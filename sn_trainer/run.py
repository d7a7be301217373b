"""One command-line job: data, model and optimizer from the config, fit, then write the results."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, RunConfig
from .data.datasets import load_datasets
from .models import build_model
from .optim import build_optimizer, build_scheduler, effective_lr
from .report.machine import describe_machine
from .report.metrics import ProgressLog
from .trainer import Trainer

log = logging.getLogger("sn_trainer")


def run(cfg: RunConfig, out_dir: str | os.PathLike, resolved: dict[str, Any]) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` says; write summary.json and metrics.csv into ``out_dir``.

    Returns:
        The summary (also written to ``out_dir/summary.json``).
    Raises:
        ConfigError: anything wrong with the settings or the data, before training starts.
    """
    out = _writable_dir(out_dir)
    data = load_datasets(cfg.dataset)
    log.info("data: %s (%d train, %d test, shape %s)", data.source, len(data.train), len(data.test),
             list(data.sample_shape))
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model.name, data.sample_shape, data.num_classes,
                         **({"hidden": tuple(cfg.model.hidden)} if cfg.model.hidden else {}))
    trainer = Trainer(**vars(cfg.trainer))
    step_batch = cfg.trainer.batch_size * cfg.trainer.accumulate
    steps_per_epoch = len(data.train) // step_batch
    total_steps = cfg.trainer.max_steps or cfg.trainer.epochs * max(1, steps_per_epoch)
    log.info("training %s: %d workers x %d threads, batch %d (%.1f per worker), %d steps, lr %.4g",
             cfg.model.name, trainer.workers, cfg.trainer.threads, cfg.trainer.batch_size,
             cfg.trainer.batch_size / trainer.workers, total_steps, effective_lr(cfg.optim, step_batch))
    progress = ProgressLog(out, total_steps)
    try:
        result = trainer.fit(model, data.train, eval_set=data.test,
                             optimizer=build_optimizer(cfg.optim, step_batch),
                             scheduler=build_scheduler(cfg.optim, total_steps), on_log=progress)
    finally:
        progress.close()
    summary = {
        "config": resolved,
        "machine": describe_machine(),
        "data_source": data.source,
        "samples_per_sec": result.samples_per_sec,
        "per_worker_batch": result.per_worker_batch,
        "workers": result.workers,
        "threads": result.threads,
        "batch_size": result.batch_size,
        "steps": result.steps,
        "train_seconds": result.train_seconds,
        "phase_seconds": result.phase_seconds,
        "final_loss": result.final_loss,
        "test_loss": result.eval_loss,
        "test_accuracy": result.eval_accuracy,
        "peak_memory_bytes": result.peak_memory_bytes,
    }
    _write_json_atomically(out / "summary.json", summary)
    print(f"test accuracy {result.eval_accuracy:.4f}, {result.samples_per_sec:.0f} samples/s "
          f"({result.workers} workers x {result.threads} threads, batch {result.batch_size}); results in {out}",
          flush=True)
    return summary


def _writable_dir(path: str | os.PathLike) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to the output directory {out} ({exc.strerror}); "
                          "choose another with hydra.run.dir=<dir>") from None
    return out


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
