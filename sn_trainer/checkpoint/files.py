"""Checkpoint files: what they hold, written atomically, loaded without running code.

A checkpoint holds the model's state_dict, the optimizer's state per parameter name (as one
process's optimizer would hold it, so a run may resume with another worker count), the step
reached, every worker's random state, the sample order a resume must agree with (batch size,
accumulate, seed, shuffle, drop_last, training-set size), the resolved config and a format version.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pickle
import re
import uuid
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from ..errors import CheckpointError, ConfigError

FORMAT = "sn_trainer-checkpoint"
# 3: each worker's random state is torch's, numpy's and Python's streams; 2: torch's alone,
# optimizer state per parameter name, with groups; 1: one flat optimizer state, one group
VERSION = 3
_NAME = re.compile(r"^step-(\d{9})\.pt$")


def build(step: int, model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, rng: list[Any],
          run: dict[str, Any], config: dict[str, Any] | None, schedule: dict[str, Any] | None = None,
          ema: dict[str, torch.Tensor] | None = None, aliases: dict[str, str] | None = None,
          callbacks: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The checkpoint's contents (``optimizer`` as ``engine.optimizer_state.gather`` gives it; ``schedule``: a
    metric-driven scheduler's state, which a resume cannot replay; ``ema``: the parameters'
    moving average by name; ``aliases``: the model's tied names, alias -> first name;
    ``callbacks``: the stateful callbacks' states at this step, by ``Callbacks.states``' keys)."""
    return {"format": FORMAT, "version": VERSION, "step": step, "model": model, "optimizer": optimizer, "rng": rng,
            "run": run, "config": config or {}, "schedule": schedule, "ema": ema, "aliases": aliases or {},
            "callbacks": callbacks or {}}


def is_finite(checkpoint: dict[str, Any]) -> bool:
    return all(torch.isfinite(t).all() for t in checkpoint["model"].values() if t.is_floating_point())


