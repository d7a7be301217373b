"""Models by name: the paper's Caffe nets, an MLP, a small GPT, and any torchvision classification model."""
from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .caffe import MLP, Cifar10Quick, Cifar10QuickBN, LeNet
from .gpt import GPT, decay_groups, language_model_step

BUILTIN = {"lenet": LeNet, "cifar10_quick": Cifar10Quick, "cifar10_quick_bn": Cifar10QuickBN, "mlp": MLP}


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
    return name not in BUILTIN and name != "gpt"


def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, in_shape: tuple[int, int, int], num_classes: int, **options) -> nn.Module:
    """Build ``name`` for inputs of ``in_shape`` (C, H, W) and ``num_classes`` outputs.

    Raises:
        ConfigError: unknown name; the message lists the valid ones.
    """
    if name in BUILTIN:
        return BUILTIN[name](in_shape=in_shape, num_classes=num_classes, **options)
    names = torchvision_names()
    if name not in names:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(BUILTIN)} "
                          f"or a torchvision classification model ({', '.join(names[:8])}, ...)")
    return _torchvision_model(name, in_shape, num_classes, **options)


def _torchvision_model(name: str, in_shape: tuple[int, int, int], num_classes: int, **options) -> nn.Module:
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **options)
    if in_shape[0] != 3:
        _adapt_first_conv(model, in_shape[0])
    return model


def _adapt_first_conv(model: nn.Module, channels: int) -> None:
    """Replace the first convolution by one taking ``channels`` inputs, same geometry otherwise."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, child_name, nn.Conv2d(
                    channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, child.bias is not None, child.padding_mode))
                return
    raise ConfigError("cannot adapt this torchvision model to the dataset's channels: it has no Conv2d")
