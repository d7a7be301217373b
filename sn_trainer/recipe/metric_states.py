"""torchmetrics ``Metric`` objects in evaluation: which merge exactly, and their states gathered across workers.

A metric such as a macro F1 is no mean of per-batch values: averaging it over chunks and
workers is not what one pass over the set computes. A torchmetrics ``Metric`` keeps states
that do merge (counts summed, predictions concatenated, extremes taken), so each worker updates
its own over its chunks, every worker gathers every worker's states through torchmetrics' own
synchronisation (its ``dist_sync_fn`` hook, given a gather made of sums), and the metric is
computed once from them. torchmetrics is never imported here: a value can only be a Metric if
the user's code imported it.
"""
from __future__ import annotations

import copyreg
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from . import by_sums

# The reductions whose merge is what one process computes over all the chunks. A "cat" state is
# concatenated in rank order: a map-style set's order, as its workers hold contiguous slices of it;
# a stream's chunks go round-robin, so there it holds the same rows in another order.
_EXACT_REDUCTIONS = ("dim_zero_sum", "dim_zero_cat", "dim_zero_min", "dim_zero_max")


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a torchmetrics ``Metric`` (without importing torchmetrics)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


class _Copied:
    """A tensor that pickles by value, whatever pickler carries it (not as a shared-memory handle)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __reduce__(self):
        return pickle.loads, (pickle.dumps(self.tensor.detach(), protocol=pickle.HIGHEST_PROTOCOL),)


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Copied(value)
    if isinstance(value, list):
        return [_copied(item) for item in value]
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    return value


def reduce_with_private_states(metric) -> tuple:
    """How a Metric is pickled to the workers: as itself, its tensors (states, their defaults) by
    value, so that each worker's are its own (in shared memory, an update in place such as
    ``self.total += n`` in one worker would add into every worker's copy). The rest, the Metrics
    inside it among it, goes through the same pickler, so that a Metric held in two places (a sum
    of metrics and its parts) stays one object."""
    return copyreg.__newobj__, (type(metric),), {key: _copied(value) for key, value in metric.__getstate__().items()}


def _parts(metric) -> list:
    """The metric and every Metric inside it (a sum of metrics, a wrapper), each keeping its own states."""
    return [module for module in metric.modules() if is_metric(module)]


def unmergeable(metric) -> str | None:
    """Why the states of ``metric`` cannot be merged exactly across workers (None: they can)."""
    for part in _parts(metric):
        if not part.sync_on_compute:
            return f"{type(part).__name__} was built with sync_on_compute=False, so its states would not be merged"
        for state, reduction in part._reductions.items():
            name = getattr(reduction, "__name__", repr(reduction))
            if name in _EXACT_REDUCTIONS:
                continue
            # Not "mean" (a mean of each worker's mean, whatever each counted), nor None: the
            # metric's own rule for stacked states, or a list synchronised element by element,
            # which workers holding different numbers of chunks cannot do together.
            how = {"dim_zero_mean": "by a mean of each worker's value",
                   "None": "by the metric's own rule for each worker's states"}.get(name, f"by {name}")
            return (f"its state {state!r} ({type(part).__name__}) is merged across workers {how}, which sn_trainer "
                    "has not proven equal to one pass over the set")
    return None


def fresh(metric):
    """A copy of ``metric`` with its states as built (what a worker that evaluated nothing holds)."""
    copy = metric.clone()
    copy.reset()
    return copy


def computed(metric, gather: Callable | None, what: str) -> float:
    """``metric.compute()`` over every worker's states (``gather(tensor)`` returns each worker's
    tensor, in rank order; None: this is the only worker), as one number.

    Raises:
        ConfigError: the metric computes something other than one number.
    """
    parts = _parts(metric)
    kept = [(part.dist_sync_fn, part.distributed_available_fn) for part in parts]
    try:
        for part in parts:
            # Every part synchronises again, value cached or not: a part computed already (the F1
            # of a sum of metrics, computed before the F1 itself) must take part in the gathers,
            # as it does in a worker that holds it only as built.
            part._computed = None
            if gather is not None:
                part.dist_sync_fn = lambda tensor, group=None: gather(tensor)
            part.distributed_available_fn = (lambda: True) if gather is not None else (lambda: False)
        with warnings.catch_warnings():
            # A worker whose slice held no chunk computes from states it never updated: on
            # purpose, with everyone else's, so torchmetrics' warning about it is noise.
            warnings.filterwarnings("ignore", message=".*compute.* was called before the .*update")
            value = metric.compute()
    finally:
        for part, (sync_fn, available_fn) in zip(parts, kept):
            part.dist_sync_fn, part.distributed_available_fn = sync_fn, available_fn
    return as_number(value, metric, what)


def as_number(value: Any, metric, what: str) -> float:
    """What ``metric.compute()`` returned, as a float.

    Raises:
        ConfigError: it is not one number.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    shape = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ConfigError(f"{what} ({type(metric).__name__}) computes {shape}, not one number; give each number its own "
                    "name in metric_fn's dict (e.g. average='macro' for one F1 over the classes)")


def gather_by_sums(tensor: torch.Tensor, rank: int, world: int, global_sum: by_sums.Sum) -> list[torch.Tensor]:
    """Every worker's ``tensor``, in rank order, through two float64 sums (every worker calls it
    with the tensor of the same state). Tensors may differ in shape (a concatenated state); the
    empty ones are then left out.

    Raises:
        TypeError: a worker's tensor cannot travel exactly (every worker raises it).
    """
    problem = by_sums.problem(tensor)
    rows = by_sums.headers(None if problem else tensor, [1.0 if problem else 0.0], rank, world, global_sum)
    if rows[:, 0].any():
        raise TypeError(f"a metric state cannot be merged exactly: {problem or 'so in another worker'}")
    shapes = [by_sums.shape_of(row, 1) for row in rows]
    numels = [by_sums.numel(shape) for shape in shapes]
    values = by_sums.concatenated(tensor, rank, numels, global_sum)
    offsets = [sum(numels[:r]) for r in range(world)]
    pieces = [values[offsets[r] : offsets[r] + numels[r]].to(by_sums.dtype_of(rows[r], 1)).reshape(shapes[r])
              for r in range(world)]
    if len(set(shapes)) > 1:  # a concatenated state: an empty piece adds nothing (and may carry another dtype)
        pieces = [piece for piece in pieces if piece.numel()] or pieces[:1]
    return pieces
