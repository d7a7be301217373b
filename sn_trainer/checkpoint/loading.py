"""Checkpoints read back: which one a resume names, loaded without running code, and checked
against this run's model and optimizer."""
from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from .contents import FORMAT, VERSION
from .directory import CheckpointDir


def resolve(resume: str, default_dir: str | os.PathLike | None) -> Path:
    """What ``resume`` names: "latest" (the checkpoint directory), a directory, or a file.

    Raises:
        CheckpointError: nothing to resume from there.
    """
    if resume == "latest":
        if default_dir is None:
            raise ConfigError("resume=latest needs a checkpoint directory (checkpoint.dir / checkpoint_dir)")
        target = Path(default_dir)
    else:
        target = Path(resume).expanduser()
    if target.is_dir():
        if CheckpointDir(target).latest() is None:
            raise CheckpointError(f"no checkpoint (step-*.pt) in {target} to resume from")
        return target
    if not target.is_file():
        raise CheckpointError(f"resume={resume}: {target} does not exist; pass a checkpoint file, a checkpoint "
                              "directory, or latest")
    return target


def load_resumable(target: Path) -> tuple[Path, dict[str, Any], list[str]]:
    """The checkpoint to resume from: ``target`` itself, or a directory's newest one that loads.

    A damaged newest checkpoint in a directory (a torn disk, a truncated copy) is passed over
    for the one before it; what was passed over is returned, for the caller to say.

    Raises:
        CheckpointError: the file, or every checkpoint of the directory, cannot be used.
    """
    if not target.is_dir():
        return target, load(target), []
    passed = []
    for _, path in reversed(CheckpointDir(target).steps()):
        try:
            return path, load(path), passed
        except CheckpointError as exc:
            passed.append(str(exc))
    raise CheckpointError(f"no checkpoint in {target} can be resumed from: " + "; ".join(passed))


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint without executing code from it (tensors and plain data only).

    Raises:
        CheckpointError: unreadable, truncated, not a checkpoint, a newer format, or one that
            would need arbitrary objects unpickled.
    """
    path = Path(path)
    try:
        checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        # torch's safe unpickler reports both a forbidden global (code) and bytes that are no
        # pickle at all as UnpicklingError; only the first is an attack, the second is damage.
        found = re.search(r"(?:unsupported GLOBAL|Unsupported global:?) +([\w.]+)", str(exc))
        if found:
            raise CheckpointError(f"refusing {path}: loading it would run code or build arbitrary objects "
                                  f"(it asks for {found.group(1)}); sn_trainer loads tensors and plain data only") \
                from None
        raise CheckpointError(f"{path} is corrupt or truncated (not a torch checkpoint); "
                              "resume from an earlier checkpoint") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        detail = str(exc).splitlines()[0].split(". ")[0][:120]  # torch's first sentence says what broke
        raise CheckpointError(f"{path} is corrupt or truncated ({detail}); resume from an earlier checkpoint") \
            from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an sn_trainer checkpoint")
    if checkpoint.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {checkpoint['version']}, newer than this sn_trainer "
                              f"reads ({VERSION}); upgrade sn_trainer")
    return checkpoint


def check_model(checkpoint: dict[str, Any], model: nn.Module, path: str | os.PathLike) -> None:
    """Refuse a checkpoint saved from a model of another shape.

    Raises:
        CheckpointError: names the first parameter or buffer that differs.
    """
    mine = model.state_dict()
    theirs = checkpoint["model"]
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs or name not in mine:
            where = "checkpoint" if name not in theirs else "model"
            raise CheckpointError(f"{path} was saved from another model: {name!r} is missing from the {where}")
        if tuple(mine[name].shape) != tuple(theirs[name].shape):
            raise CheckpointError(f"{path} was saved from another model: {name!r} has shape "
                                  f"{tuple(theirs[name].shape)} there, {tuple(mine[name].shape)} here")


def check_optimizer(held: dict[str, Any] | None, keys: tuple[str, ...], optimizer_name: str,
                    path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose optimizer kept other state than this run's optimizer keeps.

    ``held`` is one phase's saved optimizer state; ``keys`` are what this run's optimizer holds
    per parameter after a step (the preflight's). An optimizer that keeps nothing (SGD without
    momentum) resumes from any: it reads no state.

    Raises:
        CheckpointError: both keep state, under other keys (it was written with another optimizer).
    """
    theirs = sorted({str(k) for state in ((held or {}).get("state") or {}).values() for k in state})
    if theirs and keys and theirs != sorted(keys):
        raise CheckpointError(f"{path} holds optimizer state {{{', '.join(theirs)}}}, and this run's "
                              f"{optimizer_name} keeps {{{', '.join(sorted(keys))}}}: it was written with another "
                              "optimizer; resume with that one, or start afresh without resume")