class CheckpointDir:
    """A directory of ``step-NNNNNNNNN.pt`` files, written atomically, the last ``keep`` kept.

    One run writes it at a time (``claimed``: a lock file naming the run's process); the files a
    dead writer left half-written are removed, a live writer's never.
    """

    LOCK = ".lock"

    def __init__(self, path: str | os.PathLike, keep: int = 3):
        self.path = Path(path)
        self.keep = keep

    @contextmanager
    def claimed(self):
        """This process writes the directory while the block runs; no other run may.

        The lock is ``.lock`` naming this process, flock()ed for as long as the block runs: the
        flock alone says whether a run owns the folder (the kernel lets go of a killed run's
        flock, whatever PID namespace or machine it ran in, and whatever process has its pid
        now). It is written whole and locked before it takes its name (a hard link, which fails
        where the name exists), so a second run never reads a lock half-made; one nobody
        flock()s is replaced while flock()ed by the run replacing it, so two runs finding it at
        once cannot both take it over. On a file system without hard links the lock is created
        under its name and taken over in place, flock()ed all the while. On one without flock()
        the lock's process decides, where this machine can tell (same boot, same PID namespace,
        same start time); elsewhere the run is refused with what to do.

        Raises:
            CheckpointError: another live process is writing checkpoints here, or may be.
        """
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = self.path / self.LOCK
        fd = self._take(lock)
        try:
            yield self
        finally:
            with contextlib.suppress(OSError):
                if _same_file(fd, lock):  # unlinked while still held: a run waiting on it tries afresh
                    lock.unlink()
            _release(fd)

    def _take(self, lock: Path) -> int:
        """The lock, taken: its open, flock()ed descriptor."""
        for stale in _left_by_dead(self.path, ".lock.*.tmp-*"):  # a claim killed half-way left it
            stale.unlink(missing_ok=True)
        mine = lock.with_name(f"{lock.name}.{uuid.uuid4().hex}.tmp-{os.getpid()}")
        fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        _HELD.add(fd)
        try:
            os.write(fd, _identity().encode())
            _flock(fd)  # a fresh file: no one else can hold it
            while True:
                try:
                    os.link(mine, lock)
                    return fd
                except FileExistsError:
                    if self._take_over(lock, mine):
                        return fd
        except OSError as exc:
            _release(fd)
            if exc.errno in _NO_HARD_LINKS:
                return self._take_in_place(lock)
            raise
        except BaseException:
            _release(fd)
            raise
        finally:
            mine.unlink(missing_ok=True)

    def _take_over(self, lock: Path, mine: Path) -> bool:
        """Put ``mine`` in place of the lock found, where no run owns it; False: the lock went
        or changed meanwhile (try again).

        Raises:
            CheckpointError: a live run owns it, or may.
        """
        try:
            found = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            locked = _flock(found)
            if not _same_file(found, lock):
                return False
            self._refuse_if_owned(found, locked)
            os.replace(mine, lock)  # while this process holds the one it replaces: no other can do the same
            return True
        finally:
            os.close(found)

    def _take_in_place(self, lock: Path) -> int:
        """The lock where the file system makes no hard links: created under its name (O_EXCL) and
        flock()ed, or, found unowned, flock()ed and rewritten in place. A run that created it and
        finds it flock()ed by another before its own flock lost the race, and is refused."""
        while True:
            try:
                fd, created = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), True
            except FileExistsError:
                try:
                    fd, created = os.open(lock, os.O_RDWR | os.O_CLOEXEC), False
                except FileNotFoundError:
                    continue
            _HELD.add(fd)
            try:
                locked = _flock(fd)
                if not _same_file(fd, lock):
                    _release(fd)
                    continue
                if not created or locked is False:
                    self._refuse_if_owned(fd, locked)
                os.ftruncate(fd, 0)
                os.pwrite(fd, _identity().encode(), 0)
                return fd
            except BaseException:
                _release(fd)
                raise

    def _refuse_if_owned(self, fd: int, locked: bool | None) -> None:
        """Raise where the lock open at ``fd`` is owned: flock()ed by another (``locked`` False), or,
        where the file system has no flock() (``locked`` None), named by a process that runs or may."""
        owner = _owner_in(fd)
        holder = owner.get("pid")
        refused = CheckpointError(f"{self.path} is being written by another run (process {holder}); give this run "
                                  "a checkpoint directory of its own")
        if locked is False:
            raise refused
        if locked:
            return  # flock()ed now by this process: nobody owned it
        if holder is None:
            if owner:  # written, unreadable, on a file system with nothing else to go by
                raise CheckpointError(f"{self.path / self.LOCK} names no process and this file system has no "
                                      "flock(); if no run is writing this folder, delete that file")
            raise CheckpointError(f"{self.path / self.LOCK} is being made by another run (this file system has no "
                                  "flock()); if no run is writing this folder, delete that file")
        mine = _identity_fields()
        if holder == os.getpid() and owner.get("start") == mine["start"]:
            return
        here = owner.get("boot") == mine["boot"] and owner.get("pidns") == mine["pidns"]
        if not here and "boot" in owner:
            raise CheckpointError(f"{self.path} may be written by a run on another machine or container (process "
                                  f"{holder} there; this file system has no flock() to tell); if none is, delete "
                                  f"{self.path / self.LOCK}")
        if _runs(holder, owner.get("start")):
            raise refused

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
            OSError: the write failed (a full disk); the previous checkpoints are untouched.
        """
        if not is_finite(checkpoint):
            raise RuntimeError(f"refusing to checkpoint non-finite parameters at step {checkpoint['step']}")
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = self.path / f"step-{checkpoint['step']:09d}.pt"
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
                # torch.save's zip writer, closing after a failed write (a full disk), raises its own
                # RuntimeError ("unexpected pos ...") over the OSError that says what happened.
                raise exc.__context__ from None
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
        for stale in _left_by_dead(self.path, ".step-*.pt.tmp-*"):  # a live writer's file is its own
            stale.unlink(missing_ok=True)


# What link() says on a file system that makes no hard links (vfat, exFAT, some FUSE and SMB mounts).
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def _identity_fields() -> dict[str, Any]:
    """This process as a lock names it: its pid, and what tells it from another with that pid (this
    boot, this PID namespace, its start time)."""
    fields: dict[str, Any] = {"pid": os.getpid(), "start": repr(psutil.Process().create_time())}
    with contextlib.suppress(OSError):
        fields["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields["pidns"] = str(os.stat("/proc/self/ns/pid").st_ino)
    return fields


def _identity() -> str:
    """The lock's text: the pid on its first line, the rest as key=value."""
    fields = _identity_fields()
    return f"{fields.pop('pid')}\n" + " ".join(f"{key}={value}" for key, value in fields.items()) + "\n"


