"""Images read, decoded and augmented per sample inside the workers, the next step read ahead in a
thread: exact against a plain DataLoader over the same files, and never ahead where reading draws
from the global random generators."""
import copy
import functools
import logging

import pytest
import torch
from torch.utils.data import Dataset

from helpers import EXACT, SmallConvNet, plain_loader, tiny_dataset
from sn_trainer import Trainer
from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.cli.named_datasets import load_datasets
from sn_trainer.errors import ConfigError

pytestmark = pytest.mark.timeout(240)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def image_folder(root, side: int, suffix: str, **save):
    """40 images of side x side in three class folders, each class a little brighter."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for i in range(40):
        label = i % 3
        pixels = (torch.rand(side, side, 3, generator=g) * 80 + 60 * label).to(torch.uint8).numpy()
        (root / f"class{label}").mkdir(exist_ok=True)
        Image.fromarray(pixels).save(root / f"class{label}" / f"{i}.{suffix}", **save)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """40 JPEG files of 10x10 in three class folders."""
    return image_folder(tmp_path_factory.mktemp("images"), 10, "jpg", quality=90)


def step(model, batch):
    inputs, targets = batch
    return torch.nn.functional.cross_entropy(model(inputs.double()), targets)


def net():
    torch.manual_seed(0)
    return SmallConvNet(channels=3).double()


def plain(model, dataset, batch_size, epochs, seed):
    """Plain PyTorch over the files: a DataLoader per epoch, set_epoch before it (as for a
    DistributedSampler), the same seeded order as sn_trainer documents."""
    optimizer = SGD(model.parameters())
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        for batch in plain_loader(dataset, batch_size, seed, epoch):
            optimizer.zero_grad()
            step(model, batch).backward()
            optimizer.step()
    return model


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_images_augmented_per_sample_and_read_ahead_train_as_a_plain_loop(folder, workers):
    data = load_datasets(DatasetConfig(name="folder", root=str(folder), image_size=8, augment=True, data_seed=1,
                                       test_fraction=0.1))
    model = net()
    reference = plain(copy.deepcopy(model), copy.deepcopy(data.train), batch_size=8, epochs=2, seed=3)
    result = Trainer(workers=workers, threads=1, batch_size=8, epochs=2, seed=3, prefetch=True).fit(
        model, data.train, step_fn=step, optimizer=SGD)  # read ahead at W=1 too, where auto reads inline
    assert result.plan["prefetch"] is True and result.steps == 8  # 36 training images: 4 steps an epoch
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def png_folder(tmp_path_factory):
    """40 PNG files of 12x12 in three class folders: lossless, so Pillow and torchvision read the same pixels."""
    return image_folder(tmp_path_factory.mktemp("png_images"), 12, "png")


class PlainImageNetRecipe(Dataset):
    """torchvision's ImageNet recipe as a script writes it, over the same files read by Pillow:
    training, v2.RandomResizedCrop then v2.RandomHorizontalFlip, torchvision's own draws from the
    global generator seeded per sample by (seed, epoch, index); evaluation, v2.CenterCrop.
    Normalised by the statistics given."""

    def __init__(self, files, labels, crop, mean, std, seed, train):
        from torchvision.transforms import v2

        self.files, self.labels, self.mean, self.std, self.seed = files, labels, mean, std, seed
        self.transform = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()]) \
            if train else v2.CenterCrop(crop)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        import numpy as np
        from PIL import Image

        with Image.open(self.files[index]) as opened:
            image = torch.from_numpy(np.asarray(opened.convert("RGB")).copy()).permute(2, 0, 1)
        with torch.random.fork_rng():
            torch.manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index)
            image = self.transform(image)
        return (image.float() - self.mean) / self.std, int(self.labels[index])


@pytest.mark.parametrize("workers", [1, 2])
def test_images_in_random_resized_crops_train_as_torchvisions_recipe_in_a_plain_loop(png_folder, workers):
    data = load_datasets(DatasetConfig(name="folder", root=str(png_folder), image_size=12, augment="resized_crop",
                                       crop_size=8, data_seed=1, test_fraction=0.1))
    train, test = data.train, data.test
    plain_train, plain_test = (PlainImageNetRecipe(split.files, split.labels, 8, train.mean[0], train.std[0], seed=1,
                                                   train=split is train) for split in (train, test))
    assert data.sample_shape == (3, 8, 8) and train[0][0].shape == test[0][0].shape == (3, 8, 8)
    for index in range(len(test)):  # evaluation: resized to image_size, center-cropped
        assert torch.equal(test[index][0], plain_test[index][0])
    model = net()
    reference = plain(copy.deepcopy(model), plain_train, batch_size=8, epochs=2, seed=3)
    result = Trainer(workers=workers, threads=1, batch_size=8, epochs=2, seed=3, prefetch=True).fit(
        model, train, step_fn=step, optimizer=SGD)
    assert result.plan["prefetch"] is True  # its draws are the sample's own generator's, never the global ones
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.unit
@pytest.mark.parametrize("settings, refusal", [
    (dict(name="folder", augment="resized_crops"),
     r"dataset.augment must be true, false, null, crop_flip or resized_crop, got 'resized_crops'"),
    (dict(name="cifar10", augment="resized_crop"), r"dataset.augment=resized_crop applies to dataset=folder"),
    (dict(name="folder", augment="resized_crop", preload=True), r"reads each image .* set dataset.preload=false"),
    (dict(name="folder", augment="resized_crop", image_size=12, crop_size=16),
     r"dataset.crop_size=16 must be at most dataset.image_size=12"),
    (dict(name="folder", augment=True, crop_size=8), r"dataset.crop_size applies to dataset.augment=resized_crop"),
])
def test_a_resized_crop_that_cannot_be_made_is_refused_in_one_line(settings, refusal):
    with pytest.raises(ConfigError, match=refusal):
        DatasetConfig(**settings)


def test_reading_ahead_changes_nothing(folder):
    data = load_datasets(DatasetConfig(name="folder", root=str(folder), image_size=8, augment=True))
    ahead, inline = net(), net()
    Trainer(workers=2, batch_size=8, epochs=2, prefetch=True).fit(ahead, data.train, step_fn=step, optimizer=SGD)
    Trainer(workers=2, batch_size=8, epochs=2, prefetch=False).fit(inline, data.train, step_fn=step, optimizer=SGD)
    assert all(torch.equal(p, q) for p, q in zip(ahead.parameters(), inline.parameters()))


class FlipsWithTheGlobalGenerator(Dataset):
    """Augmentation as most scripts write it: torch.rand from the global generator."""

    def __init__(self):
        self.data = tiny_dataset(n=24)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        image, label = self.data[i]
        return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


def test_data_that_draws_global_random_numbers_is_not_read_ahead(caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="sn_trainer"):
        result = Trainer(workers=2, batch_size=8, max_steps=2).fit(SmallConvNet(), FlipsWithTheGlobalGenerator(),
                                                                   optimizer=SGD)
    assert result.plan["prefetch"] is False
    assert "prefetch=auto: off, as reading train_set draws global random numbers" in caplog.text
    with pytest.raises(ConfigError, match=r"^prefetch=true, and reading train_set draws from torch's, numpy's or "
                                          r"random's global random generator"):
        Trainer(workers=2, batch_size=8, max_steps=2, prefetch=True).fit(SmallConvNet(), FlipsWithTheGlobalGenerator(),
                                                                         optimizer=SGD)
    model, data = SmallConvNet(), FlipsWithTheGlobalGenerator()
    state = torch.get_rng_state()
    Trainer(workers=1, batch_size=8, max_steps=1).fit(model, data, optimizer=SGD)
    assert torch.equal(torch.get_rng_state(), state)  # the launcher's reading leaves the caller's stream alone


@pytest.mark.unit
@pytest.mark.parametrize("threads, draws_random, prefetch, workers, decided", [
    (1, False, "auto", 2, True), (2, False, "auto", 2, False),  # several threads fill a worker's cores: inline
    (1, True, "auto", 2, False), (2, False, True, 2, True), (1, False, False, 2, False),
    (1, False, "auto", 1, False), (1, False, True, 1, True)])  # one worker has no peer's time to fill
def test_prefetch_auto_reads_ahead_beside_one_thread_that_draws_nothing_global(threads, draws_random, prefetch,
                                                                               workers, decided):
    from sn_trainer.config import TrainerConfig
    from sn_trainer.fit.decide import for_reading

    settings = TrainerConfig(workers=workers, threads=threads, prefetch=prefetch)
    decided_settings, decisions = for_reading(settings, draws_random, global_workers=workers)
    assert decided_settings.prefetch is decided
    # prefetch=auto is a decision with its reason (in the log and summary.json); a value given is none.
    assert [(d.setting, d.value) for d in decisions] == ([("prefetch", decided)] if prefetch == "auto" else [])
    assert all(d.why.startswith(f"prefetch=auto: {'on' if decided else 'off'}, as ") for d in decisions)
