"""Tensors exchanged between workers through sums: each worker's values in its own place of a
float64 tensor of zeros that every worker sums, so every addition is of a zero and exact.

The engine's one collective is a float64 sum (in shared memory in a node, gloo across nodes);
the gather of ``sn_trainer.gather`` and the merge of torchmetrics states are built on it here.
float64 holds every value of these dtypes exactly, integers up to 2**53.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

Sum = Callable[[torch.Tensor], torch.Tensor]  # sums a float64 tensor over the workers, in place
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8  # dimensions a tensor may have: what the shape exchange carries
EXACT_INTEGERS = 2 ** 53


def problem(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot travel exactly through float64 sums (None: it can)."""
    if tensor.dtype not in DTYPES:
        return f"its dtype is {tensor.dtype}"
    if tensor.dim() > MAX_DIMS:
        return f"it has {tensor.dim()} dimensions"
    if tensor.device.type != "cpu":
        return f"it is on {tensor.device}"
    if not tensor.is_floating_point() and tensor.dtype != torch.bool and tensor.numel() \
            and int(tensor.abs().max()) > EXACT_INTEGERS:
        return "it holds integers beyond 2**53"
    return None


def headers(tensor: torch.Tensor | None, head: list[float], rank: int, world: int, sum_: Sum) -> torch.Tensor:
    """Every worker's row ``[*head, dtype, dims, *shape]`` (zeros after ``head`` for a worker whose
    tensor is None), one row per worker in rank order."""
    width = len(head)
    rows = torch.zeros(world, width + 2 + MAX_DIMS, dtype=torch.float64)
    rows[rank, :width] = torch.tensor(head, dtype=torch.float64)
    if tensor is not None:
        rows[rank, width] = DTYPES.index(tensor.dtype)
        rows[rank, width + 1] = tensor.dim()
        rows[rank, width + 2 : width + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.float64)
    sum_(rows)
    return rows


def dtype_of(row: torch.Tensor, width: int) -> torch.dtype:
    return DTYPES[int(row[width])]


def shape_of(row: torch.Tensor, width: int) -> tuple[int, ...]:
    return tuple(int(n) for n in row[width + 2 : width + 2 + int(row[width + 1])].tolist())


def concatenated(tensor: torch.Tensor, rank: int, numels: list[int], sum_: Sum) -> torch.Tensor:
    """Every worker's flattened tensor, worker 0's first, as one float64 vector (``numels``: each
    worker's element count)."""
    start = sum(numels[:rank])
    values = torch.zeros(sum(numels), dtype=torch.float64)
    values[start : start + numels[rank]] = tensor.detach().reshape(-1).to(torch.float64)
    if values.numel():
        sum_(values)
    return values


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
