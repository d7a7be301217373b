"""Values that are ambient, as ``torch.no_grad`` is: set around a block for the user's code to read
(the gather a step makes, the position a step is at), because that code is called with nothing
but its own arguments."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def within(variable: contextvars.ContextVar, value: T) -> Iterator[T]:
    """Make ``value`` what ``variable`` holds while the block runs."""
    token = variable.set(value)
    try:
        yield value
    finally:
        variable.reset(token)
