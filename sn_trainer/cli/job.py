"""One command-line job: data, model and optimizer from the config, fit, then the files it writes
(summary.json, metrics.csv, the weights, a text sample)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import psutil
import torch

from ..node.cluster import Cluster
from ..node.cpu import describe_machine
from ..node.topology import oversubscription
from ..errors import ConfigError
from ..report.metrics import ProgressLog
from ..config import TrainerConfig
from ..trainer import Trainer
from .run_config import RunConfig
from .named_datasets import load_datasets
from .named_models import build_for, training_parts, uses_torchvision
from .named_optim import LRSchedule, build_optimizer, build_scheduler, effective_lr

log = logging.getLogger("sn_trainer")


def run_job(cfg: RunConfig, out_dir: str | os.PathLike, resolved: dict[str, Any], sweep_dir: str | None = None,
            run_name: str | None = None) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` says; write summary.json and metrics.csv into ``out_dir``.

    ``sweep_dir``: a multirun's folder (its jobs are one MLflow experiment's runs, kept there);
    ``run_name``: this job's name in MLflow (default: the output folder's name).

    Returns:
        The summary (also written to ``out_dir/summary.json``).
    Raises:
        InputError: anything wrong with the settings, the data or a checkpoint, before training starts.
    """
    out = _writable_dir(out_dir)
    cluster = Cluster.from_env(os.environ)  # torchrun's environment, read here at the edge
    if uses_torchvision(cfg.model.name):
        import torchvision  # noqa: F401 - before the Trainer: its warm workers then have it imported too
    trainer = Trainer(_job_settings(cfg, out), cluster=cluster)  # first: its workers warm up while data loads
    if cfg.bench.enabled and cfg.bench.skip_oversubscribed:
        reason = oversubscription(trainer.topology, trainer.workers, trainer.settings.threads)
        if reason:
            print(f"skipped: {reason}", flush=True)
            summary = {"config": resolved, "machine": describe_machine(), "skipped": reason}
            _write_json_atomically(out / "summary.json", summary)
            return summary
    _log_cluster(cluster)
    data = load_datasets(cfg.dataset)
    log.info("data: %s (%d train, %d test%s)", data.source, len(data.train), len(data.test),
             f", vocabulary {data.vocab_size}" if _is_text(data) else f", shape {list(data.sample_shape)}")
    torch.manual_seed(trainer.settings.seed)
    model = build_for(cfg.model, data)
    step_fn, param_groups = training_parts(cfg.model, cfg.optim.weight_decay)
    total_steps = _announce(cfg, trainer, len(data.train))
    if cfg.tune and not cfg.bench.enabled:
        trainer = _tuned(cfg, trainer, model, data.train, step_fn, param_groups)
    loggers = _loggers(cfg, out, resolved, sweep_dir, run_name, data.block_size if _is_text(data) else None)
    result = _fit(cfg, trainer, model, data, ProgressLog(out, total_steps), loggers, resolved, step_fn, param_groups,
                  total_steps)
    summary = _summary(cfg, resolved, data, result, out, model)
    _write_json_atomically(out / "summary.json", summary)
    if "mlflow" in loggers:
        loggers["mlflow"].close(summary)
    print(_result_line(result, summary, out), flush=True)
    return summary


def _job_settings(cfg: RunConfig, out: Path) -> TrainerConfig:
    """The Trainer's settings for this job: a benchmark job measures bench.steps steps after
    bench.warmup, its speed alone (no step compared with one process's: a check would land in the
    few steps it measures), and has nothing worth resuming; profile=true traces into the output folder."""
    settings = cfg.trainer
    if cfg.bench.enabled:
        settings = dataclasses.replace(settings, max_steps=cfg.bench.warmup + cfg.bench.steps,
                                       measure_after=cfg.bench.warmup, verify_every=0,
                                       checkpoint=dataclasses.replace(settings.checkpoint, dir=None))
    if cfg.profile:
        settings = dataclasses.replace(settings, profile_dir=str(out))
    return settings


def _log_cluster(cluster: Cluster | None) -> None:
    if cluster is not None and cluster.spans_nodes:
        log.info("node %d of %d (rendezvous %s:%d); gloo between nodes binds to %s", cluster.node_rank,
                 cluster.nodes, cluster.master_addr, cluster.master_port,
                 f"interface {cluster.interface}" if cluster.interface else "the address of this host's name "
                 "(set GLOO_SOCKET_IFNAME to choose an interface)")


