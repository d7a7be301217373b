"""What every node of a run must agree on before any worker starts, compared between the nodes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from .. import __version__
from ..checkpoint.directory import CheckpointDir
from ..node.cluster import Cluster
from ..errors import ConfigError

# Settings beyond the batch's that change the update every node applies: nodes that differ in them
# would drift apart without an error.
AGREED_SETTINGS = ("rewarmup_steps", "compress", "compress_rank", "compress_after")


def node_facts(model: nn.Module, workers: int, total_steps: int, sample_order: dict[str, Any],
               settings: dict[str, Any], resume_from: Path | None) -> dict[str, Any]:
    """This node's side of the agreement: what decides the shards, the batch split, the steps
    trained, the update (``settings``: the learning-rate ramp, the compression between nodes) and
    the state they start from. The model is its parameters' and buffers' names, shapes and
    dtypes, as a count, a size and a digest."""
    entries = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()[:12]
    size = sum(t.numel() for t in model.state_dict().values())
    return {"sn_trainer": __version__, "workers": workers,
            "model": f"{len(entries)} tensors of {size} elements (digest {digest})",
            **{name: value for name, value in sample_order.items()}, "steps": total_steps,
            **settings, "resumes from step": resumed_step(resume_from)}


def resumed_step(resume_from: Path | None) -> int | None:
    """The step the checkpoint ``resume_from`` names (a directory: its latest) was written at."""
    if resume_from is None:
        return None
    held = CheckpointDir(resume_from if resume_from.is_dir() else resume_from.parent).steps()
    if resume_from.is_dir():
        return held[-1][0] if held else None
    return next((step for step, path in held if path.name == resume_from.name), None)


def agree_with_other_nodes(cluster: Cluster, facts: dict[str, Any]) -> None:
    """Every node must bring the same facts: the same sn_trainer, model, workers, batch settings,
    steps and checkpoint to resume from (a folder some node does not see is one it starts afresh).

    Raises:
        ConfigError: names the first node and fact that differ, with both values.
    """
    store = cluster.store("nodes")
    said = json.dumps(facts, sort_keys=True, default=str)
    store.set(f"facts/{cluster.node_rank}", said)
    mine = json.loads(said)  # as the others read it
    for node in range(cluster.nodes):
        theirs = json.loads(store.get(f"facts/{node}"))
        for key, value in mine.items():
            if theirs.get(key) != value:
                raise ConfigError(f"node {node} differs from this node (node {cluster.node_rank}) in {key}: "
                                  f"{theirs.get(key)!r} there, {value!r} here; every node of a run needs the same "
                                  f"{_advice(key)}")


def _advice(key: str) -> str:
    if key == "resumes from step":
        return "checkpoint folder, one all nodes see (checkpoint_dir on shared storage)"
    if key == "workers":
        return "workers=... (set it explicitly rather than auto)"
    if key == "sn_trainer":
        return "sn_trainer version installed"
    return f"{key} (the same command line and code on every node)"
