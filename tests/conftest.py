import os

import pytest


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
