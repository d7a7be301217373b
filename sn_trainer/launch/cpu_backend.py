"""``--cpu-backend=sn``: in a rank, every process group the program makes over gloo on CPU (named, or
torch's default where no accelerator is) is made on "sn" instead, the program left unchanged.

Frameworks refuse any name but gloo on CPU (Accelerate, and transformers through it), so the name
cannot be changed where they take it; it is changed where every group is made: torch's
``distributed_c10d._new_process_group_helper``, which ``init_process_group``, ``new_group``,
``new_subgroups`` and DeviceMesh all call with the backend they resolved (torch 2.14.1).
"""
from __future__ import annotations

import functools
import inspect
import sys

CHOICES = ("sn",)  # what --cpu-backend takes; absent: each group's backend is the program's choice


def on_sn(backend: str) -> str:
    """``backend`` (a name, ``cpu:x,cuda:y``, or torch's ``undefined``) with its CPU part on "sn"
    where torch would have put gloo; anything else as it is.

    A bare "gloo" covers CPU and CUDA tensors; where no accelerator is available its CUDA part
    could never run, and it is dropped rather than kept as a second, idle gloo group.
    """
    import torch
    from torch.distributed.distributed_c10d import BackendConfig

    devices = dict(BackendConfig(backend).get_device_backend_map())
    if str(devices.get("cpu", "")).lower() != "gloo":
        return backend
    devices["cpu"] = "sn"
    if ":" not in str(backend):  # named alone: torch's own expansion, kept to the devices that can run
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        devices = {d: b for d, b in devices.items() if d == "cpu" or (accelerator and d == accelerator.type)}
    if list(devices) == ["cpu"]:
        return "sn"
    return ",".join(f"{device}:{name}" for device, name in devices.items())


def redirect(say) -> None:
    """Make this process's CPU gloo groups on "sn"; ``say(asked, made)`` is called at the first one.

    Registers "sn" (importing its module) first.
    """
    import torch.distributed.distributed_c10d as c10d

    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    make = c10d._new_process_group_helper
    if getattr(make, "redirected", False):
        return
    signature = inspect.signature(make)
    told = []

    @functools.wraps(make)
    def made_on_sn(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        asked = bound.arguments["backend"]
        made = on_sn(asked)
        if made != asked:
            bound.arguments["backend"] = made
            if not told:
                told.append(asked)
                say(asked, made)
        return make(*bound.args, **bound.kwargs)

    made_on_sn.redirected = True
    c10d._new_process_group_helper = made_on_sn


def announce(local_rank: int):
    """What a rank says at its first redirected group: local rank 0 once per node, on stderr."""

    def say(asked, made) -> None:
        if local_rank == 0:
            what = "torch's default (gloo on CPU)" if str(asked) == "undefined" else f'"{asked}"'
            print(f'sn_trainer.launch: the process group asked for {what} is made on "{made}" '
                  f"(--cpu-backend=sn), and so is every CPU gloo group after it", file=sys.stderr, flush=True)

    return say
