"""Every dataset loader, on small files written here in the real formats."""
import gzip
import pickle
import re
import struct

import numpy as np
import pytest
import torch

from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.errors import ConfigError, DataError
from sn_trainer.cli import named_datasets as datasets
from sn_trainer.cli.named_datasets import load_datasets
from sn_trainer.data.datasets import random_crop_flip, read_idx

pytestmark = pytest.mark.unit  # the unit tier: starts no process


def write_idx(path, array, compress=True):
    array = np.asarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def write_mnist_files(directory, n_train=20, n_test=10, compress=True):
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if compress else ""
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28))
        labels = rng.integers(0, 10, n)
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images, compress)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist"])
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.quick
def test_mnist_like_from_root(tmp_path, name, compress):
    arrays = write_mnist_files(tmp_path, compress=compress)
    data = load_datasets(DatasetConfig(name=name, root=str(tmp_path)))
    assert (len(data.train), len(data.test), data.sample_shape, data.num_classes) == (20, 10, (1, 28, 28), 10)
    assert torch.equal(data.train.images[:, 0], torch.from_numpy(arrays["train"][0].astype(np.uint8)))
    assert torch.equal(data.test.labels, torch.from_numpy(arrays["t10k"][1]).long())
    inputs, targets = data.train.get_batch(torch.arange(20))
    assert inputs.dtype == torch.float32 and inputs.shape == (20, 1, 28, 28)
    assert abs(inputs.mean().item()) < 1e-4 and abs(inputs.std().item() - 1) < 1e-2  # normalised
    assert data.source == str(tmp_path)


def test_torchvision_layout_under_root(tmp_path):
    write_mnist_files(tmp_path / "FashionMNIST" / "raw")
    assert len(load_datasets(DatasetConfig(name="fashion_mnist", root=str(tmp_path))).train) == 20


def test_not_found_names_all_three_ways(tmp_path, monkeypatch):
    monkeypatch.setitem(datasets.DEBIAN_ROOTS, "fashion_mnist", str(tmp_path / "no-debian-package"))
    with pytest.raises(DataError) as caught:
        load_datasets(DatasetConfig(name="fashion_mnist", root=str(tmp_path)))
    message = str(caught.value)
    assert "dataset.root=" in message and "apt-get install dataset-fashion-mnist" in message
    assert "dataset.download=true" in message


def test_download_goes_through_torchvision(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setitem(datasets.DEBIAN_ROOTS, "fashion_mnist", str(tmp_path / "no-debian-package"))
    calls = []

    class FakeFashionMNIST:  # what torchvision leaves on disk after a download
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            write_mnist_files(tmp_path / "FashionMNIST" / "raw")

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", FakeFashionMNIST)
    data = load_datasets(DatasetConfig(name="fashion_mnist", root=str(tmp_path), download=True))
    assert len(data.train) == 20 and calls == [(str(tmp_path), True, True), (str(tmp_path), False, True)]


def test_truncated_idx_is_a_clear_error(tmp_path):
    write_mnist_files(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-100]))
    with pytest.raises(DataError, match="is not a readable IDX file"):
        load_datasets(DatasetConfig(name="mnist", root=str(tmp_path)))
    (tmp_path / "junk").write_bytes(b"not an idx file at all")
    with pytest.raises(DataError, match="not a readable IDX file"):
        read_idx(tmp_path / "junk")


def write_cifar(directory, per_batch=6):
    rng = np.random.default_rng(1)
    directory.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072)).astype(np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist()}
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f)


def test_cifar10_pickle_batches(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    data = load_datasets(DatasetConfig(name="cifar10", root=str(tmp_path)))
    assert (len(data.train), len(data.test), data.sample_shape) == (30, 6, (3, 32, 32))
    assert data.train.augment and not data.test.augment  # crop + flip on by default for CIFAR-10
    inputs, _ = data.train.get_batch(torch.arange(30))
    assert inputs.shape == (30, 3, 32, 32)


def test_cifar10_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py/data_batch_1..5 and test_batch"):
        load_datasets(DatasetConfig(name="cifar10", root=str(tmp_path)))


def test_folder_of_pngs(tmp_path):
    from PIL import Image

    for split, count in (("train", 3), ("test", 2)):
        for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (20, 12), colour).save(folder / f"{i}.png")
    data = load_datasets(DatasetConfig(name="folder", root=str(tmp_path), image_size=16, preload=True))
    assert (len(data.train), len(data.test), data.sample_shape, data.num_classes) == (6, 4, (3, 16, 16), 2)
    assert data.train.images[0, 0].float().mean() == 255  # a red cat
    flat = load_datasets(DatasetConfig(name="folder", root=str(tmp_path / "train"), image_size=8, test_fraction=0.3,
                                       preload=True))
    assert (len(flat.train), len(flat.test)) == (5, 1)
    # Read per sample where they lie (the default): the same items, decoded when asked for.
    files = load_datasets(DatasetConfig(name="folder", root=str(tmp_path), image_size=16))
    assert "read per sample" in files.source and not hasattr(files.train, "images")
    assert (len(files.train), len(files.test), files.sample_shape, files.num_classes) == (6, 4, (3, 16, 16), 2)
    for split in ("train", "test"):
        for i in range(len(getattr(data, split))):
            mine, theirs = getattr(files, split)[i], getattr(data, split)[i]
            torch.testing.assert_close(mine[0], theirs[0], rtol=1e-6, atol=1e-5)
            assert mine[1] == theirs[1]


