"""PowerSGD between nodes: each node's summed shard gradient sent as low-rank factors, with error feedback.

Inside a node gradients are summed exactly (shared memory or gloo); only the exchange of a
shard between nodes is compressed. A shard is cut at its parameters' boundaries: the whole rows
of a parameter inside the shard form a matrix (its first dimension by the rest, in stored order),
compressed where that saves elements; everything else (biases, the ends of a parameter cut
mid-row by the shard, matrices whose smaller side is at most the rank) is all-reduced as it is.

One compressed exchange, on every node alike (M: this node's matrix plus its error feedback):
P = M Q, all-reduce P, orthogonalise it, Q = M^T P, all-reduce Q, and the sum over the nodes is
taken as P Q^T. Both factors are all-reduced, so every node holds the same bits of them and
applies the same update. Each node keeps what its own share left out, M - P Q_node^T, and adds
it to its next step's gradient: the nodes' errors add up to what the sum left out.

torch's PowerSGD works on a DDP GradBucket and DDP's process group, which the engine has
neither of; its state class holds the settings and the per-matrix memories here, and its
worth-compressing test is used as it is. P is orthogonalised by QR (Householder), not by the
Gram-Schmidt torch's helper uses up to rank 2: where a gradient's rank is below the factors'
(a zero gradient, a rank-1 one), Gram-Schmidt divides rounding noise by its own norm and the
columns of P are no longer orthogonal, so P P^T M counts a direction twice; QR's stay orthonormal.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress

from ...recipe.flat_layout import FlatLayout

log = logging.getLogger(__name__)

# A matrix is compressed where its factors are at most half its elements (torch's default rate).
MIN_COMPRESSION_RATE = 2


@dataclass(frozen=True)
class Matrix:
    """Whole rows of one parameter inside a shard: ``rows`` x ``cols`` from ``start`` (shard-relative)."""

    name: str
    start: int
    rows: int
    cols: int

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.cols


@dataclass(frozen=True)
class ShardCompression:
    """How one shard is sent between nodes: its compressed matrices, and the rest as it is."""

    matrices: tuple[Matrix, ...]
    too_small: tuple[str, ...]  # parameters (with 2+ dimensions) in the shard sent uncompressed for the rank
    numel: int

    def uncompressed_numel(self) -> int:
        return self.numel - sum(m.rows * m.cols for m in self.matrices)

    def elements_sent(self, rank: int) -> int:
        """Elements each node sends per compressed step (P and Q of each matrix, and the rest)."""
        return self.uncompressed_numel() + sum((m.rows + m.cols) * rank for m in self.matrices)


def shard_compression(layout: FlatLayout, shard_index: int, rank: int) -> ShardCompression:
    """Which parts of shard ``shard_index`` of ``layout`` go as rank-``rank`` factors."""
    shard = layout.shards[shard_index]
    matrices, too_small = [], []
    for piece in layout.pieces(shard_index):
        slot = layout.slots[piece.slot]
        if len(slot.shape) < 2:
            continue
        cols = slot.numel // slot.shape[0]
        first_row = -(-(piece.start - slot.offset) // cols)
        rows = (piece.stop - slot.offset) // cols - first_row
        worth = rows > 0 and _should_compress(rows, cols, rank, MIN_COMPRESSION_RATE)[0]
        if worth and min(rows, cols) > rank:
            matrices.append(Matrix(slot.name, slot.offset + first_row * cols - shard.start, rows, cols))
        else:
            too_small.append(slot.name)
    return ShardCompression(tuple(matrices), tuple(too_small), shard.size)


def describe(layout: FlatLayout, rank: int, after: int) -> str:
    """One line for the plan and the log: what is compressed, from when, and that it is approximate."""
    plans = [shard_compression(layout, index, rank) for index in range(len(layout.shards))]
    compressed = sum(len(p.matrices) for p in plans)
    sent = sum(p.elements_sent(rank) for p in plans)
    text = (f"compress=powersgd rank {rank} after {after} steps: approximate (between nodes; {compressed} "
            f"matrices, {sent} of {layout.numel} elements sent per step)")
    small = sorted({name for p in plans for name in p.too_small})
    if small:
        text += f"; sent uncompressed, their smaller side <= rank {rank} or too small to gain: {', '.join(small)}"
    return text


class PowerSGD:
    """One worker's compressed exchange of its shard with the same shard of the other nodes."""

    def __init__(self, plan: ShardCompression, rank: int, after: int, seed: int, steps_done: int = 0):
        self.plan, self.after, self.seed, self.steps_done = plan, after, seed, steps_done
        # The memories: error_dict (this node's error feedback, one per matrix), q_memory_dict
        # (the last Q, the next step's warm start). A fresh Q is drawn from (seed, matrix, step),
        # not from the state's stream, so that it is the same on every node and after a resume.
        self.state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=max(2, after),
                                   min_compression_rate=MIN_COMPRESSION_RATE, random_seed=seed)

    def reduce(self, shard_grad: torch.Tensor, group) -> torch.Tensor:
        """Sum ``shard_grad`` over the nodes in place: exactly for the first ``after`` steps, then
        as low-rank factors where the plan compresses, the rest exactly."""
        self.steps_done += 1
        if self.steps_done <= self.after or not self.plan.matrices:
            group.allreduce([shard_grad]).wait()
            return shard_grad
        rest = self._uncompressed(shard_grad)
        work = group.allreduce([rest]) if rest.numel() else None
        self._compressed(shard_grad, group)
        if work is not None:
            work.wait()
            self._put_back(shard_grad, rest)
        return shard_grad

    def _spans(self) -> list[tuple[int, int]]:
        """The shard's uncompressed runs, in order."""
        spans, at = [], 0
        for m in self.plan.matrices:
            if m.start > at:
                spans.append((at, m.start))
            at = m.stop
        if at < self.plan.numel:
            spans.append((at, self.plan.numel))
        return spans

    def _uncompressed(self, shard_grad: torch.Tensor) -> torch.Tensor:
        spans = self._spans()
        return torch.cat([shard_grad[a:b] for a, b in spans]) if spans else shard_grad[:0].clone()

    def _put_back(self, shard_grad: torch.Tensor, rest: torch.Tensor) -> None:
        at = 0
        for a, b in self._spans():
            shard_grad[a:b].copy_(rest[at : at + b - a])
            at += b - a

    def _compressed(self, shard_grad: torch.Tensor, group) -> None:
        """Every matrix's P, then every Q, each all-reduced in one message."""
        rank = self.state.matrix_approximation_rank
        ms = [self._with_error(index, shard_grad[m.start : m.stop].view(m.rows, m.cols))
              for index, m in enumerate(self.plan.matrices)]
        ps = torch.cat([(matrix @ self._q(index, m, shard_grad.dtype)).reshape(-1)
                        for index, (matrix, m) in enumerate(zip(ms, self.plan.matrices))])
        group.allreduce([ps]).wait()
        p_list, q_local, at = [], [], 0
        for matrix, m in zip(ms, self.plan.matrices):
            p = torch.linalg.qr(ps[at : at + m.rows * rank].view(m.rows, rank)).Q
            at += m.rows * rank
            p_list.append(p)
            q_local.append(matrix.t() @ p)
        q_sum = torch.cat([q.reshape(-1) for q in q_local])
        group.allreduce([q_sum]).wait()
        at = 0
        for index, (matrix, m, p, own_q) in enumerate(zip(ms, self.plan.matrices, p_list, q_local)):
            q = q_sum[at : at + m.cols * rank].view(m.cols, rank)
            at += m.cols * rank
            self._remember(index, matrix - p @ own_q.t(), q)
            torch.matmul(p, q.t(), out=shard_grad[m.start : m.stop].view(m.rows, m.cols))

    def _with_error(self, index: int, gradient: torch.Tensor) -> torch.Tensor:
        error = self.state.error_dict.get(index)
        return gradient + error if error is not None else gradient.clone()

    def _q(self, index: int, m: Matrix, dtype: torch.dtype) -> torch.Tensor:
        """The last step's Q (warm start), or a fresh one drawn alike on every node."""
        q = self.state.q_memory_dict.get(index)
        if q is None:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 1_000_003 + self.steps_done)
            q = torch.randn(m.cols, self.state.matrix_approximation_rank, generator=generator, dtype=dtype)
        return q

    def _remember(self, index: int, error: torch.Tensor, q: torch.Tensor) -> None:
        """Keep this node's error and the shared Q for the next step; a non-finite one is
        dropped (a skipped step must not poison every later one): Q's bits, and so the choice,
        are the same on every node."""
        self.state.error_dict[index] = error if bool(torch.isfinite(error).all()) else torch.zeros_like(error)
        if bool(torch.isfinite(q).all()):
            self.state.q_memory_dict[index] = q.clone()
        else:
            self.state.q_memory_dict.pop(index, None)

    # --- state a checkpoint keeps ----------------------------------------------------------------

    def gathered_state(self, group, nodes: int) -> dict:
        """Every node's error feedback (gathered from all of them: every node must call this at
        the same step), the warm-start Qs (the same on every node) and the steps done."""
        mine = torch.cat([self.state.error_dict[i].reshape(-1) if i in self.state.error_dict
                          else torch.zeros(m.rows * m.cols) for i, m in enumerate(self.plan.matrices)]
                         or [torch.zeros(0)])
        everyone = [torch.empty_like(mine) for _ in range(nodes)]
        group.allgather([everyone], [mine]).wait()
        return {"steps_done": self.steps_done, "errors": torch.stack(everyone),
                "q": {str(i): q.clone() for i, q in self.state.q_memory_dict.items()}}

    def load_state(self, saved: dict, node_rank: int, nodes: int) -> None:
        """Go on from ``gathered_state``'s record, with this node's own error feedback (from zero,
        said, where it was written by another number of nodes)."""
        if saved["errors"].shape[0] != nodes:
            log.warning("the checkpoint's compression state is of %d nodes, this run has %d: error feedback starts "
                        "from zero", saved["errors"].shape[0], nodes)
            return
        self.steps_done = saved["steps_done"]
        self.state.q_memory_dict = {int(i): q.clone() for i, q in saved["q"].items()}
        errors, at = saved["errors"][node_rank], 0
        self.state.error_dict = {}
        if self.steps_done > self.after:
            for index, m in enumerate(self.plan.matrices):
                self.state.error_dict[index] = errors[at : at + m.rows * m.cols].view(m.rows, m.cols).clone()
                at += m.rows * m.cols
