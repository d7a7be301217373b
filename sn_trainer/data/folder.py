"""A folder of images read where it lies: each sample is read, decoded and augmented when a worker
asks for it, so the set may be larger than memory.

Augmentation (a horizontal flip, and a crop at a random offset of the zero-padded image; or
ImageNet's random resized crop and flip, with a center crop for evaluation) draws from a generator
seeded by (seed, epoch, index), not from the global ones: a sample comes out the same whichever worker
reads it and whenever, so workers may read the next step ahead in a thread (``prefetch``).
"""
from __future__ import annotations

import math
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from .seeded import sample_seed

STATISTICS_SAMPLES = 1024  # images the per-channel mean and std are estimated from, spread over the set


JPEG_MAGIC = b"\xff\xd8\xff"  # every JPEG file starts so, whatever its name says
FIX = "replace the file with a readable image, or remove it from the folder"


def decode(path: str, size: int) -> np.ndarray:
    """An image file as uint8 [size, size, 3] (RGB; resized, antialiased, where it is another size).

    The format is told by the file's first bytes, not its name, as torchvision's ImageFolder
    (Pillow) reads a PNG named ``.jpg``. JPEG files are decoded by torchvision's libjpeg-turbo
    decoder (about half Pillow's time for small images: results/.../folder_bench.md); other
    formats, and JPEG that torchvision does not decode (or no longer can), by Pillow.

    Raises:
        DataError: naming the file, when it cannot be read or neither decoder reads it.
    """
    try:
        with open(path, "rb") as file:
            head = file.read(len(JPEG_MAGIC))
    except OSError as exc:
        raise DataError(f"{path}: cannot read the image file ({exc.strerror or exc}); {FIX}") from None
    image = _decode_jpeg(path) if head == JPEG_MAGIC else None
    if image is None:
        image = _decode_pillow(path)
    if image.shape[:2] != (size, size):
        from torchvision.transforms.v2 import functional as TF

        chw = TF.resize(torch.from_numpy(np.array(image)).permute(2, 0, 1), [size, size],
                        antialias=True)
        image = chw.permute(1, 2, 0).numpy()
    return image


