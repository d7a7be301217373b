"""Try every bad input docs/getting-started.md's "Bad input" table lists and print what a user sees (a Markdown table).

Kept beside the page whose table it writes: when a message changes, run it again and paste the table.

    python docs/bad_inputs.py > /tmp/table.md
"""
from __future__ import annotations

import gzip
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

TINY = ["dataset=synthetic", "dataset.train_size=64", "dataset.test_size=16", "batch_size=16", "workers=2"]


def run(args: list[str], cwd: Path) -> tuple[int, str]:
    """Exit code, and the line that tells the user what went wrong (or the warning given)."""
    proc = subprocess.run([sys.executable, "-m", "sn_trainer", *args, f"hydra.run.dir={cwd / 'out'}"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    for wanted in (("error:", "interrupted:"), ("In 'config': Could not",)):
        found = [line for line in lines if line.startswith(wanted)]
        if found:
            return proc.returncode, found[0]
    warnings = [line.split("] - ", 1)[-1] for line in lines if "[WARNING]" in line]
    return proc.returncode, ("warning: " + warnings[0]) if warnings else ""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # A real checkpoint to damage and misuse.
        run([*TINY, "max_steps=2", f"checkpoint.dir={root / 'ckpt'}"], root)
        good = sorted((root / "ckpt").glob("step-*.pt"))[-1]
        truncated = root / "truncated.pt"
        truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        evil = root / "evil.pt"
        subprocess.run([sys.executable, "-c", "import os, torch\nclass P:\n def __reduce__(self):"
                        " return (os.system, ('touch pwned',))\ntorch.save({'x': P()}, " + repr(str(evil)) + ")"],
                       check=True, cwd=root)
        junk = root / "junk-mnist"
        junk.mkdir()
        for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                     "t10k-labels-idx1-ubyte"):
            (junk / f"{name}.gz").write_bytes(gzip.compress(b"this is not IDX data"))
        (root / "a-file").write_text("")
        for cls in ("a", "b"):  # a folder of images, one of them a JPEG in name only
            (root / "images" / cls).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (10, 10), (60 * i, 90, 20)).save(root / "images" / cls / f"{i}.jpg")
        (root / "images" / "b" / "3.jpg").write_bytes(b"\xff\xd8\xff not a whole JPEG")
        cases = [
            ("a truncated checkpoint", [*TINY, f"resume={truncated}"]),
            ("a checkpoint that would run code", [*TINY, f"resume={evil}"]),
            ("a checkpoint of another model", [*TINY, "model=mlp", f"resume={good}"]),
            ("a resume with another batch size", [*TINY, "batch_size=32", "max_steps=4", f"resume={good}"]),
            ("a checkpoint that does not exist", [*TINY, "resume=/nonexistent/step-1.pt"]),
            ("wrong-format data files", ["dataset=mnist", f"dataset.root={junk}"]),
            ("a missing data directory", ["dataset=cifar10", "dataset.root=/nonexistent"]),
            ("an image file nothing decodes", ["dataset=folder", f"dataset.root={root / 'images'}", "model=mlp",
                                               "dataset.image_size=8", "batch_size=4", "workers=2", "max_steps=1"]),
            ("a checkpoint directory that cannot be written", [*TINY, f"checkpoint.dir={root / 'a-file' / 'x'}"]),
            ("batch_size < workers", [*TINY, "batch_size=1"]),
            ("workers < 1", [*TINY, "workers=0"]),
            ("threads < 1", [*TINY, "threads=0"]),
            ("a non-positive lr", [*TINY, "optim.lr=0"]),
            ("non-positive epochs", [*TINY, "epochs=0"]),
            ("an unknown model name", [*TINY, "model.name=lenet5"]),
            ("an unknown dataset name", ["dataset.name=imagenet"]),
            ("a text dataset without a path", ["dataset=text", "model=gpt"]),
            ("a GPT on images", [*TINY, "model=gpt"]),
            ("an unknown setting", [*TINY, "batchsize=3"]),
            ("a setting the chosen dataset does not read", ["dataset.data_seed=3"]),
            ("a number given as text", [*TINY, "optim.momentum=abc"]),
            ("an unknown config group option", [*TINY, "model=lenet5"]),
            ("workers x threads > cores (warning, runs)", [*TINY, "workers=2", "threads=4", "max_steps=1"]),
        ]
        print("| bad input | exit code | what the user sees |")
        print("|---|---:|---|")
        for label, args in cases:
            code, line = run(args, root)
            line = line.replace(str(root), "<tmp>").replace("|", "\\|")
            print(f"| {label} | {code} | `{line[:220]}` |")
        assert not (root / "pwned").exists(), "the evil checkpoint ran code"


if __name__ == "__main__":
    main()
