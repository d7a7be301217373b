"""The command line's datasets by name (``dataset=...``): where each one's files are looked for,
how it is downloaded, split and loaded."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data.datasets import Splits, image_splits, read_cifar_batch, read_idx
from ..data.folder import ImageFiles, decode, scan, statistics
from ..data.text import TextSplits, load_text
from ..errors import ConfigError, DataError
from .run_config import DatasetConfig

DEBIAN_ROOTS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}
TORCHVISION_DIRS = {"fashion_mnist": "FashionMNIST", "mnist": "MNIST"}
IDX_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}



def load_datasets(cfg: DatasetConfig) -> Splits | TextSplits:
    """Build the train and test sets that ``cfg`` names.

    Raises:
        ConfigError: an unknown dataset or a bad setting.
        DataError: data not found (the message lists every way to provide it) or malformed.
    """
    loaders = {"fashion_mnist": _load_mnist_like, "mnist": _load_mnist_like, "cifar10": _load_cifar10,
               "synthetic": _load_synthetic, "folder": _load_folder}
    if cfg.name == "text":
        return load_text(cfg.path, cfg.tokenizer, cfg.block_size, cfg.test_fraction)
    if cfg.name not in loaders:
        raise ConfigError(f"unknown dataset {cfg.name!r}; choose one of {', '.join(loaders)}, text")
    if cfg.name == "folder" and not cfg.preload:
        return _folder_files(cfg)
    train, test, num_classes, source = loaders[cfg.name](cfg)
    # crop_flip or none (resized_crop is refused for these by DatasetConfig)
    augment = bool(cfg.augment) if cfg.augment is not None else cfg.name == "cifar10"
    return image_splits(train, test, num_classes, source, augment)


# --- MNIST and Fashion-MNIST: IDX files ------------------------------------------------------

def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    return None


def _idx_directory(cfg: DatasetConfig) -> Path | None:
    candidates = []
    if cfg.root:
        root = Path(cfg.root).expanduser()
        candidates += [root, root / TORCHVISION_DIRS[cfg.name] / "raw"]
    candidates.append(Path(DEBIAN_ROOTS[cfg.name]))
    for directory in candidates:
        if all(_find_idx(directory, stem) for pair in IDX_FILES.values() for stem in pair):
            return directory
    return None


def _load_mnist_like(cfg: DatasetConfig):
    directory = _idx_directory(cfg)
    if directory is None and cfg.download:
        directory = _download_torchvision(cfg)
    if directory is None:
        raise DataError(
            f"{cfg.name} not found. Provide it one of three ways: dataset.root=<dir with the four IDX files> "
            f"(currently {cfg.root!r}); or install Debian's package "
            f"(apt-get install dataset-{cfg.name.replace('_', '-')}, files in {DEBIAN_ROOTS[cfg.name]}); "
            "or add dataset.download=true to let torchvision download it into dataset.root (needs internet)")
    splits = []
    for train in (True, False):
        images_stem, labels_stem = IDX_FILES[train]
        images = read_idx(_find_idx(directory, images_stem))
        labels = read_idx(_find_idx(directory, labels_stem))
        if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
            raise DataError(f"{directory}: {images_stem} has shape {tuple(images.shape)} and {labels_stem} "
                              f"{tuple(labels.shape)}; expected [N, H, W] images and N labels")
        splits.append((images.unsqueeze(1), labels.long()))
    return splits[0], splits[1], 10, str(directory)


def _download_torchvision(cfg: DatasetConfig) -> Path | None:
    import torchvision

    if not cfg.root:
        raise ConfigError("dataset.download=true needs dataset.root=<dir> to download into")
    cls = {"fashion_mnist": torchvision.datasets.FashionMNIST, "mnist": torchvision.datasets.MNIST,
           "cifar10": torchvision.datasets.CIFAR10}[cfg.name]
    try:
        for train in (True, False):
            cls(cfg.root, train=train, download=True)
    except Exception as exc:  # noqa: BLE001 - network errors come in many types
        raise DataError(f"downloading {cfg.name} into {cfg.root} failed: {exc}") from None
    if cfg.name == "cifar10":
        return Path(cfg.root).expanduser()
    return _idx_directory(cfg)


# --- CIFAR-10: torchvision's python pickle batches ---------------------------------------------

CIFAR_DIR = "cifar-10-batches-py"


def _cifar_directory(cfg: DatasetConfig) -> Path | None:
    if not cfg.root:
        return None
    root = Path(cfg.root).expanduser()
    for directory in (root / CIFAR_DIR, root):
        if (directory / "data_batch_1").is_file() and (directory / "test_batch").is_file():
            return directory
    return None


def _load_cifar10(cfg: DatasetConfig):
    directory = _cifar_directory(cfg)
    if directory is None and cfg.download:
        _download_torchvision(cfg)
        directory = _cifar_directory(cfg)
    if directory is None:
        raise DataError(
            f"cifar10 not found under dataset.root={cfg.root!r}: it needs {CIFAR_DIR}/data_batch_1..5 and "
            "test_batch (torchvision's format); set dataset.root to the folder holding them, "
            "or add dataset.download=true to let torchvision download it there (needs internet)")
    parts = [read_cifar_batch(directory / f"data_batch_{i}") for i in range(1, 6)
             if (directory / f"data_batch_{i}").is_file()]
    train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return train, read_cifar_batch(directory / "test_batch"), 10, str(directory)


# --- synthetic and folder ---------------------------------------------------------------------

def _load_synthetic(cfg: DatasetConfig):
    shape, classes = tuple(cfg.shape), cfg.num_classes
    if len(shape) != 3 or min(shape) < 1 or classes < 2:
        raise ConfigError(f"synthetic data needs dataset.shape=[C,H,W] and dataset.num_classes>=2, "
                          f"got {list(shape)} and {classes}")
    generator = torch.Generator().manual_seed(cfg.data_seed)

    def make(n: int):
        return (torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=generator),
                torch.randint(0, classes, (n,), generator=generator))

    return make(cfg.train_size), make(cfg.test_size), classes, f"synthetic {list(shape)}, {classes} classes"


def _folder_root(cfg: DatasetConfig) -> Path:
    if not cfg.root or not Path(cfg.root).expanduser().is_dir():
        raise ConfigError(f"dataset=folder needs dataset.root=<dir of class folders>, got {cfg.root!r}")
    return Path(cfg.root).expanduser()


def _folder_split(cfg: DatasetConfig) -> tuple[tuple[list[str], list[int]], tuple[list[str], list[int]], list[str]]:
    """The training and test files (with labels) of root/train and root/test, or of root split
    by dataset.test_fraction in a seeded order; and the class names."""
    root = _folder_root(cfg)
    if (root / "train").is_dir() and (root / "test").is_dir():
        train_files, train_labels, classes = scan(root / "train")
        test_files, test_labels, _ = scan(root / "test", classes)
        return (train_files, train_labels), (test_files, test_labels), classes
    files, labels, classes = scan(root)
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(cfg.data_seed)).tolist()
    n_test = max(1, int(len(files) * cfg.test_fraction))
    test, train = order[:n_test], order[n_test:]
    return ([files[i] for i in train], [labels[i] for i in train]), \
        ([files[i] for i in test], [labels[i] for i in test]), classes


def _folder_files(cfg: DatasetConfig) -> Splits:
    """Images in class sub-folders, read per sample where they lie (dataset.preload=false)."""
    (train_files, train_labels), (test_files, test_labels), classes = _folder_split(cfg)
    size = cfg.image_size
    mean, std = statistics(train_files, size)
    train = ImageFiles(train_files, train_labels, size, mean, std, len(classes), augment=cfg.augment or False,
                       seed=cfg.data_seed, crop_size=cfg.crop_size)
    # Testing takes no random draw: with resized_crop, the center crop_size of each image, as torchvision's reference.
    test = ImageFiles(test_files, test_labels, size, mean, std, len(classes), crop_size=cfg.crop_size)
    return Splits(train, test, train.sample_shape, len(classes), f"{_folder_root(cfg)} (read per sample)")


def _load_folder(cfg: DatasetConfig):
    """Images in class sub-folders, resized to dataset.image_size and decoded into memory up front
    (dataset.preload=true), as uint8 [N, 3, size, size]."""
    train, test, classes = _folder_split(cfg)

    def read(files: list[str], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        images = np.stack([decode(path, cfg.image_size) for path in files])
        return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)

    return read(*train), read(*test), len(classes), str(_folder_root(cfg))