def _decode_jpeg(path: str) -> np.ndarray | None:
    """The JPEG file by torchvision, or None where torchvision cannot (Pillow then tries)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg, read_file
    except ImportError:  # torchvision's decoders are deprecated (0.29) for TorchCodec's
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the fallback above is in place for their removal
        try:
            return decode_jpeg(read_file(path), mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()
        except RuntimeError:  # damaged, or a JPEG variant libjpeg-turbo's build refuses
            return None


def _decode_pillow(path: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as opened:
            return np.asarray(opened.convert("RGB"))
    except Exception as exc:  # noqa: BLE001 - Pillow raises OSError, ValueError, SyntaxError, ... for bad files
        reason = str(exc).replace(f"{path!r}", "").replace(path, "").strip(" :") or type(exc).__name__
        raise DataError(f"{path}: not an image that torchvision or Pillow can decode ({reason}); {FIX}") from None


# torchvision's RandomResizedCrop defaults: the crop's share of the image's area, and its aspect ratio.
CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


class ImageFiles(Dataset):
    """Image files and their labels: items are (float image [3, crop_size, crop_size], label),
    normalised by ``mean`` and ``std`` (per channel, of pixel values in [0, 1]) as ToTensor +
    Normalize give.

    Each image is decoded at ``size`` x ``size``. ``augment``: False, no randomness (a center crop
    of ``crop_size``, default ``size``: the whole image); True or ``"crop_flip"``, a crop at a
    random offset of the zero-padded image, and a flip; ``"resized_crop"``, torchvision's
    RandomResizedCrop to ``crop_size``, and a flip. ``get_batch(indices)`` (what the workers call)
    decodes and augments each image into one uint8 batch and normalises the batch at once.
    """

    def __init__(self, files: list[str], labels: list[int], size: int, mean: list[float], std: list[float],
                 num_classes: int, augment: bool | str | None = False, seed: int = 0, crop_padding: int = 4,
                 crop_size: int | None = None):
        if len(files) != len(labels):
            raise DataError(f"{len(files)} image files but {len(labels)} labels")
        self.files, self.labels, self.size = list(files), torch.tensor(labels, dtype=torch.long), size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.augment = "crop_flip" if augment is True else (augment or None)
        self.crop_size = size if crop_size is None else crop_size
        if self.augment not in (None, "crop_flip", "resized_crop"):
            raise DataError(f"augment must be false, true (crop_flip) or resized_crop, got {augment!r}")
        if self.crop_size > size or (self.augment == "crop_flip" and self.crop_size != size):
            raise DataError(f"crop_size={self.crop_size} cannot be cut from images of {size} by augment={augment}")
        self.num_classes, self.seed, self.crop_padding = num_classes, seed, crop_padding
        self.epoch = 0

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return 3, self.crop_size, self.crop_size

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation the next items get (the trainer calls it)."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        images, labels = self.get_batch(torch.tensor([index]))
        return images[0], int(labels[0])

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = np.zeros((len(indices), self.crop_size, self.crop_size, 3), dtype=np.uint8)
        for slot, index in enumerate(indices.tolist()):
            image = decode(self.files[index], self.size)
            if self.augment == "crop_flip":
                self._crop_flip_into(batch[slot], image, index)
            elif self.augment == "resized_crop":
                batch[slot] = self._resized_crop(image, index)
            else:
                batch[slot] = self._center_crop(image)
        images = torch.from_numpy(batch).permute(0, 3, 1, 2)
        return (images.float() - self.mean) / self.std, self.labels[indices]

    def _sample_seed(self, index: int) -> int:
        """What sample ``index``'s draws in this epoch are seeded with: the same in any worker, at any time."""
        return sample_seed(self.seed, self.epoch, index)

    def _center_crop(self, image: np.ndarray) -> np.ndarray:
        """The middle crop_size x crop_size of ``image``: its top and left margins as torchvision's
        CenterCrop computes them (Python's round of half the margin, where the margin is odd)."""
        top = int(round((self.size - self.crop_size) / 2.0))
        return image[top : top + self.crop_size, top : top + self.crop_size]

    def _resized_crop(self, image: np.ndarray, index: int) -> np.ndarray:
        """``image``'s random box resized to crop_size (bilinear, antialiased), then flipped with
        probability 1/2: torchvision's RandomResizedCrop and RandomHorizontalFlip, drawn from a
        generator seeded by (seed, epoch, index) (torchvision's transforms draw from the global
        one, and take no generator)."""
        from torchvision.transforms.v2 import functional as TF

        draw = torch.Generator().manual_seed(self._sample_seed(index))
        top, left, height, width = resized_crop_box(self.size, self.size, draw)
        writable = np.require(image, requirements="W")  # Pillow's arrays are read-only; torch wants to own one
        chw = TF.resized_crop(torch.from_numpy(writable).permute(2, 0, 1), top, left, height, width,
                              [self.crop_size, self.crop_size], antialias=True)
        if torch.rand(1, generator=draw).item() < 0.5:
            chw = TF.horizontal_flip(chw)
        return chw.permute(1, 2, 0).numpy()

    def _crop_flip_into(self, out: np.ndarray, image: np.ndarray, index: int) -> None:
        """``image`` flipped (or not), zero-padded and cropped back to its size at a random offset,
        written into ``out`` (zeros): the offsets and the flip depend on (seed, epoch, index) only."""
        draw = random.Random(self._sample_seed(index))
        pad, size = self.crop_padding, self.size
        dy, dx = draw.randint(-pad, pad), draw.randint(-pad, pad)  # where the crop starts, in the image
        if draw.random() < 0.5:
            image = image[:, ::-1]
        out[max(0, -dy) : size - max(0, dy), max(0, -dx) : size - max(0, dx)] = \
            image[max(0, dy) : size + min(0, dy), max(0, dx) : size + min(0, dx)]


def resized_crop_box(height: int, width: int, draw: torch.Generator) -> tuple[int, int, int, int]:
    """(top, left, box height, box width) of a random box of an image of ``height`` x ``width``,
    by the algorithm torchvision documents for RandomResizedCrop: up to ten tries of an area share
    in CROP_SCALE and a log-uniform aspect ratio in CROP_RATIO, the first box that fits placed
    uniformly; else the largest centred box within the ratios. Each draw is torchvision's kind, in
    its order and precision (float32 uniforms, then integer positions), so that a transform seeded
    alike draws the same box."""
    area = height * width
    low, high = torch.log(torch.tensor(CROP_RATIO)).tolist()  # float32, as torchvision keeps its bounds
    for _ in range(10):
        target = area * torch.empty(1).uniform_(CROP_SCALE[0], CROP_SCALE[1], generator=draw).item()
        aspect = torch.exp(torch.empty(1).uniform_(low, high, generator=draw)).item()
        box_width, box_height = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < box_width <= width and 0 < box_height <= height:
            top = int(torch.randint(0, height - box_height + 1, (1,), generator=draw).item())
            left = int(torch.randint(0, width - box_width + 1, (1,), generator=draw).item())
            return top, left, box_height, box_width
    ratio = width / height
    if ratio < min(CROP_RATIO):
        box_width, box_height = width, int(round(width / min(CROP_RATIO)))
    elif ratio > max(CROP_RATIO):
        box_width, box_height = int(round(height * max(CROP_RATIO))), height
    else:
        box_width, box_height = width, height
    return (height - box_height) // 2, (width - box_width) // 2, box_height, box_width


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
    images = torch.from_numpy(np.stack([decode(files[int(i)], size) for i in picked])).float().div_(255)
    return images.mean(dim=(0, 1, 2)).tolist(), images.std(dim=(0, 1, 2)).clamp_min(1e-6).tolist()
