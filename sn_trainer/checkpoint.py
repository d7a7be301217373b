"""Checkpoints: assembled from the workers' parts, written atomically, loaded without running code.

A checkpoint holds the model's state_dict, the whole optimizer state (gathered from the shards
into full-length tensors, so a run may resume with another worker count), the LR scheduler,
the step reached, every worker's RNG state, the resolved config and a format version.
"""
from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ConfigError

FORMAT = "sn_trainer-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{9})\.pt$")


def to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def worker_part(rank: int, shard: tuple[int, int], optimizer, scheduler, model: nn.Module | None) -> bytes:
    """What one worker contributes to a checkpoint, serialised (rank 0 adds the model)."""
    part = {
        "rank": rank,
        "shard": list(shard),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": torch.get_rng_state(),
    }
    if model is not None:
        part["model"] = {k: v.detach().clone(memory_format=torch.contiguous_format)
                         for k, v in model.state_dict().items()}
    return to_bytes(part)


def assemble(parts: list[dict[str, Any]], step: int, numel: int, config: dict[str, Any] | None,
             to_contiguous: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, Any]:
    """One checkpoint from every worker's part: shard states joined into full-length tensors.

    ``to_contiguous`` puts a joined tensor from the flat buffer's order into the parameters'
    contiguous order (engine.shared.FlatOrder), so that the saved state does not depend on
    the layout the run used.
    """
    parts = sorted(parts, key=lambda p: p["rank"])
    per_element: dict[str, list[torch.Tensor]] = {}
    scalars: dict[str, Any] = {}
    param_group = None
    for part in parts:
        state = part["optimizer"]
        if state is None:
            continue  # a worker whose shard is empty holds no optimizer
        param_group = param_group or {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        start, stop = part["shard"]
        for key, value in state["state"].get(0, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == stop - start:
                per_element.setdefault(key, []).append(value)
            else:
                scalars.setdefault(key, value)
    optimizer = {"per_element": {k: to_contiguous(torch.cat(v)) for k, v in per_element.items()}, "scalars": scalars,
                 "param_group": param_group}
    for key, full in optimizer["per_element"].items():
        if full.numel() != numel:
            raise RuntimeError(f"optimizer state {key!r} gathered {full.numel()} values for {numel} parameters")
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": parts[0]["model"],
        "optimizer": optimizer,
        "scheduler": parts[0]["scheduler"],
        "rng": [p["rng"] for p in parts],
        "config": config or {},
    }


def shard_optimizer_state(checkpoint: dict[str, Any], start: int, stop: int,
                          to_flat: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, Any]:
    """The optimizer state_dict of one shard, cut from a checkpoint's full-length state.

    ``to_flat`` puts the saved (contiguous) order into the flat buffer's order first.
    """
    opt = checkpoint["optimizer"]
    state = {key: to_flat(value)[start:stop].clone() for key, value in opt["per_element"].items()}
    state.update({key: (value.clone() if isinstance(value, torch.Tensor) else value)
                  for key, value in opt["scalars"].items()})
    return {"state": {0: state} if state else {}, "param_groups": [{**opt["param_group"], "params": [0]}]}


def is_finite(checkpoint: dict[str, Any]) -> bool:
    return all(torch.isfinite(t).all() for t in checkpoint["model"].values() if t.is_floating_point())


class CheckpointDir:
    """A directory of ``step-NNNNNNNNN.pt`` files, written atomically, the last ``keep`` kept."""

    def __init__(self, path: str | os.PathLike, keep: int = 3):
        self.path = Path(path)
        self.keep = keep

    def check_writable(self) -> None:
        """Fail before training rather than at the first checkpoint.

        Raises:
            ConfigError: the directory cannot be created or written.
        """
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"cannot write checkpoints to {self.path} ({exc.strerror}); choose another "
                              "checkpoint directory (checkpoint.dir)") from None

    def save(self, checkpoint: dict[str, Any]) -> Path:
        """Write atomically: a private temporary file, fsync, rename, fsync of the directory.

        Raises:
            RuntimeError: the parameters are not finite (never saved).
        """
        if not is_finite(checkpoint):
            raise RuntimeError(f"refusing to checkpoint non-finite parameters at step {checkpoint['step']}")
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = self.path / f"step-{checkpoint['step']:09d}.pt"
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._prune()
        return final

    def steps(self) -> list[tuple[int, Path]]:
        if not self.path.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1][1] if steps else None

    def _prune(self) -> None:
        for _, path in self.steps()[: -self.keep]:
            path.unlink(missing_ok=True)
        for stale in self.path.glob(".step-*.pt.tmp-*"):  # left by a writer that was killed
            try:
                if int(stale.name.rsplit("-", 1)[1]) != os.getpid():
                    stale.unlink(missing_ok=True)
            except ValueError:
                continue


