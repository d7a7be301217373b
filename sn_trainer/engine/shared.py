"""Parameters held once in shared memory, and each worker's shard of them for the optimizer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shard:
    """The slice [start, stop) of the flat parameters that one worker updates.

    ``padded_size`` is the equal chunk every worker receives from a reduce-scatter; the last
    shard's tail beyond the real parameters is padding and is never handed to the optimizer.
    """

    start: int
    stop: int
    padded_size: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def shard_bounds(numel: int, world_size: int) -> list[Shard]:
    """Split ``numel`` parameters into ``world_size`` equal padded chunks."""
    padded = -(-numel // world_size)  # ceil division
    return [
        Shard(start=min(r * padded, numel), stop=min((r + 1) * padded, numel), padded_size=padded)
        for r in range(world_size)
    ]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def param_view(flat: torch.Tensor, offset: int, shape: torch.Size, channels_last: bool) -> torch.Tensor:
    """The slice of ``flat`` holding one parameter, shaped like it.

    With ``channels_last``, 4-d weights are laid out N, H, W, C in memory (and viewed as
    N, C, H, W), so convolutions run in oneDNN's preferred format while staying views of flat.
    """
    n = shape.numel()
    if channels_last and len(shape) == 4:
        o, c, h, w = shape
        return flat[offset : offset + n].view(o, h, w, c).permute(0, 3, 1, 2)
    return flat[offset : offset + n].view(shape)


class FlatOrder:
    """Converts full-length per-element tensors (optimizer state) between the flat buffer's
    order and the contiguous order of every parameter, which checkpoints use.

    The two differ only for 4-d weights under channels_last; keeping checkpoints in contiguous
    order lets a run resume with the other layout.
    """

    def __init__(self, model: nn.Module, channels_last: bool):
        self.shapes = [p.shape for p in trainable_parameters(model)]
        self.channels_last = channels_last

    def to_contiguous(self, flat_ordered: torch.Tensor) -> torch.Tensor:
        return self._convert(flat_ordered, to_contiguous=True)

    def to_flat(self, contiguous: torch.Tensor) -> torch.Tensor:
        return self._convert(contiguous, to_contiguous=False)

    def _convert(self, values: torch.Tensor, to_contiguous: bool) -> torch.Tensor:
        if not self.channels_last or not any(len(shape) == 4 for shape in self.shapes):
            return values
        out, offset = torch.empty_like(values), 0
        for shape in self.shapes:
            n = shape.numel()
            if to_contiguous:
                out[offset : offset + n].view(shape).copy_(param_view(values, offset, shape, True))
            else:
                param_view(out, offset, shape, True).copy_(values[offset : offset + n].view(shape))
            offset += n
        return out


def bind_parameters(model: nn.Module, flat: torch.Tensor, channels_last: bool, copy_values: bool = False) -> None:
    """Make every trainable parameter a view of ``flat``, in model order.

    In the launcher, ``copy_values`` first copies each parameter's values into its slice. In a
    worker, the unpickled model normally arrives bound already; binding again makes the
    layout a checked fact instead of a property of how tensors happen to be pickled.
    """
    offset = 0
    for p in trainable_parameters(model):
        view = param_view(flat, offset, p.shape, channels_last)
        if copy_values:
            view.copy_(p.detach())
        p.data = view
        offset += p.numel()


class SharedParams:
    """All trainable parameters of a model as views of ONE flat shared-memory tensor.

    Created in the launching process from the caller's model, whose parameters are re-pointed
    at the flat tensor so that sending the model to a worker sends a handle, not a copy.
    Buffers (e.g. batch-norm statistics) are moved to shared memory in place.
    """

    def __init__(self, model: nn.Module, world_size: int, channels_last: bool = False):
        params = trainable_parameters(model)
        if not params:
            raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"all trainable parameters must share one floating dtype, found {sorted(map(str, dtypes))}; "
                "convert the model with model.float() first"
            )
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("sn_trainer trains on the CPU: move the model there with model.cpu() first")
        self.numel = sum(p.numel() for p in params)
        self.shards = shard_bounds(self.numel, world_size)
        padded_total = self.shards[0].padded_size * world_size
        self.flat = torch.zeros(padded_total, dtype=params[0].dtype).share_memory_()
        bind_parameters(model, self.flat, channels_last, copy_values=True)
        for buf in model.buffers():
            buf.share_memory_()

    @staticmethod
    def release(model: nn.Module) -> None:
        """Give the caller's model private copies again, so no shared memory outlives the run."""
        for p in model.parameters():
            if p.is_shared():
                p.data = p.data.clone(memory_format=torch.contiguous_format)
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_shared():
                    module._buffers[name] = buf.clone()


def private_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Give this replica private copies of its buffers; return (module, name, shared) triples.

    Only rank 0 writes the shared buffers (like DDP, whose buffers follow rank 0): running
    statistics updated by several processes at once would race. Others refresh their copy
    from the shared one before evaluating.
    """
    links = []
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.clone()
                links.append((module, name, buf))
    return links


def refresh_buffers(links: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for module, name, shared in links:
        module._buffers[name].copy_(shared)


def attach_gradients(model: nn.Module, grad_flat: torch.Tensor, channels_last: bool) -> None:
    """Point every parameter's ``.grad`` at its slice of one flat buffer, laid out like it.

    Autograd then accumulates straight into ``grad_flat``, which is what gets reduced, so the
    step needs no gather of gradients and no allocation.
    """
    offset = 0
    for p in trainable_parameters(model):
        p.grad = param_view(grad_flat, offset, p.shape, channels_last)
        offset += p.numel()


def shard_parameter(flat: torch.Tensor, shard: Shard) -> nn.Parameter | None:
    """This worker's slice of the shared parameters, as the one tensor its optimizer owns.

    Every elementwise optimizer (SGD, Adam, AdamW, RMSprop...) computes on a slice exactly
    what it would compute on the whole, so sharding changes nothing but where state lives.
    """
    if shard.size == 0:
        return None
    return nn.Parameter(flat[shard.start : shard.stop], requires_grad=True)
