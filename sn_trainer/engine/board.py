"""What every worker publishes before a step's reduce, and what all of them read after it.

Each worker writes its loss sum, the count its loss is divided by, the sum of its own gradient
(non-finite if any element is) and which parameters its backward pass reached. The reduce that
follows is a synchronisation in itself, so reading the board afterwards costs nothing more:
the loss, the divisor, the finite check and the unused parameters travel with the gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_LOSS, _COUNT, _GRAD, _USED = 0, 1, 2, 3


@dataclass(frozen=True)
class StepTotals:
    """The node's (or, across nodes, every node's) step, as all workers read it alike."""

    loss_sum: float
    count: float
    finite: bool
    unused: tuple[int, ...]  # layout slots no worker's backward pass reached


class Board:
    """A shared float64 block [2, workers, 3 + parameters], double-buffered by step parity.

    A peer writes a parity again only after the next step's reduce, which waits for this
    worker's read, so every worker reads the same values.
    """

    def __init__(self, block: torch.Tensor):
        self.block = block

    @classmethod
    def allocate(cls, workers: int, parameters: int) -> "Board":
        return cls(torch.zeros(2, workers, _USED + parameters, dtype=torch.float64).share_memory_())

    def publish(self, step: int, rank: int, loss_sum: float, count: float, grad_sum: float,
                used: torch.Tensor) -> None:
        row = self.block[step % 2, rank]
        row[_LOSS], row[_COUNT], row[_GRAD] = loss_sum, count, grad_sum
        row[_USED:] = used

    def totals(self, step: int) -> torch.Tensor:
        """This node's sums: loss, count, non-finite entries, then per-parameter use counts."""
        published = self.block[step % 2]
        out = published.sum(dim=0)
        out[_GRAD] = float((~torch.isfinite(published[:, :_USED])).sum())
        return out

    @staticmethod
    def read(totals: torch.Tensor) -> StepTotals:
        loss_sum, count, non_finite = totals[:_USED].tolist()
        unused = tuple(int(i) for i in torch.nonzero(totals[_USED:] == 0).flatten())
        return StepTotals(loss_sum, count, non_finite == 0 and math.isfinite(loss_sum), unused)
