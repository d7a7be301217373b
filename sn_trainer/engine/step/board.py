"""What every worker publishes before a step's reduce, and what all of them read after it.

Each worker writes its loss sum, the count its loss is divided by, the sum of its own gradient
(non-finite if any element is), the digest of the global batch it read (a stream's), which
parameters its backward pass reached, and (worker 0) which buffers its forward passes changed.
The reduce that follows is a synchronisation in itself, so reading the board afterwards costs
nothing more: the loss, the divisor, the finite check, whether all read one batch, the unused
parameters and the buffers to adopt travel with the gradients.

Only sums reach every node, so the digests are compared through sums too: each worker writes its
digest's bytes d_i, their squares and a 1, and N * sum(d_i^2) == (sum d_i)^2 holds exactly when
every d_i is the same (all integers well below 2^53 for up to 2^18 workers: float64 sums them
exactly).

The board is a few hundred numbers: it is written and read through numpy views of its shared
block, where a scalar store or a small sum costs a fraction of a torch call on a tiny tensor, so
that a step pays next to nothing for it (`test_loop.py` counts a step's torch calls).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_LOSS, _COUNT, _GRAD = 0, 1, 2
_PARTS = 8  # a 64-bit digest as 8 bytes
_DIGEST, _SQUARES, _WORKERS = 3, 3 + _PARTS, 3 + 2 * _PARTS
_USED = _WORKERS + 1


def _terms(digest: int | None) -> np.ndarray:
    parts = np.frombuffer((digest or 0).to_bytes(_PARTS, "little"), dtype=np.uint8).astype(np.float64)
    return np.concatenate([parts, parts * parts, np.ones(1)])


_NO_DIGEST = _terms(None)


def digest_terms(digest: int | None) -> torch.Tensor:
    """What a worker adds to the sums for its ``digest`` (None: the same in every worker by
    construction): its 8 bytes, their squares, and a 1."""
    return torch.from_numpy(_terms(digest))


def one_digest(summed: torch.Tensor | np.ndarray | list[float]) -> bool:
    """Whether the workers whose ``digest_terms`` were summed into ``summed`` had one digest."""
    values = summed[: 2 * _PARTS + 1]
    values = values if isinstance(values, list) else values.tolist()
    parts, squares, workers = values[:_PARTS], values[_PARTS : 2 * _PARTS], values[2 * _PARTS]
    return all(workers * square == part * part for part, square in zip(parts, squares))


@dataclass(frozen=True)
class StepTotals:
    """The node's (or, across nodes, every node's) step, as all workers read it alike."""

    loss_sum: float
    count: float
    finite: bool
    unused: tuple[int, ...]  # layout slots no worker's backward pass reached
    changed_buffers: tuple[int, ...] = ()  # buffers worker 0's step changed (ReplicaBuffers' order)
    one_batch: bool = True  # every worker read the same global batch (the same digest, or none)


class Board:
    """A shared float64 block [2, workers, 20 + parameters + buffers], double-buffered by step parity.

    A peer writes a parity again only after the next step's reduce, which waits for this
    worker's read, so every worker reads the same values.
    """

    def __init__(self, block: torch.Tensor, parameters: int):
        self.block, self.parameters = block, parameters
        self._rows = block.numpy()  # the same memory

    def __reduce__(self):
        return (Board, (self.block, self.parameters))

    @classmethod
    def allocate(cls, workers: int, parameters: int, buffers: int = 0) -> "Board":
        return cls(torch.zeros(2, workers, _USED + parameters + buffers, dtype=torch.float64).share_memory_(),
                   parameters)

    def publish(self, step: int, rank: int, loss_sum: float, count: float, grad_sum: float,
                used: np.ndarray, changed: np.ndarray | None = None, digest: int | None = None) -> None:
        """``digest``: of the global batch this worker read (None: the same in every worker by construction)."""
        row = self._rows[step % 2, rank]
        row[_LOSS], row[_COUNT], row[_GRAD] = loss_sum, count, grad_sum
        row[_DIGEST:_USED] = _NO_DIGEST if digest is None else _terms(digest)
        row[_USED : _USED + self.parameters] = used
        if changed is not None:
            row[_USED + self.parameters :] = changed

    def totals(self, step: int) -> torch.Tensor:
        """This node's sums: loss, count, non-finite entries, the digests' parts, their squares and
        the workers, then per-parameter use counts."""
        published = self._rows[step % 2]
        out = published.sum(axis=0)
        # A sum of finite numbers is finite (short of an overflow past 1e308): count the non-finite
        # entries only where the sums say there may be some.
        if not math.isfinite(out[_LOSS] + out[_COUNT] + out[_GRAD]):
            out[_GRAD] = float(np.count_nonzero(~np.isfinite(published[:, :_DIGEST])))
        else:
            out[_GRAD] = 0.0
        return torch.from_numpy(out)

    def read(self, totals: torch.Tensor) -> StepTotals:
        values = totals.numpy()
        head = values[:_USED].tolist()
        loss_sum, count, non_finite = head[:_DIGEST]
        used, changed = values[_USED : _USED + self.parameters], values[_USED + self.parameters :]
        # Most steps reach every parameter and change no buffer: one count each says so.
        unused = tuple(np.flatnonzero(used == 0).tolist()) if np.count_nonzero(used) < used.size else ()
        moved = tuple(np.flatnonzero(changed).tolist()) if np.count_nonzero(changed) else ()
        return StepTotals(loss_sum, count, non_finite == 0 and math.isfinite(loss_sum), unused, moved,
                          one_digest(head[_DIGEST:]))


class Reached:
    """Which parameters a step's backward passes reached, as plain PyTorch tells them apart: a
    parameter no backward reached keeps ``.grad`` None, and the optimizer leaves it alone.

    Here every ``.grad`` is its place in the flat gradient buffer, never None. Autograd adds into
    a ``.grad`` that exists in place, which moves that tensor's version counter, and each
    ``.grad`` has a counter of its own (``FlatLayout.attach_gradients``): the counters before and
    after the backward passes tell which were reached, with no hook per parameter called from
    every backward."""

    def __init__(self, grads: list[torch.Tensor]):
        self.grads = grads
        self.start()

    def start(self) -> None:
        """Before a step's first backward pass."""
        self._versions = [g._version for g in self.grads]

    def flags(self) -> np.ndarray:
        """After its last: 1.0 for each parameter some backward pass added a gradient to, else 0.0."""
        return np.array([g._version != seen for g, seen in zip(self.grads, self._versions)], dtype=np.float64)
