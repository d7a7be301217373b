import _posixsubprocess
import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
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


# Side by side (pytest-xdist, -n): the folder of the lock files that the test processes of one session share.
_TURNS = "SN_TRAINER_TEST_TURNS"


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        folder = tempfile.mkdtemp(prefix="sn-trainer-turns-")
        os.environ[_TURNS] = folder  # the test processes xdist starts next inherit it
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


# The modules that take minutes, longest first (--durations=0 ranks them). Side by side, each test
# process starts on a long one and the short ones fill in at the end, so that both end together.
LONGEST_FIRST = ("test_benchmarks", "test_elastic", "test_operations", "test_ray_nodes", "test_launcher",
                 "test_faults", "test_multinode", "test_cli", "test_compress", "test_ray", "test_ecosystem")


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a test process of -n's: one at a time, the order stays as collected
        place = {name: index for index, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: place.get(item.path.stem, len(LONGEST_FIRST)))  # stable: the rest as collected
    for item in items:
        if "no_leaks" in item.fixturenames:  # it reads what /dev/shm and the System V segments hold
            item.add_marker("alone")


@contextlib.contextmanager
def _turn(item):
    """Under pytest-xdist, a test marked alone runs with no other test beside it; the others run side by
    side. A readers-writer lock: every test holds the machine's lock shared, an alone one exclusive, and
    each takes it through a turnstile, so that an alone test waiting for it holds back the tests after it."""
    folder = os.environ.get(_TURNS)
    if folder is None or not hasattr(item.config, "workerinput"):
        yield
        return
    mode = fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH
    with open(os.path.join(folder, "turnstile"), "a") as turnstile, open(os.path.join(folder, "machine"), "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, mode)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item):
        yield
