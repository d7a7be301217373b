"""Models by name: the paper's Caffe nets, an MLP, a small GPT, and any torchvision classification model."""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from .caffe import MLP, Cifar10Quick, Cifar10QuickBN, LeNet

BUILTIN = {"lenet": LeNet, "cifar10_quick": Cifar10Quick, "cifar10_quick_bn": Cifar10QuickBN, "mlp": MLP}


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
