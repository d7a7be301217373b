"""Values that are ambient, as ``torch.no_grad`` is: set around a block for the user's code to read
(the gather a step makes, the position a step is at), because that code is called with nothing
but its own arguments."""
from __future__ import annotations

import contextvars
from typing import Generic, TypeVar

T = TypeVar("T")


def within(variable: contextvars.ContextVar, value: T) -> "_Within[T]":
    """Make ``value`` what ``variable`` holds while the block runs."""
    return _Within(variable, value)


class _Within(Generic[T]):
    """``within``'s block: a plain object rather than a generator-based context manager, as every
    micro-batch of a step enters two of them."""

    __slots__ = ("variable", "value", "token")

    def __init__(self, variable: contextvars.ContextVar, value: T):
        self.variable, self.value = variable, value

    def __enter__(self) -> T:
        self.token = self.variable.set(self.value)
        return self.value

    def __exit__(self, *exc) -> None:
        self.variable.reset(self.token)
