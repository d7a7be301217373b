"""Parameters held once in shared memory for a run, and given back as private memory after it; and
where a tensor's pages lie."""
from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from ...recipe.flat_layout import FlatLayout


class SharedParams:
    """All trainable parameters of a model as views of ONE flat shared-memory tensor.

    Created in the launching process from the caller's model, whose parameters are re-pointed
    at the flat tensor so that sending the model to a worker sends a handle, not a copy.
    Buffers (e.g. batch-norm statistics) and frozen parameters are moved to shared memory in
    place: a frozen parameter is one tensor for all workers (what a step writes into it in place,
    such as a recurrent state it carries, every worker and the checkpoint see).
    """

    def __init__(self, model: nn.Module, layout: FlatLayout, ema: bool = False,
                 ema_values: dict[str, torch.Tensor] | None = None):
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
        for p in model.parameters():
            if not p.requires_grad:
                p.share_memory_()
        # The moving average of the parameters, laid out as they are (each worker averages its shard):
        # from the parameters themselves, or from where a checkpoint left it.
        self.ema = self.flat.clone().share_memory_() if ema else None
        if self.ema is not None and ema_values is not None:
            for index, slot in enumerate(layout.slots):
                layout.view(self.ema, index).copy_(ema_values[slot.name])

    def ema_state_dict(self, model: nn.Module, layout: FlatLayout) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with the averaged parameters (and the model's own buffers)."""
        layout.bind(model, self.ema)
        try:
            return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in model.state_dict().items()}
        finally:
            layout.bind(model, self.flat)

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


def buffer_count(model: nn.Module) -> int:
    """How many buffers ``ReplicaBuffers`` links for ``model``."""
    return sum(1 for module in model.modules() for buf in module._buffers.values() if buf is not None)


class ReplicaBuffers:
    """A replica's buffers (batch-norm statistics, running normalisers...) against the shared ones.

    Worker 0 computes in the shared buffers themselves; every other worker computes in private
    copies and, after every step, adopts the values worker 0 left, as DDP's buffers follow rank
    0 (running statistics updated by several processes at once would race). Worker 0 says which
    buffers its step changed (``changed``), so that a buffer nobody writes (a causal mask) is
    never copied; the others also take back any they changed themselves.
    """

    def __init__(self, model: nn.Module, rank: int):
        self.links: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []  # module, name, shared, own
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    own = buf if rank == 0 else buf.clone()
                    module._buffers[name] = own
                    self.links.append((module, name, buf, own))
        self._versions = [own._version for *_, own in self.links]

    def _moved(self) -> list[int]:
        """The buffers this replica's forward passes changed since last asked: written in place,
        or replaced (``self.mean = ...``), whose new value is then copied into its own tensor."""
        moved = []
        for index, (module, name, _, own) in enumerate(self.links):
            current = module._buffers[name]
            if current is not own:
                with torch.no_grad():
                    own.copy_(current)
                module._buffers[name] = own
            if own._version != self._versions[index]:
                moved.append(index)
        return moved

    def _seen(self) -> None:
        self._versions = [own._version for *_, own in self.links]

    def changed(self) -> np.ndarray:
        """Worker 0, after its forward passes: a 0/1 flag per buffer its step changed."""
        flags = np.zeros(len(self.links))
        if self.links:  # a model without buffers pays nothing here
            moved = self._moved()
            if moved:
                flags[moved] = 1.0
            self._seen()
        return flags

    def adopt(self, indices=None) -> None:
        """Any other worker: take worker 0's values of ``indices`` (default: all) and of any
        buffer this replica changed itself."""
        wanted = range(len(self.links)) if indices is None else sorted(set(indices) | set(self._moved()))
        with torch.no_grad():
            for index in wanted:
                _, _, shared, own = self.links[index]
                own.copy_(shared)
        self._seen()


def resident_pages_by_node(tensor: torch.Tensor, numa_maps: str = "/proc/self/numa_maps") -> dict[int, int]:
    """How many pages of the mapping that holds ``tensor`` are resident in this process, by NUMA
    node (``N<node>=<pages>`` in /proc/self/numa_maps); empty where none is."""
    address, found = tensor.data_ptr(), None
    with open(numa_maps) as lines:
        for line in lines:
            start = int(line.split(" ", 1)[0], 16)
            if start <= address and (found is None or start > found[0]):
                found = (start, line)
    if found is None:
        return {}
    return {int(node): int(pages) for node, pages in re.findall(r"\bN(\d+)=(\d+)", found[1])}
