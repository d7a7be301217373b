"""What proving one order costs a stream's reader: with several workers, each digests every item of
each global batch it reads (sn_trainer/data/digest.py). This times, in one process, reading a
webdataset pipeline of JPEG shards (decoded to float tensors, and left as bytes) against digesting
what it yields, and prints the digest's share of the reading.

    python scripts/stream_digest_cost.py [--images 512] [--size 224] [--rounds 3]
"""
from __future__ import annotations

import argparse
import io
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from sn_trainer.data.digest import ItemDigest


def write_shards(directory: Path, images: int, size: int, per_shard: int = 128) -> list[str]:
    """Smooth synthetic photos (so that JPEG compresses them as it does real ones), with labels."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    urls = []
    for shard in range(0, images, per_shard):
        url = str(directory / f"shard-{shard // per_shard:04d}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(shard, min(images, shard + per_shard)):
                a, b, c = rng.uniform(0.5, 4, 3)
                pixels = np.stack([np.sin(a * x + b * y), np.cos(b * x * y + c), np.sin(c * (x - y))], axis=-1)
                buffer = io.BytesIO()
                Image.fromarray(((pixels + 1) * 127.5).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
                sink.write({"__key__": f"{i:06d}", "jpg": buffer.getvalue(), "cls": i % 10})
        urls.append(url)
    return urls


def timed(items) -> tuple[float, list]:
    started = time.perf_counter()
    taken = list(items)
    return time.perf_counter() - started, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_shards(Path(tmp), args.images, args.size)
        pipelines = {
            "decoded (torchrgb float32 + label)": lambda: wds.WebDataset(urls, shardshuffle=False).decode("torchrgb")
            .to_tuple("jpg", "cls"),
            "decoded (torchrgb8 uint8 + label)": lambda: wds.WebDataset(urls, shardshuffle=False).decode("torchrgb8")
            .to_tuple("jpg", "cls"),
            "raw (jpg bytes + label)": lambda: wds.WebDataset(urls, shardshuffle=False).to_tuple("jpg", "cls"),
        }
        load = os.getloadavg()[0]
        print(f"host: {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} (a busy machine slows "
              f"both alike only roughly); {args.images} images of {args.size}x{args.size}, best of {args.rounds} "
              "rounds, one thread")
        for name, make in pipelines.items():
            read_s = digest_s = float("inf")
            for _ in range(args.rounds):
                seconds, items = timed(make())
                read_s = min(read_s, seconds)
                digest = ItemDigest()
                started = time.perf_counter()
                digest.add(items)
                digest_s = min(digest_s, time.perf_counter() - started)
            per_item = 1e6 / args.images
            print(f"{name}: read {read_s * per_item:.0f} us/item, digest {digest_s * per_item:.1f} us/item "
                  f"({100 * digest_s / read_s:.1f}% of reading)")


if __name__ == "__main__":
    main()