def _is_text(data) -> bool:
    return hasattr(data, "vocab_size")


def _announce(cfg: RunConfig, trainer: Trainer, num_samples: int) -> int:
    """Say what will train, and how long; the total steps."""
    settings, placement = trainer.settings, trainer.placement
    _, total_steps = trainer.steps(num_samples)
    lr = effective_lr(cfg.optim, settings.batch_size * settings.accumulate)
    log.info("training %s: %d workers x %d threads%s, batch %d (%.1f per worker), %d steps, lr %.4g",
             cfg.model.name, settings.workers, settings.threads,
             f" on each of {placement.nodes} nodes" if placement.nodes > 1 else "", settings.batch_size,
             settings.batch_size / placement.global_workers, total_steps, lr)
    _warn_of_a_short_run(cfg, total_steps, lr)
    return total_steps


def _tuned(cfg: RunConfig, trainer: Trainer, model, train_set, step_fn, param_groups) -> Trainer:
    """tune=true: measure the fastest workers x threads and runtime, print the table, and a
    Trainer with them."""
    step_batch = trainer.settings.batch_size * trainer.settings.accumulate
    tuned = trainer.tune(model, train_set, optimizer=build_optimizer(cfg.optim, step_batch), step_fn=step_fn,
                         param_groups=param_groups)
    print(tuned.table(), flush=True)
    return Trainer(trainer.config, cluster=trainer.cluster, workers=tuned.workers, threads=tuned.threads,
                   allocator=tuned.allocator, openmp=tuned.openmp)


def _fit(cfg: RunConfig, trainer: Trainer, model, data, progress: ProgressLog, loggers: dict[str, Any],
         resolved: dict[str, Any], step_fn, param_groups, total_steps: int):
    """``trainer.fit`` with the progress log and the loggers as callbacks, closed however it ends."""
    step_batch = trainer.settings.batch_size * trainer.settings.accumulate
    try:
        result = trainer.fit(model, data.train, eval_set=None if cfg.bench.enabled else data.test,
                             optimizer=build_optimizer(cfg.optim, step_batch),
                             scheduler=build_scheduler(cfg.optim, total_steps), callbacks=[progress, *loggers.values()],
                             run_config=resolved, step_fn=step_fn, param_groups=param_groups)
    except BaseException:
        if "mlflow" in loggers:
            loggers["mlflow"].close(failed=True)
        raise
    finally:
        progress.close()
    if "tensorboard" in loggers:
        loggers["tensorboard"].close(_hparams(cfg), {"test_loss": result.eval_loss,
                                                     "test_accuracy": result.eval_accuracy,
                                                     "samples_per_sec": result.samples_per_sec})
    return result


def _summary(cfg: RunConfig, resolved: dict[str, Any], data, result, out: Path, model) -> dict[str, Any]:
    """summary.json: the config, the machine, the data, the result's figures (evaluation's as the
    test set's), and what the job wrote (weights, a text sample)."""
    text = _is_text(data)
    summary = {"config": resolved, "machine": describe_machine(), "data_source": data.source, "model": cfg.model.name,
               **result.summary(),
               "test_loss": result.eval_loss, "test_accuracy": result.eval_accuracy,
               "test_perplexity": math.exp(result.eval_loss) if text and result.eval_loss is not None else None,
               "test_ema_loss": result.eval_metrics.get("eval_ema_loss"),  # with ema_decay: of the averaged weights
               "test_ema_accuracy": result.eval_metrics.get("eval_ema_accuracy"),
               "tokens_per_sec": result.samples_per_sec * data.block_size if text else None,
               "process": _process_hygiene()}
    if not cfg.bench.enabled:
        summary["weights"] = _write_weights(result, out)
        if text:
            summary["sample"] = _write_sample(model, data, out, result.settings.seed)
            print(f"sample:\n{summary['sample']}\n", flush=True)
    return summary


