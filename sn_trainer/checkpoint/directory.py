"""The checkpoint folder: step files written atomically, the last few kept, written by one run at a time."""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .contents import is_finite
from .lock import FolderLock, left_by_dead

_NAME = re.compile(r"^step-(\d{9})\.pt$")


class CheckpointDir:
    """A directory of ``step-NNNNNNNNN.pt`` files, written atomically, the last ``keep`` kept.

    One run writes it at a time (``claimed``: a lock file naming the run's process); the files a
    dead writer left half-written are removed, a live writer's never.
    """

    LOCK = FolderLock.NAME

    def __init__(self, path: str | os.PathLike, keep: int = 3):
        self.path = Path(path)
        self.keep = keep

    @contextmanager
    def claimed(self):
        """This process writes the directory while the block runs; no other run may (how the
        folder's lock tells: ``FolderLock``).

        Raises:
            CheckpointError: another live process is writing checkpoints here, or may be.
        """
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with FolderLock(self.path).held():
            yield self

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
        for stale in left_by_dead(self.path, ".step-*.pt.tmp-*"):  # a live writer's file is its own
            stale.unlink(missing_ok=True)

