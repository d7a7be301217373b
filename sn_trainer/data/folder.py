"""A folder of images read where it lies: each sample is read, decoded and augmented when a worker
asks for it, so the set may be larger than memory.

Augmentation (a random crop after zero padding, a horizontal flip) draws from a generator seeded
by (seed, epoch, index), not from the global ones: a sample comes out the same whichever worker
reads it and whenever, so workers may read the next step ahead in a thread (``prefetch``).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from ..errors import DataError

STATISTICS_SAMPLES = 1024  # images the per-channel mean and std are estimated from, spread over the set


def decode(path: str, size: int) -> torch.Tensor:
    """An image file as uint8 [3, size, size] (RGB; resized, antialiased, where it is another size),
    decoded by Pillow as torchvision's ImageFolder decodes it."""
    from PIL import Image
    from torchvision.transforms.v2 import functional as TF

    with Image.open(path) as opened:
        image = TF.pil_to_tensor(opened.convert("RGB"))
    if tuple(image.shape[1:]) != (size, size):
        image = TF.resize(image, [size, size], antialias=True)
    return image


class ImageFiles(Dataset):
    """Image files and their labels: items are (float image [3, size, size], label), normalised by
    ``mean`` and ``std`` (per channel, of pixel values in [0, 1]) as ToTensor + Normalize give."""

    def __init__(self, files: list[str], labels: list[int], size: int, mean: list[float], std: list[float],
                 num_classes: int, augment: bool = False, seed: int = 0, crop_padding: int = 4):
        if len(files) != len(labels):
            raise DataError(f"{len(files)} image files but {len(labels)} labels")
        self.files, self.labels, self.size = list(files), list(labels), size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1) * 255
        self.num_classes, self.augment, self.seed, self.crop_padding = num_classes, augment, seed, crop_padding
        self.epoch = 0

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return 3, self.size, self.size

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation the next items get (the trainer calls it)."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            image = decode(self.files[index], self.size)
        except (OSError, RuntimeError) as exc:
            raise DataError(f"{self.files[index]}: cannot read the image ({exc})") from None
        if self.augment:
            image = self._crop_flip(image, index)
        return (image.float() - self.mean) / self.std, self.labels[index]

    def _crop_flip(self, image: torch.Tensor, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index) % 2**63)
        pad, size = self.crop_padding, self.size
        dy, dx, flip = torch.randint(0, 2 * pad + 1, (3,), generator=generator).tolist()
        image = F.pad(image, (pad,) * 4)[:, dy : dy + size, dx : dx + size]
        return image.flip(-1) if flip % 2 else image


def scan(directory: Path, classes: list[str] | None = None) -> tuple[list[str], list[int], list[str]]:
    """The image files under ``directory``'s class folders (sorted, as torchvision's ImageFolder
    finds them), their labels, and the class names."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        found, class_to_idx = find_classes(str(directory))
        samples = make_dataset(str(directory), class_to_idx, extensions=IMG_EXTENSIONS)
    except (FileNotFoundError, OSError) as exc:
        raise DataError(f"{directory}: {exc}") from None
    if classes is not None and found != classes:
        raise DataError(f"{directory} has classes {found}, the training folder {classes}")
    if not samples:
        raise DataError(f"{directory} holds no images")
    return [path for path, _ in samples], [label for _, label in samples], found


def statistics(files: list[str], size: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of pixel values in [0, 1], over up to STATISTICS_SAMPLES images
    spread over ``files``."""
    picked = torch.linspace(0, len(files) - 1, min(STATISTICS_SAMPLES, len(files))).round().long().unique()
    images = torch.stack([decode(files[int(i)], size) for i in picked]).float().div_(255)
    return images.mean(dim=(0, 2, 3)).tolist(), images.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()
