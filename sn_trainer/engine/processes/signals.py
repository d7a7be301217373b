"""Stopping a run on request: SIGINT or SIGTERM to any of its processes ends it at a step boundary.

The request lives in shared memory (``StopFlags``): the launcher and every worker set it when a
signal reaches them, so ``kill -TERM <launcher>``, ``kill -TERM <worker>`` and ``kill -TERM
-<group>`` (what schedulers do) all end the same way. Worker 0 reads it after each step and
names the step every worker stops after; a second signal to the launcher stops at once. The
launcher's callbacks ask through the same flags: to stop (``ask``), and for a checkpoint of the
step just evaluated (``save_at``); worker 0 waits after each evaluation (and each awaited progress
record) until the launcher has heard of it (``acknowledge``), so what the callbacks decide there
applies to that very step. A decision made after an event has a slot of its own: a worker still
reading the step's decision (it may be descheduled between the step's barrier and its read) reads
what every worker read, never the later one, which it learns in the event's barrier with the rest. Ctrl-Z pauses the workers with the launcher (``paused_together``): each
leads a session of its own, out of reach of a terminal's signals.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

_SIGNAL, _STOP_AT, _ASKED, _ACKNOWLEDGED, _SAVE_AT, _ASKED_STOP, _EVENT_STOP_AT = range(7)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlags:
    """Shared int64 flags: the first stop signal received anywhere (0: none), the step to stop
    after as decided at the step's end, a stop asked by a callback, the last event the launcher
    has heard of (that worker 0 waits for), a step whose checkpoint a callback asked for, whether
    the stop decided was a callback's (the run ends there) rather than a signal's (the run is to be
    resumed), and the step to stop after as decided after an event."""

    def __init__(self, block: torch.Tensor):
        self.block = block
        self._flags = block.numpy()  # the same memory: numpy's scalar reads cost a fraction of torch's, and a step makes several

    def __reduce__(self):
        return (StopFlags, (self.block,))

    @classmethod
    def allocate(cls) -> "StopFlags":
        return cls(torch.zeros(7, dtype=torch.int64).share_memory_())

    def request(self, signum: int) -> None:
        if int(self._flags[_SIGNAL]) == 0:
            self._flags[_SIGNAL] = signum

    def ask(self) -> None:
        """The launcher's callbacks ask the run to stop (``trainer.should_stop``): like a signal,
        but the run then ends normally."""
        self._flags[_ASKED] = 1

    @property
    def signal(self) -> int:
        """The signal that asked the run to stop, or 0."""
        return int(self._flags[_SIGNAL])

    def decide(self, step_done: int) -> None:
        """Worker 0, after a step, before the closing barrier: all workers stop after this step."""
        self._decide(step_done, _STOP_AT)

    def decide_after_event(self, step_done: int) -> None:
        """Worker 0, after an event's acknowledgement, before the event's barrier: all workers stop
        after this step. Its own slot: ``stops_after`` still tells every worker the step's decision."""
        self._decide(step_done, _EVENT_STOP_AT)

    def _decide(self, step_done: int, slot: int) -> None:
        decided = int(self._flags[_STOP_AT]) or int(self._flags[_EVENT_STOP_AT])
        if (self.signal or int(self._flags[_ASKED])) and not decided:
            self._flags[_ASKED_STOP] = 0 if self.signal else 1  # read after the barrier: the same in all
            self._flags[slot] = step_done

    def ends_run(self) -> bool:
        """Whether the stop decided was asked by a callback: the run ends there (a signal's is
        resumed from its checkpoint)."""
        return bool(int(self._flags[_ASKED_STOP]))

    def stops_after(self, step_done: int) -> bool:
        """Whether the decision at the end of step ``step_done`` stops the run there."""
        return int(self._flags[_STOP_AT]) == step_done

    def stops_after_event(self, step_done: int) -> bool:
        """Whether the run stops after step ``step_done``, decided at its end or after its event."""
        return self.stops_after(step_done) or int(self._flags[_EVENT_STOP_AT]) == step_done

    def save_at(self, step_done: int) -> None:
        """The launcher: the workers checkpoint ``step_done`` (asked on its evaluation)."""
        self._flags[_SAVE_AT] = step_done

    def saves_at(self, step_done: int) -> bool:
        return int(self._flags[_SAVE_AT]) == step_done

    def acknowledge(self) -> None:
        """The launcher has handed one more of the events worker 0 waits for to its callbacks."""
        self._flags[_ACKNOWLEDGED] += 1

    def wait_for_acknowledgement(self, sent: int) -> None:
        """Worker 0, having sent ``sent`` events it waits for (evaluations, awaited progress records)
        in this launch: until the launcher has handed all of them to its callbacks."""
        while int(self._flags[_ACKNOWLEDGED]) < sent:
            time.sleep(0.0005)  # another process's write to shared memory: nothing to block on

    def reset(self) -> None:
        """A new run: no request, no decision."""
        self._flags[:] = 0

    def clear_for_restart(self) -> None:
        """A restart starts a new stop decision; a stop request itself is never cleared."""
        self._flags[_STOP_AT] = 0
        self._flags[_EVENT_STOP_AT] = 0
        self._flags[_ACKNOWLEDGED] = 0
        self._flags[_SAVE_AT] = 0
        self._flags[_ASKED_STOP] = 0


