"""Parameters held once in shared memory for a run, and given back as private memory after it."""
from __future__ import annotations

import torch
from torch import nn

from .layout import FlatLayout


class SharedParams:
    """All trainable parameters of a model as views of ONE flat shared-memory tensor.

    Created in the launching process from the caller's model, whose parameters are re-pointed
    at the flat tensor so that sending the model to a worker sends a handle, not a copy.
    Buffers (e.g. batch-norm statistics) are moved to shared memory in place.
    """

    def __init__(self, model: nn.Module, layout: FlatLayout):
        params = layout.parameters(model)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"all trainable parameters must share one floating dtype, found {sorted(map(str, dtypes))}; "
                "convert the model with model.float() (or .double()) first"
            )
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("sn_trainer trains on the CPU: move the model there with model.cpu() first")
        self.flat = torch.zeros(layout.padded_numel, dtype=params[0].dtype).share_memory_()
        layout.bind(model, self.flat, copy_values=True)
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
