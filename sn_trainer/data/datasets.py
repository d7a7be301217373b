"""Image datasets as uint8 tensors that workers map from shared memory, and the files they come from
(MNIST's IDX, CIFAR-10's batches)."""
from __future__ import annotations

import gzip
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from .folder import ImageFiles

class ImageTensorDataset(Dataset):
    """uint8 images [N, C, H, W] and int64 labels, normalised (and augmented) a batch at a time.

    Items come out as float tensors like torchvision's ToTensor + Normalize would give, so the
    dataset works with any loop; the engine calls ``get_batch`` to gather a whole slice at once.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: list[float], std: list[float],
                 num_classes: int, augment: bool = False, crop_padding: int = 4):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise DataError(f"images must be a uint8 tensor [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise DataError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels.long()
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.num_classes = num_classes
        self.augment, self.crop_padding = augment, crop_padding

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        inputs, targets = self.get_batch(torch.tensor([index]))
        return inputs[0], int(targets[0])

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = self.images[indices]
        if self.augment:
            images = random_crop_flip(images, self.crop_padding)
        return (images.float() - self.mean) / self.std, self.labels[indices]

    def share_memory_(self) -> "ImageTensorDataset":
        self.images.share_memory_()
        self.labels.share_memory_()
        return self


def random_crop_flip(images: torch.Tensor, padding: int) -> torch.Tensor:
    """Per-sample random crop (after zero padding) and horizontal flip, on the whole batch."""
    n, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (n, 1, 1))
    dx = torch.randint(0, 2 * padding + 1, (n, 1, 1))
    rows = dy + torch.arange(h).view(1, h, 1)
    cols = dx + torch.arange(w).view(1, 1, w)
    flip = torch.rand(n, 1, 1) < 0.5
    cols = torch.where(flip, dx + (w - 1 - torch.arange(w)).view(1, 1, w), cols)
    batch = torch.arange(n).view(n, 1, 1)
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


@dataclass
class Splits:
    train: ImageTensorDataset | ImageFiles
    test: ImageTensorDataset | ImageFiles
    sample_shape: tuple[int, int, int]
    num_classes: int
    source: str  # where the data came from, for the log and summary.json


def image_splits(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], num_classes: int,
                 source: str, augment: bool) -> Splits:
    """uint8 images and labels as the train and test ``ImageTensorDataset``, normalised by the
    training images' statistics per channel (exact for any dataset, no table to keep)."""
    scaled = train[0].float().div_(255)
    mean = scaled.mean(dim=(0, 2, 3)).tolist()
    std = scaled.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()
    train_set = ImageTensorDataset(*train, mean, std, num_classes, augment=augment)
    return Splits(train_set, ImageTensorDataset(*test, mean, std, num_classes), train_set.sample_shape, num_classes,
                  source)


# --- MNIST and Fashion-MNIST: IDX files ------------------------------------------------------

def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (MNIST's format), gzipped or not, as a uint8 tensor."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError(f"magic number {data[:4].hex()} is not an IDX uint8 file")
        dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
        expected = 4 + 4 * ndim + int(np.prod(dims))
        if len(data) != expected:
            raise ValueError(f"{len(data)} bytes, expected {expected} for shape {dims}")
    except (OSError, ValueError, struct.error, EOFError) as exc:
        raise DataError(f"{path} is not a readable IDX file ({exc}); re-download or re-install it") from None
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
    return torch.from_numpy(array.copy())



# --- CIFAR-10: torchvision's python pickle batches ---------------------------------------------

class _CifarUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10's batches (dicts of bytes, lists and numpy arrays) and nothing else.

    The format is a pickle, which could carry code; only the numpy names an array needs to be
    rebuilt are allowed, so a doctored file fails to load instead of running anything.
    """

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a CIFAR-10 batch")


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = batch.get(b"labels", batch.get(b"fine_labels"))
        images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
        return images, torch.tensor(labels, dtype=torch.long)
    except (OSError, pickle.UnpicklingError, KeyError, ValueError, EOFError, TypeError, AttributeError) as exc:
        raise DataError(f"{path} is not a readable CIFAR-10 batch ({exc}); re-download it") from None
