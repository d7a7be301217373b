"""A worker's random streams (torch's, numpy's, Python's ``random``): seeded, captured and restored together.

Augmentation draws from any of the three (timm's Mixup from numpy, torchvision's transforms from
torch, many scripts from ``random``), so each worker seeds all three from (seed, rank): the
streams differ between workers and repeat from run to run, and a checkpoint carries them as
tensors and plain data.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def seed(value: int) -> None:
    torch.manual_seed(value)
    np.random.seed(value % 2**32)
    random.seed(value)


def capture() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)],
            "random": [version, list(internal), gauss_next]}


def restore(state: dict[str, Any] | torch.Tensor) -> None:
    """Set the streams ``capture`` gave (a bare tensor: torch's only, as checkpoints before version 3 hold)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (torch.equal(a["torch"], b["torch"]) and a["numpy"][2:] == b["numpy"][2:]
            and torch.equal(a["numpy"][1], b["numpy"][1]) and a["random"] == b["random"])


@contextmanager
def kept():
    """Run a block and put the three streams back as they were; yields a function that says
    whether the block drew from any of them."""
    before = capture()
    after: list[dict[str, Any]] = []
    try:
        yield lambda: not _same(before, after[0])
    finally:
        after.append(capture())
        restore(before)
