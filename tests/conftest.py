import os

import pytest


@pytest.fixture
def no_leaks():
    """Assert that a test leaves no child process and no new /dev/shm entry behind."""
    from helpers import live_children

    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    assert live_children() == []
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm_after - shm_before == set()
