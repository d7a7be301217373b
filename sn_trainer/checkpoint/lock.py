"""The checkpoint folder's lock: one run writes a folder at a time, and a killed run's lock is taken over.

The lock names its process (pid, boot, PID namespace, start time) and is flock()ed for as long as
the run writes; where the file system has no hard links or no flock(), it does what it can there.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from ..errors import CheckpointError


class FolderLock:
    """A checkpoint folder's lock, ``.lock``, naming the process of the run that writes the folder.

    It is flock()ed for as long as the run holds it: the flock alone says whether a run owns the
    folder (the kernel lets go of a killed run's flock, whatever PID namespace or machine it ran
    in, and whatever process has its pid now). It is written whole and locked before it takes its
    name (a hard link, which fails where the name exists), so a second run never reads a lock
    half-made; one nobody flock()s is replaced while flock()ed by the run replacing it, so two runs
    finding it at once cannot both take it over. On a file system without hard links the lock is
    created under its name and taken over in place, flock()ed all the while. On one without
    flock() the lock's process decides, where this machine can tell (same boot, same PID
    namespace, same start time); elsewhere the run is refused with what to do.
    """

    NAME = ".lock"

    def __init__(self, folder: Path):
        self.folder = folder

    @contextmanager
    def held(self):
        """This process holds the folder's lock while the block runs; it is let go of after.

        Raises:
            CheckpointError: another live process is writing checkpoints here, or may be.
        """
        lock = self.folder / self.NAME
        fd = self._take(lock)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                if _same_file(fd, lock):  # unlinked while still held: a run waiting on it tries afresh
                    lock.unlink()
            _release(fd)

    def _take(self, lock: Path) -> int:
        """The lock, taken: its open, flock()ed descriptor."""
        for stale in left_by_dead(self.folder, ".lock.*.tmp-*"):  # a claim killed half-way left it
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
        refused = CheckpointError(f"{self.folder} is being written by another run (process {holder}); give this run "
                                  "a checkpoint directory of its own")
        if locked is False:
            raise refused
        if locked:
            return  # flock()ed now by this process: nobody owned it
        if holder is None:
            if owner:  # written, unreadable, on a file system with nothing else to go by
                raise CheckpointError(f"{self.folder / self.NAME} names no process and this file system has no "
                                      "flock(); if no run is writing this folder, delete that file")
            raise CheckpointError(f"{self.folder / self.NAME} is being made by another run (this file system has no "
                                  "flock()); if no run is writing this folder, delete that file")
        mine = _identity_fields()
        if holder == os.getpid() and owner.get("start") == mine["start"]:
            return
        here = owner.get("boot") == mine["boot"] and owner.get("pidns") == mine["pidns"]
        if not here and "boot" in owner:
            raise CheckpointError(f"{self.folder} may be written by a run on another machine or container (process "
                                  f"{holder} there; this file system has no flock() to tell); if none is, delete "
                                  f"{self.folder / self.NAME}")
        if _runs(holder, owner.get("start")):
            raise refused


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


def left_by_dead(folder: Path, pattern: str):
    """The files matching ``pattern`` whose name ends in ``-<pid>`` of a process that is gone."""
    for path in folder.glob(pattern):
        try:
            writer = int(path.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if writer != os.getpid() and not psutil.pid_exists(writer):
            yield path