def resolve(resume: str, default_dir: str | os.PathLike | None) -> Path:
    """``resume`` as a file: "latest" (in the checkpoint directory), a directory, or a file.

    Raises:
        ConfigError: nothing to resume from there.
    """
    if resume == "latest":
        if default_dir is None:
            raise ConfigError("resume=latest needs a checkpoint directory (checkpoint.dir / checkpoint_dir)")
        target = Path(default_dir)
    else:
        target = Path(resume).expanduser()
    if target.is_dir():
        latest = CheckpointDir(target).latest()
        if latest is None:
            raise ConfigError(f"no checkpoint (step-*.pt) in {target} to resume from")
        return latest
    if not target.is_file():
        raise ConfigError(f"resume={resume}: {target} does not exist; pass a checkpoint file, a checkpoint "
                          "directory, or latest")
    return target


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint without executing code from it (tensors and plain data only).

    Raises:
        ConfigError: unreadable, truncated, not a checkpoint, a newer format, or one that would
            need arbitrary objects unpickled.
    """
    path = Path(path)
    try:
        checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        # torch's safe unpickler reports both a forbidden global (code) and bytes that are no
        # pickle at all as UnpicklingError; only the first is an attack, the second is damage.
        found = re.search(r"(?:unsupported GLOBAL|Unsupported global:?) +([\w.]+)", str(exc))
        if found:
            raise ConfigError(f"refusing {path}: loading it would run code or build arbitrary objects "
                              f"(it asks for {found.group(1)}); sn_trainer loads tensors and plain data only") from None
        raise ConfigError(f"{path} is corrupt or truncated (not a torch checkpoint); "
                          "resume from an earlier checkpoint") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        detail = str(exc).splitlines()[0].split(". ")[0][:120]  # torch's first sentence says what broke
        raise ConfigError(f"{path} is corrupt or truncated ({detail}); resume from an earlier checkpoint") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an sn_trainer checkpoint")
    if checkpoint.get("version", 0) > VERSION:
        raise ConfigError(f"{path} has format version {checkpoint['version']}, newer than this sn_trainer "
                          f"reads ({VERSION}); upgrade sn_trainer")
    return checkpoint


def check_model(checkpoint: dict[str, Any], model: nn.Module, path: str | os.PathLike) -> None:
    """Refuse a checkpoint saved from a model of another shape.

    Raises:
        ConfigError: names the first parameter or buffer that differs.
    """
    mine = model.state_dict()
    theirs = checkpoint["model"]
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs or name not in mine:
            where = "checkpoint" if name not in theirs else "model"
            raise ConfigError(f"{path} was saved from another model: {name!r} is missing from the {where}")
        if tuple(mine[name].shape) != tuple(theirs[name].shape):
            raise ConfigError(f"{path} was saved from another model: {name!r} has shape "
                              f"{tuple(theirs[name].shape)} there, {tuple(mine[name].shape)} here")


class Collector:
    """In the launcher: gathers the workers' parts of each checkpoint and writes it when complete."""

    def __init__(self, world_size: int, numel: int, directory: CheckpointDir, config: dict[str, Any] | None,
                 to_contiguous: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self.world_size, self.numel, self.directory, self.config = world_size, numel, directory, config
        self.to_contiguous = to_contiguous
        self._parts: dict[int, list[dict[str, Any]]] = {}
        self.last_saved: Path | None = None

    def add(self, step: int, data: bytes) -> Path | None:
        parts = self._parts.setdefault(step, [])
        parts.append(from_bytes(data))
        if len(parts) < self.world_size:
            return None
        del self._parts[step]
        self.last_saved = self.directory.save(assemble(parts, step, self.numel, self.config, self.to_contiguous))
        return self.last_saved