def test_folder_images_are_decoded_by_content_and_a_bad_one_is_named(tmp_path):
    """A PNG named .jpg and a JPEG named .png read as ImageFolder (Pillow) reads them; a file
    nothing decodes is a DataError naming it, from the reading up front and from a worker's."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = {name: rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for name in ("png", "jpeg")}
    for split in ("train", "test"):
        (tmp_path / split / "a").mkdir(parents=True)
        Image.fromarray(pixels["png"]).save(tmp_path / split / "a" / "png-named.jpg", format="PNG")
        Image.fromarray(pixels["jpeg"]).save(tmp_path / split / "a" / "jpeg-named.png", format="JPEG")
    data = load_datasets(DatasetConfig(name="folder", root=str(tmp_path), image_size=16, preload=True))
    by_name = dict(zip(["jpeg-named.png", "png-named.jpg"], data.train.images))  # sorted by file name
    assert torch.equal(by_name["png-named.jpg"], torch.from_numpy(pixels["png"]).permute(2, 0, 1))  # lossless
    with Image.open(tmp_path / "train" / "a" / "jpeg-named.png") as jpeg:
        assert torch.equal(by_name["jpeg-named.png"], torch.from_numpy(np.array(jpeg.convert("RGB"))).permute(2, 0, 1))
    per_sample = load_datasets(DatasetConfig(name="folder", root=str(tmp_path), image_size=16))
    assert per_sample.train[1][0].shape == (3, 16, 16)  # read where it lies, by a worker

    good = (tmp_path / "train" / "a" / "jpeg-named.png").read_bytes()
    for name, content in (("truncated.jpg", good[: len(good) // 2]), ("junk.png", b"not an image")):
        bad = tmp_path / "test" / "a" / name
        bad.write_bytes(content)
        for preload in (True, False):
            with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}: not an image that torchvision or Pillow can "
                                                r"decode \(.+\); replace the file with a readable image, or remove it"):
                split = load_datasets(DatasetConfig(name="folder", root=str(tmp_path), image_size=16, preload=preload))
                [split.test[i] for i in range(len(split.test))]  # read per sample: a worker reads it so
        bad.unlink()


def test_synthetic_shape_and_size():
    data = load_datasets(DatasetConfig(name="synthetic", shape=[3, 8, 8], num_classes=4, train_size=50, test_size=7))
    assert (len(data.train), len(data.test), data.sample_shape, data.num_classes) == (50, 7, (3, 8, 8), 4)
    assert int(data.train.labels.max()) < 4


def test_synthetic_data_follows_data_seed():
    def images(data_seed: int) -> torch.Tensor:
        config = DatasetConfig(name="synthetic", shape=[1, 4, 4], train_size=6, test_size=2, data_seed=data_seed)
        return load_datasets(config).train.images

    assert torch.equal(images(1), images(1)) and not torch.equal(images(0), images(1))


def test_unknown_dataset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="choose one of fashion_mnist, mnist, cifar10, synthetic, folder"):
        load_datasets(DatasetConfig(name="imagenet"))


def test_batched_crop_and_flip_match_a_per_sample_loop():
    images = torch.randint(0, 256, (5, 3, 6, 7), dtype=torch.uint8)
    torch.manual_seed(3)
    out = random_crop_flip(images, padding=2)
    torch.manual_seed(3)
    dy, dx = torch.randint(0, 5, (5, 1, 1)), torch.randint(0, 5, (5, 1, 1))
    flip = torch.rand(5, 1, 1) < 0.5
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for i in range(5):
        crop = padded[i, :, dy[i, 0, 0]: dy[i, 0, 0] + 6, dx[i, 0, 0]: dx[i, 0, 0] + 7]
        assert torch.equal(out[i], crop.flip(2) if flip[i] else crop)
