"""``sn_trainer.gather``: a step function's view of the whole global batch, for losses that couple samples.

A contrastive loss (SimCLR's NT-Xent, CLIP's) compares every sample with every other of the
batch, so it cannot be split into per-worker sums. Inside a training step, ``gather(z)`` returns
the global micro-batch's ``z``: every worker's slice, in sample order (worker 0's first), the
same bits in every worker. Each worker then computes the same loss ``L`` over the global batch.

The gradient is exact by construction. Every worker's backward pass runs through the whole of
``L``: parameters used after the gather (a projection head on the gathered batch, a learnable
temperature) get all of ``dL/dθ`` in every worker, while the backward of ``gather`` hands each
worker ``W`` times the gradient of its own slice only (the workers hold the same ``dL/dz``, so no
exchange is needed). Every worker counts its micro-batch once, and the step divides the summed
gradient by the count, ``W`` per micro-batch: the mean over the workers is ``dL/dθ`` exactly.
That needs the same ``L`` in every worker, which each micro-batch checks.

Where a gather is made decides what it does (``gathering``): in a training step of several
workers it exchanges; where one process holds the whole batch (one worker, the loss probe, a
plain loop outside sn_trainer) it returns its argument; where it cannot be exact it refuses.
The current gathering is ambient, as ``torch.no_grad`` is, because the user's step function
calls ``gather`` with nothing but the tensor.
"""
from __future__ import annotations

import contextvars
from contextlib import AbstractContextManager

import torch

from ..errors import InputError
from . import by_sums
from . import ambient

