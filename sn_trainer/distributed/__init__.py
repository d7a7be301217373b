"""A torch.distributed backend named "sn": collectives among the processes of one machine through shared memory.

``import sn_trainer.distributed`` registers it; then ``torch.distributed.init_process_group("sn")``
(or Lightning's ``DDPStrategy(process_group_backend="sn")``) uses it. A program left as it is, on gloo
(Accelerate and transformers accept no other name on CPUs), gets it from the launcher:
``python -m sn_trainer.launch --cpu-backend=sn``.
"""
from __future__ import annotations

import torch.distributed as dist

from .backend import SnBackend, create_sn_group

__all__ = ["SnBackend", "register"]


def register() -> None:
    """Register the "sn" backend with torch.distributed (done on import; calling it again does nothing)."""
    if "sn" not in dist.Backend.backend_list:
        dist.Backend.register_backend("sn", create_sn_group, devices=["cpu"])


register()
