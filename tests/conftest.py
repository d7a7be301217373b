import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: each test module's first test (its first parameters), so every story "
                          "runs once; the full suite is what CI runs")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--quick"):
        return
    kept, dropped, modules = [], [], set()
    for item in items:
        (dropped if item.path in modules else kept).append(item)
        modules.add(item.path)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.fixture
def no_leaks():
    """Assert that a test leaves no child process, no new /dev/shm entry and no shared-memory segment
    that would outlive its processes behind."""
    from helpers import kept_segments, live_children

    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    segments_before = kept_segments()
    yield
    assert live_children() == []
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after - shm_before == set()
    assert kept_segments() - segments_before == set()