# Every worker computes the same loss from the same gathered bits; only kernels that round
# differently at another memory alignment may move it, by far less than this.
_SAME_LOSS = 1e-6


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The global batch's ``tensor``: each worker's slice (dimension 0), worker 0's first, in sample order.

    Call it inside ``step_fn`` on what the step computed from its slice (embeddings, logits),
    then compute the loss over the whole batch from what it returns and return that scalar, or
    ``(loss_sum, count)`` over the whole batch (its loss is ``loss_sum / count``): every worker
    computes the same loss, and the step's gradient is that loss's, exactly. Gradients
    flow back to each worker's own slice. Outside sn_trainer (a plain loop) and with one worker
    it returns ``tensor`` itself. Floating tensors keep their gradient; integer and bool tensors
    (labels) are gathered without one.

    Raises:
        InputError: called where it cannot be exact (evaluation with several workers, a step the
            loss probe saw without it), or with slices whose shapes differ beyond dimension 0.
    """
    return current().gather(tensor)


class Gathering:
    """Where one process holds the whole batch (the loss probe, one worker's evaluation): ``gather``
    returns its argument, and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        _check(tensor)
        self.calls += 1
        return tensor

    def terms(self, loss: torch.Tensor, samples: int) -> tuple[torch.Tensor, float]:
        """``(loss_sum, count)`` of a loss over a gathered batch: here a batch of ``samples`` on its
        own (an evaluation chunk), weighed by its samples as a plain evaluation loop weighs it."""
        return loss * samples, float(samples)


class Refusing(Gathering):
    """Where a gather cannot be exact: calling it raises, saying ``why``."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise InputError(self.why)


class StepGathering(Gathering):
    """One micro-batch of a training step, in worker ``rank`` of ``workers``: gathers exchange the
    slices through ``sum_in_node`` (each worker's slice in its own rows, zeros elsewhere: the sum is
    the concatenation, the same bits everywhere)."""

    def __init__(self, rank: int, workers: int, sum_in_node: by_sums.Sum) -> None:
        super().__init__()
        self.rank, self.workers, self.sum_in_node = rank, workers, sum_in_node

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        _check(tensor)
        self.calls += 1
        if self.workers == 1:
            return tensor
        sizes = self._sizes(tensor)
        if tensor.is_floating_point():
            return _Gather.apply(tensor, self, sizes)
        return self._exchange(tensor.detach(), sizes)

    def _sizes(self, tensor: torch.Tensor) -> list[int]:
        """Every worker's slice size; the same call, dimensions and dtype in all of them, or an error."""
        rows = by_sums.headers(tensor, [self.calls], self.rank, self.workers, self.sum_in_node)
        beyond = [(row[:3].tolist(), by_sums.shape_of(row, 1)[1:]) for row in rows]  # all but the batch's size
        for rank, theirs in enumerate(beyond):
            if theirs != beyond[self.rank]:
                raise InputError(f"sn_trainer.gather call {self.calls}: worker {rank} gathers "
                                 f"{_describe(rows[rank])}, worker {self.rank} {_describe(rows[self.rank])}; "
                                 "every worker must gather the same tensors in the same order, alike beyond "
                                 "dimension 0 (the batch)")
        return [by_sums.shape_of(row, 1)[0] for row in rows]

    def _exchange(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        row = by_sums.numel(tuple(tensor.shape[1:]))
        values = by_sums.concatenated(tensor, self.rank, [n * row for n in sizes], self.sum_in_node)
        return values.reshape(sum(sizes), *tensor.shape[1:]).to(tensor.dtype)

    def terms(self, loss: torch.Tensor, samples: int) -> tuple[torch.Tensor, float]:
        """``(loss, 1)``: each worker's micro-batch counted once (see the module's docstring).

        Raises:
            InputError: no gather in this micro-batch, or a loss that differs between the workers.
        """
        if self.calls == 0:
            raise InputError("step_fn called sn_trainer.gather when its loss was probed before the run, but not on "
                             "this micro-batch: call it on every batch")
        if self.workers > 1:
            losses = torch.zeros(self.workers, dtype=torch.float64)
            losses[self.rank] = loss.detach().double()
            self.sum_in_node(losses)
            spread = (losses.max() - losses.min()).item()
            if torch.isfinite(losses).all() and spread > _SAME_LOSS * losses.abs().max().item():
                raise InputError(f"step_fn's loss over the gathered batch differs between workers "
                                 f"({', '.join(f'{v:.10g}' for v in losses.tolist())}): compute it from what "
                                 "sn_trainer.gather returns only, with no term of the worker's own slice and no "
                                 "random draw (dropout) after the gather, so that every worker computes the same loss")
        return loss, 1.0


class _Gather(torch.autograd.Function):
    """The exchange, whose backward hands this worker ``W`` times the gradient of its own rows."""

    @staticmethod
    def forward(ctx, tensor, gathering, sizes):
        ctx.start, ctx.stop = sum(sizes[: gathering.rank]), sum(sizes[: gathering.rank + 1])
        ctx.workers = gathering.workers
        return gathering._exchange(tensor.detach(), sizes)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.stop] * ctx.workers, None, None


def _check(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise InputError(f"sn_trainer.gather takes a tensor whose dimension 0 is the batch, got "
                         f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    problem = by_sums.problem(tensor)
    if problem:
        raise InputError(f"sn_trainer.gather takes a CPU float, integer or bool tensor of at most {by_sums.MAX_DIMS} "
                         f"dimensions with integers up to 2**53 (the exchange is through float64), but {problem}")


def _describe(row: torch.Tensor) -> str:
    return f"{by_sums.dtype_of(row, 1)} of shape {by_sums.shape_of(row, 1)}"


_current: contextvars.ContextVar[Gathering | None] = contextvars.ContextVar("sn_trainer_gathering", default=None)


def gathering(how: Gathering) -> AbstractContextManager[Gathering]:
    """Make ``how`` what ``gather`` calls do while the block runs (a step's micro-batch, an evaluation)."""
    return ambient.within(_current, how)


def current() -> Gathering:
    """What a gather does here (outside any block: one process with the whole batch)."""
    return _current.get() or Gathering()
