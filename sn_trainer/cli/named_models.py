"""The command line's models by name (``model=...``), sized for the data, with what each trains with."""
from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from ..errors import ConfigError
from ..models import BUILTIN, build_model
from ..models.gpt import GPT, decay_groups, language_model_step
from .run_config import ModelConfig


def build_for(cfg: ModelConfig, data) -> nn.Module:
    """The model ``cfg`` names, sized for ``data`` (image splits, or text splits for model=gpt).

    Raises:
        ConfigError: the model and the dataset do not go together, or an unknown name.
    """
    text = hasattr(data, "vocab_size")
    if cfg.name == "gpt" or text:
        if not (cfg.name == "gpt" and text):
            raise ConfigError("model=gpt trains on dataset=text, and dataset=text trains model=gpt; "
                              f"got model={cfg.name} with a{' text' if text else 'n image'} dataset; for a language model "
                              "use +experiment=gpt_text dataset.path=<text file or folder>")
        return GPT(data.vocab_size, data.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.bias)
    return build_model(cfg.name, data.sample_shape, data.num_classes,
                       **({"hidden": tuple(cfg.hidden)} if cfg.hidden else {}))


def training_parts(cfg: ModelConfig, weight_decay: float) -> tuple[Callable | None, Callable | None]:
    """What a model needs beyond (inputs, targets) and cross-entropy: its step and parameter groups."""
    if cfg.name == "gpt":
        return language_model_step, functools.partial(decay_groups, weight_decay=weight_decay)
    return None, None


def uses_torchvision(name: str) -> bool:
    """Whether model=``name`` is one of torchvision's."""
    return name not in BUILTIN and name != "gpt"
