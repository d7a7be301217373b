"""A variational auto-encoder on Fashion-MNIST, trained by sn_trainer.

Written the way pytorch/examples' VAE is: the model returns a tuple (reconstruction, mean, log
variance), and the loss, binary cross-entropy plus the KL divergence summed over the batch, needs
all of it. The step function returns that sum with the number of samples it covers, so every
step trains on the global batch's per-sample loss, however the batch is split. The data comes
from Debian's dataset-fashion-mnist (or ``--root``), as images in [0, 1].

    python examples/vae.py [--epochs 3] [--workers auto]
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
from torch.utils.data import TensorDataset

from sn_trainer import Trainer
from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.cli.named_datasets import load_datasets


class VAE(nn.Module):
    def __init__(self, hidden: int = 400, latent: int = 20):
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.fc21 = nn.Linear(hidden, latent)
        self.fc22 = nn.Linear(hidden, latent)
        self.fc3 = nn.Linear(latent, hidden)
        self.fc4 = nn.Linear(hidden, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        return self.decode(self.reparameterize(mu, logvar)), mu, logvar


def step(model: VAE, batch):
    """Reconstruction + KL divergence, summed over the slice, and how many samples that is."""
    (images,) = batch
    recon, mu, logvar = model(images)
    bce = F.binary_cross_entropy(recon, images.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld, images.size(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use only this many training images")
    parser.add_argument("--root", default=None, help="a folder with Fashion-MNIST's IDX files")
    parser.add_argument("--workers", default="auto")
    args = parser.parse_args()

    data = load_datasets(DatasetConfig(name="fashion_mnist", root=args.root))
    train = TensorDataset(data.train.images[: args.limit].float().div_(255))
    test = TensorDataset(data.test.images[: args.limit].float().div_(255))
    torch.manual_seed(0)
    model = VAE()
    trainer = Trainer(workers=args.workers if args.workers == "auto" else int(args.workers),
                      batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps, log_every=100)
    result = trainer.fit(model, train, eval_set=test, step_fn=step,
                         optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    print(f"test loss {result.eval_loss:.1f} per image (reconstruction + KL), "
          f"{result.samples_per_sec:.0f} images/s ({result.workers} workers)")


if __name__ == "__main__":
    main()
