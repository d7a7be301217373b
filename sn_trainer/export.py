"""Trained weights handed on as safetensors: from a fit's result, or converted from any checkpoint.

``model.safetensors`` holds the model's state_dict (and ``model_ema.safetensors`` the moving
average's, where the run kept one), each tied weight once under one of its names, as
``safetensors.torch.save_model`` writes it: ``safetensors.torch.load_model(fresh_model, path)``
restores it, ties included.

    python -m sn_trainer.export CHECKPOINT OUT_DIR
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

WEIGHTS, EMA_WEIGHTS = "model.safetensors", "model_ema.safetensors"


def save_weights(state: dict[str, Any], tied: dict[str, str], path: str | Path) -> Path:
    """Write ``state`` without the tied aliases (each named in the file's metadata, as
    ``save_model`` does), every tensor contiguous.

    Raises:
        ImportError: safetensors is not installed (``pip install sn_trainer[safetensors]``).
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError("writing safetensors needs the safetensors package: pip install sn_trainer[safetensors]") \
            from None
    kept = {name: tensor.detach().contiguous() for name, tensor in state.items() if name not in tied}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(path), metadata=dict(tied) or None)
    return path


def export_checkpoint(checkpoint_path: str | Path, out_dir: str | Path) -> list[Path]:
    """A checkpoint's weights (and moving average) as safetensors files in ``out_dir``.

    Raises:
        CheckpointError: the checkpoint cannot be read.
    """
    from . import checkpoint

    saved = checkpoint.load(checkpoint_path)
    tied = saved.get("aliases") or {}
    written = [save_weights(saved["model"], tied, Path(out_dir) / WEIGHTS)]
    if saved.get("ema"):
        written.append(save_weights({**saved["model"], **saved["ema"]}, tied, Path(out_dir) / EMA_WEIGHTS))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.export",
                                     description="Write a checkpoint's weights as model.safetensors (and "
                                                 "model_ema.safetensors) in a folder.")
    parser.add_argument("checkpoint", help="a checkpoint file (step-NNNNNNNNN.pt, best.pt)")
    parser.add_argument("out", help="the folder to write them in")
    args = parser.parse_args(argv)
    from .errors import InputError

    try:
        for path in export_checkpoint(args.checkpoint, args.out):
            print(path)
    except (InputError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
