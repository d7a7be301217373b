"""SimCLR on Fashion-MNIST, trained by sn_trainer: a contrastive loss over the whole global batch.

Each image is seen in two random crops (and flips); a small conv encoder, whose blocks are
recomputed in the backward pass (``torch.utils.checkpoint``) rather than kept, and a projection
head map each crop to an embedding. NT-Xent compares every embedding with every other of the
batch, so the step gathers the embeddings of all workers' slices (``sn_trainer.gather``) and
computes the loss over the global batch, as one process would; the crops are drawn in the step,
each worker from its own random stream, so the run is like DDP in them (and says so). The encoder
is then judged without labels in training: each test image takes the class of its nearest
training image.

    python examples/simclr.py [--epochs 2] [--workers auto]
"""
from __future__ import annotations

import sn_trainer

if __name__ == "__main__":
    sn_trainer.warm_up()  # first: the warm workers' server imports torch while this script does

import argparse
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.cli.named_datasets import load_datasets

CROP = 24  # of 28 x 28 pixels


class Encoder(nn.Module):
    """Two conv blocks, each recomputed in the backward pass instead of keeping its activations."""

    def __init__(self, width: int = 16, features: int = 64, projection: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1)),
        ])
        self.features = nn.Linear(2 * width, features)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(features, projection))  # SimCLR's projection head

    def represent(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.features(x.flatten(1))

    def forward(self, x):
        return self.head(self.represent(x))


def augment(images):
    """A random crop of each image, flipped left to right half of the time."""
    n = images.shape[0]
    rows, cols = torch.randint(0, 28 - CROP + 1, (2, n))
    crops = torch.stack([image[:, r : r + CROP, c : c + CROP] for image, r, c in zip(images, rows, cols)])
    flip = torch.rand(n) < 0.5
    crops[flip] = crops[flip].flip(-1)
    return crops


def nt_xent(z1, z2, temperature: float = 0.5):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    similarity = (z @ z.T / temperature).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(similarity, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


def step(model: Encoder, batch):
    """Two crops of this worker's slice, embedded here; the loss over every worker's embeddings."""
    (images,) = batch
    z1, z2 = model(augment(images)), model(augment(images))
    return nt_xent(sn_trainer.gather(z1), sn_trainer.gather(z2))


@torch.no_grad()
def nearest_neighbour_accuracy(model: Encoder, train_images, train_labels, test_images, test_labels) -> float:
    """Each test image's class is that of its nearest training image, by the encoder's features."""
    model.eval()
    centre = (28 - CROP) // 2

    def features(images):
        return F.normalize(model.represent(images[:, :, centre : centre + CROP, centre : centre + CROP]), dim=1)

    nearest = (features(test_images) @ features(train_images).T).argmax(dim=1)
    return (train_labels[nearest] == test_labels).double().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use only this many training images")
    parser.add_argument("--root", default=None, help="a folder with Fashion-MNIST's IDX files")
    parser.add_argument("--workers", default="auto")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    data = load_datasets(DatasetConfig(name="fashion_mnist", root=args.root))
    images = data.train.images[: args.limit].float().div_(255)  # [N, 1, 28, 28]
    torch.manual_seed(0)
    model = Encoder()
    trainer = Trainer(workers=args.workers if args.workers == "auto" else int(args.workers),
                      batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps,
                      log_every=args.log_every)
    result = trainer.fit(model, TensorDataset(images), step_fn=step,
                         optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    losses = [record["loss"] for record in result.history if "loss" in record]
    test = data.test.images[:1000].float().div_(255)
    accuracy = nearest_neighbour_accuracy(model, images[:2000], data.train.labels[:2000].long(), test,
                                          data.test.labels[:1000].long())
    print(f"NT-Xent {losses[0]:.3f} first, {result.final_loss:.3f} last "
          f"({result.plan['loss_form']} over the global batch of {args.batch_size}, {result.workers} workers); "
          f"nearest-neighbour accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
