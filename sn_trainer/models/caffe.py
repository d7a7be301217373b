"""The SingleCaffe paper's networks, as Caffe defines them, plus a plain MLP."""
from __future__ import annotations

import torch
from torch import nn


def _flat_features(features: nn.Module, in_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *in_shape)).numel()


class LeNet(nn.Module):
    """Caffe's MNIST LeNet: conv20 5x5, pool, conv50 5x5, pool, fc500, relu, fc10.

    Like Caffe's, it has no non-linearity after the convolutions. 431k parameters at 28x28.
    """

    def __init__(self, in_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_shape[0], 20, 5), nn.MaxPool2d(2, 2),
            nn.Conv2d(20, 50, 5), nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(_flat_features(self.features, in_shape), 500), nn.ReLU(),
            nn.Linear(500, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class Cifar10Quick(nn.Module):
    """Caffe's cifar10_quick: three 5x5 conv blocks (32, 32, 64) with pooling, fc64, fc10.

    Caffe rounds pooled sizes up, hence ceil_mode. 146k parameters at 32x32.
    """

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_shape[0], 32, 5, padding=2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(),
            nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(_flat_features(self.features, in_shape), 64), nn.Linear(64, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class Cifar10QuickBN(nn.Module):
    """cifar10_quick with batch norm after each convolution (and no conv bias): a batch-norm net of
    the paper's size, for measuring what synchronised batch norm and the layout cost."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_shape[0], 32, 5, padding=2, bias=False), nn.BatchNorm2d(32),
            nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(),
            nn.Conv2d(32, 32, 5, padding=2, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 5, padding=2, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AvgPool2d(3, 2, ceil_mode=True),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(_flat_features(self.features, in_shape), 64), nn.Linear(64, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Flatten, then fully connected layers with ReLU between them."""

    def __init__(self, in_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10,
                 hidden: tuple[int, ...] = (512, 256)):
        super().__init__()
        sizes = [in_shape[0] * in_shape[1] * in_shape[2], *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
