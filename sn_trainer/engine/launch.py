"""Start worker processes, relay their messages, and tear every one of them down on any failure."""
from __future__ import annotations

import ctypes
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

_PR_SET_PDEATHSIG = 1


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message names it and carries its traceback or signal."""

    def __init__(self, rank: int, detail: str, others: list[tuple[int, str]] | None = None):
        self.rank = rank
        self.detail = detail
        text = f"worker {rank} failed: {detail.rstrip()}"
        for other_rank, other in others or []:
            last = other.strip().splitlines()[-1] if other.strip() else "?"
            text += f"\n(then worker {other_rank}: {last})"
        super().__init__(text)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode} before reporting a result"


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this worker when its parent dies: no orphans, ever."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's teardown still applies
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _bootstrap(target: Callable, payload: Any, conn: Connection, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # The parent handles Ctrl-C for the whole run; a worker stopping on its own would only
    # turn one clean shutdown into W tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = target(payload, lambda message: conn.send(("message", message)))
        conn.send(("done", result))
    except BaseException:  # noqa: BLE001 - anything a worker raises is reported, then it exits
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
    finally:
        conn.close()


def launch(
    target: Callable[[Any, Callable[[Any], None]], Any],
    payloads: list[Any],
    on_message: Callable[[int, Any], None] | None = None,
    on_tick: Callable[[list[int]], None] | None = None,
    tick_s: float = 1.0,
) -> list[Any]:
    """Run ``target(payload, send)`` in one spawned process per payload; return their results.

    ``send(message)`` in a worker delivers ``on_message(rank, message)`` here. ``on_tick`` is
    called with the workers' pids about every ``tick_s`` seconds (memory sampling).

    Raises:
        WorkerFailed: as soon as one worker raises or dies; by then every worker is dead.
    """
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for payload in payloads:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_bootstrap, args=(target, payload, writer, os.getpid()), daemon=True)
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        return _supervise(procs, conns, on_message, on_tick, tick_s)
    finally:
        _teardown(procs)
        for conn in conns:
            conn.close()


def _supervise(procs, conns, on_message, on_tick, tick_s) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    running = set(range(len(procs)))
    open_conns = {conn: rank for rank, conn in enumerate(conns)}

    def drain(conn: Connection, rank: int) -> None:
        try:
            while conn.poll():
                kind, body = conn.recv()
                if kind == "message" and on_message is not None:
                    on_message(rank, body)
                elif kind == "done":
                    results[rank] = body
                elif kind == "error":
                    failures.append((rank, body))
        except (EOFError, OSError):
            open_conns.pop(conn, None)

    while running and not failures:
        sentinels = {procs[r].sentinel: r for r in running}
        for ready in wait(list(open_conns) + list(sentinels), timeout=tick_s):
            if ready in open_conns:
                drain(ready, open_conns[ready])
            elif ready in sentinels:
                rank = sentinels[ready]
                procs[rank].join()
                drain(conns[rank], rank)  # messages sent just before exiting
                running.discard(rank)
                if rank not in results and not any(r == rank for r, _ in failures):
                    failures.append((rank, describe_exit(procs[rank].exitcode)))
        if on_tick is not None and running:
            on_tick([procs[r].pid for r in running])
    if failures:
        rank, detail = failures[0]
        raise WorkerFailed(rank, detail, failures[1:])
    return [results[r] for r in range(len(procs))]


def _teardown(procs) -> None:
    """Kill whatever still runs and reap it. Workers hold nothing that a kill could corrupt."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)
