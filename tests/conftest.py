import _posixsubprocess
import contextlib
import os
import subprocess
from multiprocessing.process import BaseProcess

import pytest

# Every way a test can start a process: multiprocessing's Process.start (a running fork server
# forks the new process in its own), fork and exec (a fork server's or spawn's start, subprocess's
# own reference to fork_exec, taken at import), os.system and posix_spawn.
_STARTERS = [(BaseProcess, "start"), (os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"),
             (os, "system"), (_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec")]


@pytest.fixture
def no_leaks():
    """The test leaves no child process or shared memory behind (leaks_checked)."""
    from helpers import leaks_checked

    with leaks_checked():
        yield


@contextlib.contextmanager
def _refusing_processes(nodeid: str):
    """While the block runs, starting a process fails the test: a unit test starts none."""
    def refusal(name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"{nodeid} is marked unit but started a process ({name}): "
                                 "a unit test starts none; take the mark off")
        return refuse

    saved = [(module, name, getattr(module, name)) for module, name in _STARTERS if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, refusal(name))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _unit_tier(item):
    if item.get_closest_marker("unit") is None:
        yield
        return
    with _refusing_processes(item.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _unit_tier(item)  # the fixtures it needs, session-scoped ones made for it included


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _unit_tier(item)