def _result_line(result, summary: dict[str, Any], out: Path) -> str:
    if summary["tokens_per_sec"] is not None:
        quality = (f"test loss {result.eval_loss:.4f} (perplexity {summary['test_perplexity']:.2f}), "
                   if result.eval_loss is not None else "")
        speed = f"{summary['tokens_per_sec']:.0f} tokens/s"
    else:
        quality = f"test accuracy {result.eval_accuracy:.4f}, " if result.eval_accuracy is not None else ""
        speed = f"{result.samples_per_sec:.0f} samples/s"
    return (f"{quality}{speed} ({result.workers} workers x {result.threads} threads, batch {result.batch_size}); "
            f"results in {out}")


def _warn_of_a_short_run(cfg: RunConfig, total_steps: int, lr: float) -> None:
    """A warm-up longer than the run never reaches the learning rate asked for: say so."""
    warmup = cfg.optim.warmup_steps
    if warmup > total_steps:
        reached = lr * LRSchedule(cfg.optim.schedule, total_steps, warmup)(total_steps - 1)
        log.warning("optim.warmup_steps=%d is longer than this run's %d steps: the learning rate ends at %.4g, "
                    "never reaching the %.4g asked; lower optim.warmup_steps or train longer", warmup, total_steps,
                    reached, lr)


def _write_weights(result, out: Path) -> list[str]:
    """model.safetensors (and model_ema.safetensors) in the output folder, where safetensors is installed."""
    try:
        return [path.name for path in result.save(out)]
    except ImportError as exc:
        log.info("%s; the trained weights are in the checkpoints (python -m sn_trainer.export converts them)", exc)
        return []


def _write_sample(model, data, out: Path, seed: int, new_tokens: int = 300) -> str:
    """Text the trained model writes, starting from a line break, into sample.txt."""
    model.eval()
    start = torch.tensor([data.encode("\n")[:1] or [0]])
    tokens = model.generate(start, new_tokens, generator=torch.Generator().manual_seed(seed))
    text = data.decode(tokens[0].tolist())
    (out / "sample.txt").write_text(text + "\n")
    return text


def _loggers(cfg: RunConfig, out: Path, resolved: dict[str, Any], sweep_dir: str | None, run_name: str | None,
             tokens_per_sample: int | None) -> dict[str, Any]:
    """The loggers ``cfg.logger`` names, by name, each a callback of the run."""
    names = cfg.logger if isinstance(cfg.logger, list) else [cfg.logger]
    loggers: dict[str, Any] = {}
    if "tensorboard" in names:
        from ..report.tensorboard import TensorBoardLog

        loggers["tensorboard"] = TensorBoardLog(out, tokens_per_sample=tokens_per_sample)
    if "mlflow" in names:
        from ..report.mlflow_log import MLflowLog, default_uri

        try:
            import mlflow  # noqa: F401 - installed, or say how to install it
        except ImportError:
            raise ConfigError("logger=mlflow needs MLflow's client: pip install 'sn_trainer[mlflow]'") from None

        store = Path(sweep_dir) if sweep_dir else out
        loggers["mlflow"] = MLflowLog(default_uri(store), os.environ.get("MLFLOW_EXPERIMENT_NAME", "sn_trainer"),
                                      run_name or out.name, {k: v for k, v in resolved.items() if k != "hydra"},
                                      artifacts=store / "mlartifacts")
    return loggers


def _hparams(cfg: RunConfig) -> dict[str, Any]:
    """What a sweep varies, for TensorBoard's HParams view."""
    t = cfg.trainer
    return {"model": cfg.model.name, "dataset": cfg.dataset.name, "batch_size": t.batch_size, "workers": t.workers,
            "threads": t.threads, "accumulate": t.accumulate, "precision": t.precision, "lr": cfg.optim.lr,
            "optimizer": cfg.optim.name, "seed": t.seed}


def _process_hygiene() -> dict[str, int]:
    """What this process holds after a run: must not grow from one job of a sweep to the next.

    ``child_processes`` leaves out multiprocessing's two helpers, its resource tracker and the
    fork server, which live as long as this process and start no more of themselves.
    """
    me = psutil.Process()
    shm = len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else -1
    children = []
    for child in me.children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if not ("resource_tracker" in command or ("forkserver" in command and child.ppid() == me.pid)):
            children.append(child)
    return {"open_fds": me.num_fds(), "child_processes": len(children), "dev_shm_entries": shm}


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
