"""Where every trainable parameter lives in the one flat buffer, and which worker updates what.

``FlatLayout`` is the single owner of the flat geometry: each parameter's offset, shape and
memory order (channels-last for 4-d weights when asked), the shards the workers update, the
pieces each worker's optimizer sees, and the buckets gloo sends during the backward pass.
Everything else asks it rather than walking the parameters again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# How the optimizer's work is split: equal slices of elements, runs of whole tensors, or the
# whole model in worker 0 (for an optimizer that may look across tensors).
ELEMENTS, TENSORS, FULL = "elements", "tensors", "full"


@dataclass(frozen=True)
class Slot:
    """One trainable parameter's place in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    channels_last: bool  # stored N, H, W, C (viewed as N, C, H, W)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Shard:
    """The range [start, stop) of the flat buffer that one worker updates.

    ``padded_size`` is the equal chunk every worker receives from gloo's reduce-scatter
    (elementwise shards only); the padding is never handed to an optimizer.
    """

    start: int
    stop: int
    padded_size: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one shard: what an optimizer gets as one tensor.

    A whole-tensor piece is shaped like its parameter; an elementwise piece is a 1-d run of
    the parameter's stored elements.
    """

    slot: int
    start: int  # in the flat buffer
    stop: int
    whole: bool

    @property
    def numel(self) -> int:
        return self.stop - self.start


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that train, once each (tied weights appear once), in model order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Names in ``model.state_dict()`` that are another name's tensor (tied weights): alias -> first name."""
    first: dict[int, str] = {}
    found = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            found[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return found


def view(flat: torch.Tensor, offset: int, shape: tuple[int, ...], channels_last: bool) -> torch.Tensor:
    """``flat[offset : offset + numel]`` seen as a tensor of ``shape`` (channels-last stored if asked)."""
    n = 1
    for d in shape:
        n *= d
    if channels_last:
        o, c, h, w = shape
        return flat[offset : offset + n].view(o, h, w, c).permute(0, 3, 1, 2)
    return flat[offset : offset + n].view(shape)


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory, with its shape and strides, that is not a view of it:
    in-place writes to it count on its own version counter only."""
    return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(),
                                                   tensor.stride())


class FlatLayout:
    """The flat buffer's geometry for one model, one worker count and one shard kind."""

    def __init__(self, model: nn.Module, world_size: int, channels_last: bool = False, shards: str = ELEMENTS):
        params = trainable_parameters(model)
        if not params:
            raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
        slots, offset = [], 0
        for name, p in params:
            slots.append(Slot(name, tuple(p.shape), offset, channels_last and p.dim() == 4))
            offset += p.numel()
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.numel = offset
        self.world_size = world_size
        self.channels_last = channels_last
        self.kind = shards
        if shards == ELEMENTS:
            self.shards = _elementwise_shards(self.numel, world_size)
        elif shards == TENSORS:
            self.shards = _whole_tensor_shards(self.slots, world_size)
        else:
            self.shards = [Shard(0, self.numel, 0)] + [Shard(self.numel, self.numel, 0)] * (world_size - 1)
        self.padded_numel = max(self.numel, self.shards[0].padded_size * world_size)

    # --- views -----------------------------------------------------------------------------

    def view(self, flat: torch.Tensor, index: int, base: int = 0) -> torch.Tensor:
        """Parameter ``index`` as a view of ``flat`` (which starts at flat offset ``base``)."""
        slot = self.slots[index]
        return view(flat, slot.offset - base, slot.shape, slot.channels_last)

    def bind(self, model: nn.Module, flat: torch.Tensor, copy_values: bool = False) -> None:
        """Make every trainable parameter a view of ``flat`` (copying its values in first, if asked)."""
        for index, (_, p) in enumerate(self._checked(model)):
            target = self.view(flat, index)
            if copy_values:
                target.copy_(p.detach())
            p.data = target

    def attach_gradients(self, model: nn.Module, grad_flat: torch.Tensor) -> list[torch.Tensor]:
        """Point every parameter's ``.grad`` at its place in ``grad_flat``: backward writes there
        directly. Each is an alias with a version counter of its own (a view shares its base's),
        so that its counter says whether backward added to it; returned, in layout order."""
        grads = []
        for index, (_, p) in enumerate(self._checked(model)):
            grads.append(alias(self.view(grad_flat, index)))
            p.grad = grads[-1]
        return grads

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for _, p in self._checked(model)]

    def _checked(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        params = trainable_parameters(model)
        if [(n, tuple(p.shape)) for n, p in params] != [(s.name, s.shape) for s in self.slots]:
            raise ValueError("the model's trainable parameters differ from the layout it was planned with")
        return params

    # --- memory order <-> each parameter's logical (contiguous) order -------------------------

    def to_logical(self, index: int, stored: torch.Tensor) -> torch.Tensor:
        """A parameter's values in stored (flat) order, as a contiguous tensor of its shape."""
        slot = self.slots[index]
        return view(stored.reshape(-1), 0, slot.shape, slot.channels_last).contiguous()

    def by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter's values in ``flat`` (laid out as this layout lays them), by name, each
        a contiguous tensor of its own shape."""
        return {slot.name: self.to_logical(index, flat[slot.offset : slot.stop]).clone()
                for index, slot in enumerate(self.slots)}

    def to_stored(self, index: int, logical: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_logical``: 1-d, in the order the flat buffer stores it."""
        slot = self.slots[index]
        out = torch.empty(slot.numel, dtype=logical.dtype)
        view(out, 0, slot.shape, slot.channels_last).copy_(logical.reshape(slot.shape))
        return out

    # --- who updates what ------------------------------------------------------------------

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of worker ``rank``'s shard, in flat order."""
        shard = self.shards[rank]
        out = []
        for index, slot in enumerate(self.slots):
            start, stop = max(slot.offset, shard.start), min(slot.stop, shard.stop)
            if start < stop:
                out.append(Piece(index, start, stop, whole=self.kind != ELEMENTS))
        return out

    def max_channels(self) -> int:
        """The widest 1-d parameter (batch norm's weight has one value per channel)."""
        return max((s.numel for s in self.slots if len(s.shape) == 1), default=1)

    def bucket_spans(self, bucket_bytes: int, element_size: int) -> list[tuple[int, int, list[int]]]:
        """Runs of whole parameters from the last to the first (backward's order), each of at least
        ``bucket_bytes`` (but the last run): ``(start, stop, slot indices)``."""
        spans, current, nbytes = [], [], 0
        for index in reversed(range(len(self.slots))):
            current.append(index)
            nbytes += self.slots[index].numel * element_size
            if nbytes >= bucket_bytes or index == 0:
                spans.append((self.slots[current[-1]].offset, self.slots[current[0]].stop, list(current)))
                current, nbytes = [], 0
        return spans


def _elementwise_shards(numel: int, world_size: int) -> list[Shard]:
    """Equal padded chunks: every elementwise optimizer computes on a slice what it would on the whole."""
    padded = -(-numel // world_size)
    return [Shard(min(r * padded, numel), min((r + 1) * padded, numel), padded) for r in range(world_size)]


def _whole_tensor_shards(slots: tuple[Slot, ...], world_size: int) -> list[Shard]:
    """Contiguous runs of whole parameters, the largest run as small as possible.

    Binary search on the largest run's size: greedy packing tells whether a size fits in
    ``world_size`` runs. Workers past the last run get an empty shard.
    """
    sizes = [s.numel for s in slots]

    def pack(capacity: int) -> list[int]:
        cuts, run = [], 0
        for i, n in enumerate(sizes):
            if run and run + n > capacity:
                cuts.append(i)
                run = 0
            run += n
        return cuts

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(pack(mid)) + 1 <= world_size:
            hi = mid
        else:
            lo = mid + 1
    bounds = [0] + [slots[i].offset for i in pack(lo)] + [slots[-1].stop]
    bounds += [bounds[-1]] * (world_size + 1 - len(bounds))
    return [Shard(bounds[r], bounds[r + 1], 0) for r in range(world_size)]
