"""Optimizer state between shards and parameters: gathered for a checkpoint, scattered to resume.

Each worker's optimizer holds pieces of parameters (``FlatLayout.pieces``). A checkpoint keeps
the state per parameter name, in each parameter's own shape, exactly as one process's optimizer
would hold it; so a run may resume with another worker count, shard kind or memory layout.
This module knows tensors and plain data only; ``checkpoint.py`` knows the file.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...recipe.flat_layout import FlatLayout, Piece


def optimizer_pieces(layout: FlatLayout, rank: int, slot_groups: Sequence[int | None]) -> list[Piece]:
    """Worker ``rank``'s pieces in the order its optimizer numbers them: by group, then flat order.

    Parameters in no group (``None``) are not trained, as in torch.optim.
    """
    pieces = [p for p in layout.pieces(rank) if slot_groups[p.slot] is not None]
    return sorted(pieces, key=lambda p: slot_groups[p.slot])


def group_params(tensors: Sequence[torch.Tensor], slots: Sequence[int], group_options: list[dict[str, Any]] | None,
                 slot_groups: Sequence[int | None]) -> list:
    """What an optimizer factory is called with: the tensors (of layout ``slots``), in their groups.

    Without groups, a plain list of those in a group (0), as ``model.parameters()`` would give;
    with groups, every group in order (empty ones too, so that schedulers see them all), each
    with its options.
    """
    if group_options is None:
        return [tensor for tensor, slot in zip(tensors, slots) if slot_groups[slot] is not None]
    groups = [{"params": [], **options} for options in group_options]
    for tensor, slot in zip(tensors, slots):
        if slot_groups[slot] is not None:
            groups[slot_groups[slot]]["params"].append(tensor)
    return groups


def gather(parts: list[dict[str, Any] | None], layout: FlatLayout, slot_groups: Sequence[int | None]) -> dict[str, Any]:
    """One optimizer state from every worker's ``optimizer.state_dict()`` (None: no optimizer).

    Returns:
        ``{"param_groups": [options..., "params": [names]], "state": {name: {key: value}},
        "per_element": {name: [keys]}}``: per-element tensors in their parameter's shape, the
        others (step counts, factored moments) as the optimizer holds them.
    """
    found: dict[int, list[tuple[Piece, dict[str, Any]]]] = {}
    groups = None
    for rank, part in enumerate(parts):
        if part is None:
            continue
        groups = groups or part["param_groups"]
        for number, piece in enumerate(optimizer_pieces(layout, rank, slot_groups)):
            if number in part["state"]:
                found.setdefault(piece.slot, []).append((piece, part["state"][number]))
    state, per_element = {}, {}
    for index, held in sorted(found.items()):
        held.sort(key=lambda item: item[0].start)
        slot = layout.slots[index]
        whole, elementwise = {}, []
        for key, first in held[0][1].items():
            values = [s[key] for _, s in held]
            if held[0][0].whole:
                if isinstance(first, torch.Tensor) and tuple(first.shape) == slot.shape:
                    elementwise.append(key)
                whole[key] = first.clone(memory_format=torch.contiguous_format) if isinstance(first, torch.Tensor) \
                    else first
            elif isinstance(first, torch.Tensor) and first.dim() == 1 \
                    and all(v.numel() == p.numel for v, (p, _) in zip(values, held)):
                elementwise.append(key)
                whole[key] = layout.to_logical(index, torch.cat(values)).clone()
            else:
                whole[key] = first.clone() if isinstance(first, torch.Tensor) else first
        state[slot.name], per_element[slot.name] = whole, elementwise
    names = [[] for _ in groups or []]
    for index, group in enumerate(slot_groups):
        if group is not None:
            names[group].append(layout.slots[index].name)
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names[i]}
                    for i, g in enumerate(groups or [])]
    return {"param_groups": param_groups, "state": state, "per_element": per_element}


def scatter(saved: dict[str, Any], layout: FlatLayout, rank: int, slot_groups: Sequence[int | None]) -> dict[int, Any]:
    """Worker ``rank``'s share of a gathered optimizer state, numbered as its optimizer numbers pieces.

    Only the state comes from the checkpoint: the run's own options (learning rates, weight
    decay...) stay as this run sets them.
    """
    out = {}
    for number, piece in enumerate(optimizer_pieces(layout, rank, slot_groups)):
        slot = layout.slots[piece.slot]
        held = saved["state"].get(slot.name)
        if held is None:
            continue  # never stepped: no state, as in torch.optim
        elementwise = saved["per_element"].get(slot.name, ())
        mine = {}
        for key, value in held.items():
            if key in elementwise and not piece.whole:
                stored = layout.to_stored(piece.slot, value)
                mine[key] = stored[piece.start - slot.offset : piece.stop - slot.offset].clone()
            elif isinstance(value, torch.Tensor):
                mine[key] = value.clone()
            else:
                mine[key] = value
        out[number] = mine
    return out
