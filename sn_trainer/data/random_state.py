"""A worker's random streams (torch's, numpy's, Python's ``random``): seeded, captured and restored together.

Augmentation draws from any of the three (timm's Mixup from numpy, torchvision's transforms from
torch, many scripts from ``random``), so each worker seeds all three from (seed, rank): the
streams differ between workers and repeat from run to run, and a checkpoint carries them as
tensors and plain data.
"""
from __future__ import annotations

import random
import sys
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


@contextmanager
def setting_watched():
    """Run a block and yield a function that says whether it set the state of any of the three
    streams in this thread: seeded one (``torch.manual_seed``, ``np.random.seed``, ``random.seed``)
    or put a state back (``set_rng_state``, ``set_state``, ``setstate``), as a dataset that seeds
    each sample's draws does. Such a block leaves the streams as they were, and still may not run
    beside another thread's draws: what it sets is the process's, shared by every thread."""
    torch_global = torch.default_generator
    python_setters = {random.Random.seed.__code__, random.Random.setstate.__code__}
    found: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__self__", None) is torch_global and \
                arg.__name__ in ("manual_seed", "set_state", "seed"):
            found.append(arg.__name__)
        elif event == "call" and frame.f_code in python_setters and frame.f_locals.get("self") is random._inst:
            found.append(frame.f_code.co_name)

    def recorded(name: str):  # numpy's are Cython functions, which a profile function never sees called
        original = getattr(np.random, name)

        def call(*args, **kwargs):
            found.append(name)
            return original(*args, **kwargs)

        return original, call

    numpy_setters = {name: recorded(name) for name in ("seed", "set_state")}
    for name, (_, call) in numpy_setters.items():
        setattr(np.random, name, call)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield lambda: bool(found)
    finally:
        sys.setprofile(previous)
        for name, (original, _) in numpy_setters.items():
            setattr(np.random, name, original)
