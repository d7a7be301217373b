"""Every setting's default as Hydra composes it: a node of Hydra's config store built from the
dataclasses (``TrainerConfig`` and the command line's own, through ``option_rows``), so that
``conf/config.yaml`` holds only its defaults list and Hydra's own settings, and no default is
written twice. Registered on import, before Hydra composes anything."""
from __future__ import annotations

import copy
from typing import Any

from hydra.core.config_store import ConfigStore

from .run_config import CLI_DEFAULTS, RunConfig, option_rows

NAME = "sn_trainer_settings"  # as conf/config.yaml's defaults list names it


def settings_node() -> dict[str, Any]:
    """The top-level settings and the groups without options of their own (``checkpoint.*``,
    ``bench.*``), with the command line's defaults. The groups chosen by option (``model``,
    ``dataset``, ``optim``) are left to their options' YAML files: each lists the keys that option
    reads, and what it omits is refused, not defaulted."""
    chosen = tuple(f"{group}." for group in RunConfig.SECTIONS if group != "bench")
    node: dict[str, Any] = {}
    for key, default, _ in option_rows():
        if key.startswith(chosen):
            continue
        *groups, name = key.split(".")
        place = node
        for group in groups:
            place = place.setdefault(group, {})
        place[name] = CLI_DEFAULTS[key][1] if key in CLI_DEFAULTS else copy.deepcopy(default)
    return node


ConfigStore.instance().store(name=NAME, node=settings_node())
