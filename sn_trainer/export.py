"""Trained weights handed on as safetensors: from a fit's result, or converted from any checkpoint.

``model.safetensors`` holds the model's state_dict (and ``model_ema.safetensors`` the moving
average's, where the run kept one), each tied weight once under one of its names, as
``safetensors.torch.save_model`` writes it: ``safetensors.torch.load_model(fresh_model, path)``
restores it, ties included.

    python -m sn_trainer.export CHECKPOINT OUT_DIR [--overwrite]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

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


def export_checkpoint(checkpoint_path: str | Path, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """A checkpoint's weights (and moving average) as safetensors files in ``out_dir``.

    Tied weights are written once: those the checkpoint records, or, in one written before they
    were recorded, those ``tied_in`` finds. With ``overwrite``, files of an earlier export in
    ``out_dir`` are replaced (and a moving average's this checkpoint has none of removed).

    Raises:
        CheckpointError: the checkpoint is not a file, or cannot be read.
        InputError: ``out_dir`` is a file, or holds an earlier export and ``overwrite`` is false.
    """
    from . import checkpoint
    from .errors import CheckpointError, InputError

    source, out = Path(checkpoint_path), Path(out_dir)
    if source.is_dir():
        raise CheckpointError(f"{source} is a folder, not a checkpoint file; give one of its step-*.pt files "
                              "(or best.pt)")
    if not source.exists():
        raise CheckpointError(f"{source}: no such file; give a checkpoint file (step-NNNNNNNNN.pt, best.pt)")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, not a folder; give a folder to write {WEIGHTS} in (a new one, or one "
                         "that exists)")
    earlier = [out / name for name in (WEIGHTS, EMA_WEIGHTS) if (out / name).exists()]
    if earlier and not overwrite:
        raise InputError(f"{earlier[0]} exists; pass --overwrite to replace it, or give another folder")
    saved = checkpoint.load(source)
    tied = tied_in(saved)
    written = [save_weights(saved["model"], tied, out / WEIGHTS)]
    if saved.get("ema"):
        written.append(save_weights({**saved["model"], **saved["ema"]}, tied, out / EMA_WEIGHTS))
    else:
        (out / EMA_WEIGHTS).unlink(missing_ok=True)  # an earlier export's: not this checkpoint's average
    return written


def tied_in(saved: dict[str, Any]) -> dict[str, str]:
    """The checkpoint's tied names, alias -> first name.

    A checkpoint records them (``aliases``); one written before it did holds a tied weight under
    each of its names, as one tensor (shared storage: tied as saved) or as equal copies (how its
    workers wrote the model). An equal copy is taken for a tie only where the optimizer's state
    says so: it names each trainable tensor once, so a name it leaves out that equals an earlier
    name it holds is that tensor's alias (a frozen copy that happens to be equal is not told
    from a tie, and is kept).
    """
    if "aliases" in saved:
        return dict(saved["aliases"] or {})
    trained = _optimized_names(saved.get("optimizer"))
    found: dict[str, str] = {}
    firsts: dict[tuple, list[str]] = {}  # the names kept so far, by dtype and shape
    for name, tensor in saved["model"].items():
        if not isinstance(tensor, torch.Tensor):
            continue
        same_kind = firsts.setdefault((tensor.dtype, tuple(tensor.shape)), [])
        first = next((other for other in same_kind if _same_view(tensor, saved["model"][other])
                      or (trained is not None and other in trained and name not in trained
                          and torch.equal(tensor, saved["model"][other]))), None)
        if first is None:
            same_kind.append(name)
        else:
            found[name] = first
    return found


def _optimized_names(optimizer: Any) -> set[str] | None:
    """The parameter names the optimizer state holds (every phase's), or None where it names none."""
    phases = optimizer if isinstance(optimizer, list) else [optimizer]
    names: set[str] = set()
    for held in phases:
        groups = held.get("param_groups") if isinstance(held, dict) else None
        if not groups:
            return None
        names.update(name for group in groups for name in group.get("params", []) if isinstance(name, str))
    return names or None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.export",
                                     description="Write a checkpoint's weights as model.safetensors (and "
                                                 "model_ema.safetensors) in a folder.")
    parser.add_argument("checkpoint", help="a checkpoint file (step-NNNNNNNNN.pt, best.pt)")
    parser.add_argument("out", help="the folder to write them in")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier export in that folder")
    args = parser.parse_args(argv)
    from .errors import InputError

    try:
        for path in export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite):
            print(path)
    except (InputError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