def _owner_in(fd: int) -> dict[str, Any]:
    """What a lock file says of its process ({} where it is empty; no "pid" where it names none)."""
    try:
        text = os.pread(fd, 512, 0).decode()
    except (OSError, UnicodeDecodeError):
        return {"unreadable": True}
    if not text.strip():
        return {}
    first, _, rest = text.partition("\n")
    owner: dict[str, Any] = dict(field.split("=", 1) for field in rest.split() if "=" in field)
    try:
        owner["pid"] = int(first.strip())
    except ValueError:
        owner["unreadable"] = True
    return owner


def _runs(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` of this machine runs, and is the one that started at ``start`` (where said)."""
    try:
        return start is None or repr(psutil.Process(pid).create_time()) == start
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # it runs; whether it is that one, this process cannot read
        return True


def _flock(fd: int) -> bool | None:
    """Lock ``fd``'s file for this open description: True; False where another holds it; None on a file
    system without flock(), which locks nothing."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _release(fd: int) -> None:
    _HELD.discard(fd)
    os.close(fd)


def _forget_in_child() -> None:
    """A forked child holds no lock: its copies of the descriptors are closed (the parent's stay
    locked), so that a child outliving a killed run does not keep the run's folder."""
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


# The lock descriptors this process holds, closed in a forked child (flock is shared across fork).
_HELD: set[int] = set()
os.register_at_fork(after_in_child=_forget_in_child)


def _left_by_dead(folder: Path, pattern: str):
    """The files matching ``pattern`` whose name ends in ``-<pid>`` of a process that is gone."""
    for path in folder.glob(pattern):
        try:
            writer = int(path.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if writer != os.getpid() and not psutil.pid_exists(writer):
            yield path


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


def phase_entries(optimizers: list[dict[str, Any] | None],
                  schedules: list[dict[str, Any] | None]) -> tuple[Any, Any]:
    """How a checkpoint holds each phase's optimizer and scheduler state: as they are for one phase
    (the format of version 2), as lists for several."""
    if len(optimizers) == 1:
        return optimizers[0], schedules[0]
    return optimizers, schedules


def phase_states(checkpoint: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]], phases: int,
                 path: str | os.PathLike) -> tuple[list[dict[str, Any] | None], list[dict[str, Any] | None]]:
    """Each phase's optimizer state (per parameter name) and scheduler state.

    Raises:
        CheckpointError: it was written with another number of phases.
    """
    held, schedule = optimizer_state(checkpoint, shapes), checkpoint.get("schedule")
    optimizers = held if isinstance(held, list) else [held]
    schedules = schedule if isinstance(schedule, list) else [schedule] * len(optimizers)
    if len(optimizers) != phases:
        raise CheckpointError(f"{path} was written by a run of {len(optimizers)} optimizers (phases), this run has "
                              f"{phases}; resume with the same phases, or start afresh without resume")
    return optimizers, schedules


def optimizer_state(checkpoint: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any] | None:
    """The optimizer state per parameter name (``engine.memory.state`` form), from either format version.

    ``shapes`` are the trainable parameters' names and shapes in model order: a version-1
    checkpoint kept one flat, full-length state in that order.
    """
    saved = checkpoint.get("optimizer")
    if checkpoint.get("version", 1) >= 2 or saved is None:
        return saved
    state, per_element, offset = {}, {}, 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        held = {key: value[offset : offset + n].reshape(shape).clone() for key, value in saved["per_element"].items()}
        held.update({key: (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in saved["scalars"].items()})
        state[name], per_element[name] = held, list(saved["per_element"])
        offset += n
    return {"param_groups": [{**saved["param_group"], "params": [name for name, _ in shapes]}], "state": state,
            "per_element": per_element}