class StopAgreement:
    """A worker's side of the stop decision made after an event the launcher's callbacks act on."""

    def __init__(self, flags: StopFlags, rank: int, barrier: Callable[[], None]):
        self.flags, self.rank, self.barrier = flags, rank, barrier
        self._awaited_sent = 0  # worker 0: the events it sent in this launch that it waits on the launcher for

    def after_event(self, step_done: int) -> bool:
        """After an event worker 0 sent for the launcher's callbacks to act on (an evaluation, an
        awaited progress record): worker 0 waits until the launcher has handed it to them and
        decides whether the run stops after this step (a callback may have asked); every worker
        reads the same decision, returned."""
        if self.rank == 0:
            self._awaited_sent += 1
            self.flags.wait_for_acknowledgement(self._awaited_sent)
            self.flags.decide_after_event(step_done)
        self.barrier()
        return self.flags.stops_after_event(step_done)


def stop_on_signals(flags: StopFlags) -> None:
    """In a worker: SIGINT and SIGTERM ask the whole run to stop at the next step boundary."""
    for s in STOP_SIGNALS:
        signal.signal(s, lambda signum, frame: flags.request(signum))


@contextmanager
def graceful_stop(flags: StopFlags):
    """In the launcher: the first SIGINT/SIGTERM requests a stop; a second raises KeyboardInterrupt.

    Outside the main thread (where Python cannot install handlers) it only yields.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum, frame):
        if received:
            raise KeyboardInterrupt  # second signal: stop now (the launcher kills the workers)
        received.append(signum)
        flags.request(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextmanager
def paused_together(workers: Callable[[], list[int]]):
    """In the launcher, while ``workers()`` (the pids of those still running) run: Ctrl-Z (SIGTSTP)
    pauses them with the launcher, and the launcher's continuing (``fg``, ``kill -CONT``) continues
    them. Each worker leads a session of its own, so a terminal's signals reach the launcher alone.

    Outside the main thread, or where SIGTSTP is not at its default, it only yields.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTSTP) is not signal.SIG_DFL:
        yield
        return

    def pause(signum, frame):
        paused = workers()
        for pid in paused:
            _send(pid, signal.SIGSTOP)
        # SIGSTOP rather than SIGTSTP: the kernel drops a SIGTSTP at its default to a process group
        # without a terminal's job control (a scheduler's), and this one must stop the launcher too.
        os.kill(os.getpid(), signal.SIGSTOP)
        for pid in paused:  # continued
            _send(pid, signal.SIGCONT)

    previous = signal.signal(signal.SIGTSTP, pause)
    try:
        yield
    finally:
        signal.signal(signal.SIGTSTP, previous)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it ended meanwhile
        pass
