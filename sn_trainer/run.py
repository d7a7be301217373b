"""One command-line job: data, model and optimizer from the config, fit, then write the results."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import psutil
import torch

from . import checkpoint
from .config import ConfigError, RunConfig
from .data.datasets import load_datasets
from .engine.cluster import Cluster
from .engine.topology import read_topology
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
    machine = describe_machine()
    trainer_settings = dict(vars(cfg.trainer))
    if cfg.bench.enabled:
        reason = _oversubscribed(cfg, read_topology().physical_cores)
        if reason and cfg.bench.skip_oversubscribed:
            print(f"skipped: {reason}", flush=True)
            summary = {"config": resolved, "machine": machine, "skipped": reason}
            _write_json_atomically(out / "summary.json", summary)
            return summary
        trainer_settings.update(max_steps=cfg.bench.warmup + cfg.bench.steps, measure_after=cfg.bench.warmup,
                                checkpoint_dir=None)  # a benchmark job has nothing worth resuming
    if cfg.profile:
        trainer_settings["profile_dir"] = str(out)
    if cfg.trainer.resume:
        _check_resume_config(cfg, resolved)
    data = load_datasets(cfg.dataset)
    log.info("data: %s (%d train, %d test, shape %s)", data.source, len(data.train), len(data.test),
             list(data.sample_shape))
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model.name, data.sample_shape, data.num_classes,
                         **({"hidden": tuple(cfg.model.hidden)} if cfg.model.hidden else {}))
    cluster = Cluster.from_env(os.environ)  # torchrun's environment, read here at the edge
    if cluster is not None:
        log.info("node %d of %d (rendezvous %s:%d); gloo between nodes binds to %s", cluster.node_rank,
                 cluster.nodes, cluster.master_addr, cluster.master_port,
                 f"interface {cluster.interface}" if cluster.interface else "the address of this host's name "
                 "(set GLOO_SOCKET_IFNAME to choose an interface)")
    trainer = Trainer(cluster=cluster, **trainer_settings)
    step_batch = cfg.trainer.batch_size * cfg.trainer.accumulate
    _, total_steps = trainer.steps(len(data.train))
    log.info("training %s: %d workers x %d threads, batch %d (%.1f per worker), %d steps, lr %.4g",
             cfg.model.name, trainer.workers, cfg.trainer.threads, cfg.trainer.batch_size,
             cfg.trainer.batch_size / trainer.workers, total_steps, effective_lr(cfg.optim, step_batch))
    progress = ProgressLog(out, total_steps)
    try:
        result = trainer.fit(model, data.train, eval_set=None if cfg.bench.enabled else data.test,
                             optimizer=build_optimizer(cfg.optim, step_batch),
                             scheduler=build_scheduler(cfg.optim, total_steps), on_log=progress,
                             run_config=resolved)
    finally:
        progress.close()
    summary = {
        "config": resolved,
        "machine": machine,
        "data_source": data.source,
        "model": cfg.model.name,
        "samples_per_sec": result.samples_per_sec,
        "per_worker_batch": result.per_worker_batch,
        "workers": result.workers,
        "threads": result.threads,
        "batch_size": result.batch_size,
        "channels_last": result.channels_last,
        "steps": result.steps,
        "measured_steps": result.measured_steps,
        "train_seconds": result.train_seconds,
        "phase_seconds": result.phase_seconds,
        "cpu_percent_per_core": result.cpu_percent_per_core,
        "final_loss": result.final_loss,
        "test_loss": result.eval_loss,
        "test_accuracy": result.eval_accuracy,
        "peak_memory_bytes": result.peak_memory_bytes,
        "skipped_steps": result.skipped_steps,
        "restarts": result.restarts,
        "last_checkpoint": result.last_checkpoint,
        "process": _process_hygiene(),
    }
    _write_json_atomically(out / "summary.json", summary)
    accuracy = f"test accuracy {result.eval_accuracy:.4f}, " if result.eval_accuracy is not None else ""
    print(f"{accuracy}{result.samples_per_sec:.0f} samples/s ({result.workers} workers x {result.threads} "
          f"threads, batch {result.batch_size}); results in {out}", flush=True)
    return summary


def _check_resume_config(cfg: RunConfig, resolved: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint written for another model or dataset."""
    path = checkpoint.resolve(cfg.trainer.resume, cfg.trainer.checkpoint_dir)
    saved = checkpoint.load(path).get("config") or {}
    for section in ("model", "dataset"):
        theirs = (saved.get(section) or {}).get("name")
        mine = resolved[section]["name"]
        if theirs is not None and theirs != mine:
            raise ConfigError(f"{path} was written for {section}={theirs}, this run has {section}={mine}; "
                              f"resume with {section}={theirs} or start afresh without resume")


def _process_hygiene() -> dict[str, int]:
    """What this process holds after a run: must not grow from one job of a sweep to the next."""
    me = psutil.Process()
    shm = len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else -1
    return {"open_fds": me.num_fds(), "child_processes": len(me.children(recursive=True)), "dev_shm_entries": shm}


def _oversubscribed(cfg: RunConfig, physical_cores: int) -> str | None:
    workers = cfg.trainer.workers
    if workers == "auto" or workers * cfg.trainer.threads <= physical_cores:
        return None
    return (f"workers x threads = {workers} x {cfg.trainer.threads} exceeds the {physical_cores} "
            "physical cores this process may use")


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
