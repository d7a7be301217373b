"""Data at the disk's bandwidth, the pipeline checklist's first item: for a run of dataset=folder or
dataset=text, the raw read speed of its files (cold, the page cache dropped for them where the
kernel lets it, and warm), the decode + augmentation cost per sample, against the run's compute
per sample: which of the three bounds the run."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..errors import InputError
from .findings import Finding, not_visible
from .run import RunFacts

SAMPLE_FILES = 256  # files read to time the disk, spread over the set
SAMPLE_ITEMS = 128  # samples decoded to time decode + augmentation


def data_findings(facts: RunFacts, files: int = SAMPLE_FILES, items: int = SAMPLE_ITEMS) -> list[Finding]:
    """What bounds the run's data: the disk, decoding, or its compute (one finding each, and the verdict)."""
    dataset = facts.config.get("dataset") or {}
    name = dataset.get("name")
    if name not in ("folder", "text"):
        return [not_visible("data bandwidth", f"measured for dataset=folder and dataset=text; this run's is "
                                              f"{name or 'not recorded'}")]
    try:
        return _measure(facts, dataset, name, files, items)
    except (InputError, OSError) as exc:
        return [not_visible("data bandwidth", f"its files cannot be read here: {exc}")]


def _measure(facts: RunFacts, dataset: dict, name: str, files: int, items: int) -> list[Finding]:
    paths, decode = _folder(dataset) if name == "folder" else _text(dataset)
    picked = [paths[int(i)] for i in torch.linspace(0, len(paths) - 1, min(files, len(paths))).round().long().unique()]
    cold, dropped = read_seconds(picked, drop=True)
    warm, _ = read_seconds(picked, drop=False)
    size = sum(os.path.getsize(p) for p in picked)
    per_file = size / len(picked)
    decode_ms = 1000 * decode(items)
    how = "cold" if dropped else "warm (the page cache could not be dropped)"
    found = [Finding("disk read", f"{size / 2**20 / cold:.0f} MB/s {how}, {size / 2**20 / warm:.0f} MB/s warm, over "
                     f"{len(picked)} files of {per_file / 1024:.1f} KiB on average")]
    found.append(Finding("decode + augmentation" if name == "folder" else "token windows",
                         f"{decode_ms:.3g} ms per sample in one process"))
    found.append(_verdict(facts, 1000 * cold / len(picked) if name == "folder" else None, decode_ms, dataset))
    return found


def read_seconds(paths: list[str], drop: bool) -> tuple[float, bool]:
    """Seconds to read ``paths`` whole; with ``drop``, each file's cached pages are dropped first
    (posix_fadvise DONTNEED: clean pages only, no root needed). Returns whether dropping was possible."""
    dropped = drop and hasattr(os, "posix_fadvise")
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if dropped:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    dropped = False
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)
    return max(time.perf_counter() - started, 1e-9), dropped


def _folder(dataset: dict):
    from ..data.folder import ImageFiles, scan

    root = Path(dataset.get("root") or "").expanduser()
    if not root.is_dir():
        raise InputError(f"dataset.root={dataset.get('root')!r} is not a folder on this machine")
    files, labels, classes = scan(root / "train" if (root / "train").is_dir() else root)
    seed = dataset.get("data_seed", dataset.get("seed"))  # a run folder written before the rename says seed
    images = ImageFiles(files, labels, int(dataset.get("image_size") or 32), [0.5] * 3, [0.25] * 3, len(classes),
                        augment=dataset.get("augment") or False, seed=int(seed or 0),
                        crop_size=dataset.get("crop_size"))

    def decode(items: int) -> float:
        indices = torch.linspace(0, len(files) - 1, min(items, len(files))).round().long().unique()
        started = time.perf_counter()
        images.get_batch(indices)
        return (time.perf_counter() - started) / len(indices)

    return files, decode


def _text(dataset: dict):
    from ..data.text import _text_files, load_text

    splits = load_text(dataset.get("path"), dataset.get("tokenizer") or "char", int(dataset.get("block_size") or 64),
                       float(dataset.get("test_fraction") or 0.05))

    def decode(items: int) -> float:
        indices = torch.randint(0, len(splits.train), (items,), generator=torch.Generator().manual_seed(0))
        started = time.perf_counter()
        splits.train.get_batch(indices)
        return (time.perf_counter() - started) / items

    return [str(p) for p in _text_files(Path(dataset["path"]).expanduser())], decode


def _verdict(facts: RunFacts, read_ms: float | None, decode_ms: float, dataset: dict) -> Finding:
    """Per sample, in one worker: the disk's read, decoding, against the run's compute."""
    seconds, pwb = facts.stage_seconds, facts.get("per_worker_batch")
    if not seconds or not pwb:
        return not_visible("what bounds the data", "the run's stage seconds are not recorded")
    # The model's own work only: the sum and the barriers are waiting, which the data does not shorten.
    compute_ms = 1000 * sum(seconds[k] for k in ("forward", "backward", "update")) / facts.steps / pwb
    parts = {"the disk": read_ms, "decoding and augmentation": decode_ms, "the model's compute": compute_ms}
    parts = {k: v for k, v in parts.items() if v is not None}
    bound = max(parts, key=parts.get)
    evidence = "per sample in a worker: " + ", ".join(f"{k} {v:.3g} ms" for k, v in parts.items()) + \
        f" (the run's data stage {1000 * seconds['data'] / facts.steps / pwb:.3g} ms)"
    if bound == "the model's compute":
        return Finding("what bounds the data", evidence + ": the compute; the data keeps up")
    if bound == "the disk":
        return Finding("what bounds the data", evidence + ": the disk",
                       "dataset.preload=true (read once), or the files on a faster disk")
    fix = "dataset.preload=true (decode once)" if dataset.get("name") == "folder" else "a shorter dataset.block_size"
    if dataset.get("augment"):
        fix += ", or lighter augmentation (dataset.augment=false)"
    return Finding("what bounds the data", evidence + ": decoding", fix)
