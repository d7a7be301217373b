"""A DCGAN on Fashion-MNIST, trained by sn_trainer: the discriminator's step, then the generator's.

Written the way pytorch/examples' DCGAN is: a generator of transposed convolutions and a
discriminator of convolutions, both with batch norm, binary cross-entropy, two Adams with
betas (0.5, 0.999); every step updates D on real and generated images, then G against the D just
updated. Each is an ``sn_trainer.Phase``; with ``sync_batchnorm`` the workers' batch norms see the
whole global batch, so the run trains what one process would. The latent noise comes with each
training image (drawn once, a vector per image), so both phases of a step see the same fakes.
At the end, a grid of images generated from fixed noise is saved as a PNG.

    python examples/dcgan.py [--epochs 3] [--workers auto] [--out results/dcgan.png]
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

from sn_trainer import Phase, Trainer
from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.cli.named_datasets import load_datasets

LATENT = 32


class DCGAN(nn.Module):
    def __init__(self, features: int = 32):
        super().__init__()
        self.G = nn.Sequential(
            nn.Linear(LATENT, 2 * features * 7 * 7, bias=False), nn.Unflatten(1, (2 * features, 7, 7)),
            nn.BatchNorm2d(2 * features), nn.ReLU(True),
            nn.ConvTranspose2d(2 * features, features, 4, 2, 1, bias=False), nn.BatchNorm2d(features), nn.ReLU(True),
            nn.ConvTranspose2d(features, 1, 4, 2, 1, bias=False), nn.Tanh())
        self.D = nn.Sequential(
            nn.Conv2d(1, features, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(features, 2 * features, 4, 2, 1, bias=False), nn.BatchNorm2d(2 * features),
            nn.LeakyReLU(0.2, inplace=True), nn.Flatten(), nn.Linear(2 * features * 7 * 7, 1))


def d_step(model: DCGAN, batch):
    """Real images labelled 1, generated ones 0 (the generator's output detached, as DCGAN does)."""
    real, noise = batch
    fake = model.G(noise).detach()
    real_logits, fake_logits = model.D(real), model.D(fake)
    return (F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits))
            + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits)))


def g_step(model: DCGAN, batch):
    """Generated images judged by the discriminator just updated, labelled 1."""
    _, noise = batch
    logits = model.D(model.G(noise))
    return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def d_params(model: DCGAN):
    return model.D.parameters()


def g_params(model: DCGAN):
    return model.G.parameters()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use only this many training images")
    parser.add_argument("--root", default=None, help="a folder with Fashion-MNIST's IDX files")
    parser.add_argument("--workers", default="auto")
    parser.add_argument("--out", default="dcgan.png", help="the PNG grid of generated images")
    args = parser.parse_args()

    data = load_datasets(DatasetConfig(name="fashion_mnist", root=args.root))
    images = data.train.images[: args.limit].float().div_(127.5).sub_(1.0)  # in [-1, 1], as tanh gives
    noise = torch.randn(len(images), LATENT, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = DCGAN()
    adam = functools.partial(torch.optim.Adam, lr=2e-4, betas=(0.5, 0.999))
    trainer = Trainer(workers=args.workers if args.workers == "auto" else int(args.workers),
                      batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps, log_every=100,
                      sync_batchnorm=True)
    result = trainer.fit(model, TensorDataset(images, noise),
                         phases=[Phase(d_step, d_params, adam, name="D"), Phase(g_step, g_params, adam, name="G")])
    last = result.history[-1]
    print(f"{result.steps} steps: loss D {last['loss_D']:.3f}, G {last['loss_G']:.3f}; "
          f"{result.samples_per_sec:.0f} images/s ({result.workers} workers)")

    from torchvision.utils import save_image

    model.eval()
    with torch.no_grad():
        grid = model.G(torch.randn(64, LATENT, generator=torch.Generator().manual_seed(2)))
    save_image(grid, args.out, nrow=8, normalize=True, value_range=(-1, 1))
    print(f"samples: {args.out}")


if __name__ == "__main__":
    main()
