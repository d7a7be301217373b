"""Which nodes and workers a run trained with, step by step: the first, then each change, carried on by checkpoints."""
from __future__ import annotations

from typing import Any

from ..engine.plan import Placement

Membership = tuple[tuple[int, int, int], ...]  # (step, nodes, workers in all)


def continued(saved: list[dict[str, Any]], step: int, placement: Placement) -> Membership:
    """The membership a launch from ``step`` trains under: the checkpoint's list (``saved``, empty
    when starting afresh), with an entry for this launch's nodes and workers where they differ
    from its last."""
    held = tuple((int(e["step"]), int(e["nodes"]), int(e["workers"])) for e in saved)
    now = (step, placement.nodes, placement.global_workers)
    if held and held[-1][1:] == now[1:]:
        return held
    return (*held, now)


def as_records(membership: Membership) -> list[dict[str, int]]:
    """The list summary.json and checkpoints hold: ``{step, nodes, workers}`` each."""
    return [{"step": step, "nodes": nodes, "workers": workers} for step, nodes, workers in membership]
