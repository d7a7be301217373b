"""``python -m sn_trainer.verify MODULE:FUNCTION [--steps K] [setting=value ...]``: your model trained k
steps with W workers and as one plain process over the same global batches; per parameter, the
largest difference, the exactness rows that apply, and the verdict.

``FUNCTION()`` (in an importable module, or a file: ``path/to/train.py:build``) returns what
``Trainer.fit`` takes, as a dict: ``model`` and ``train_set``, and any of ``optimizer``, ``loss_fn``,
``step_fn``, ``param_groups``, ``scheduler``, ``collate_fn``, ``after_update``. The settings are the
Trainer's keywords (``workers=2 batch_size=64``). Exit code 0: exact; 1: like DDP or not exact;
2: refused, or bad input.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
from pathlib import Path

from ..errors import InputError

FIT_ARGUMENTS = ("optimizer", "loss_fn", "step_fn", "param_groups", "scheduler", "collate_fn", "after_update")


def entry(spec: str):
    """The function ``spec`` (``module:function`` or ``file.py:function``) names.

    Raises:
        InputError: it names no function that can be imported.
    """
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(f"{spec!r} names no function: give MODULE:FUNCTION or path/to/file.py:FUNCTION")
    try:
        if where.endswith(".py"):
            path = Path(where)
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or not path.is_file():
                raise InputError(f"{where} is not a Python file")
            sys.path.insert(0, str(path.resolve().parent))  # its workers import it by name, as spawn does
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[path.stem] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise InputError(f"cannot import {where}: {exc}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise InputError(f"{where} has no function {name!r}")
    return function


def setting(text: str) -> tuple[str, object]:
    """``key=value``, the value read as Python (numbers, True/False, None), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InputError(f"{text!r} is not a setting: write key=value, e.g. workers=2")
    lowered = {"true": True, "false": False, "null": None, "none": None}.get(value.lower(), value)
    if lowered is not value:
        return key, lowered
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.verify", description=__doc__.splitlines()[0])
    parser.add_argument("entry", help="MODULE:FUNCTION or path/to/file.py:FUNCTION returning fit's arguments as a dict")
    parser.add_argument("settings", nargs="*", help="the Trainer's settings, as key=value (workers=2 batch_size=64)")
    parser.add_argument("--steps", type=int, default=10, help="steps to train both ways (default 10)")
    args = parser.parse_args(argv)
    from ..trainer import Trainer

    try:
        arguments = entry(args.entry)()
        if not isinstance(arguments, dict) or "model" not in arguments or "train_set" not in arguments:
            raise InputError(f"{args.entry}() must return a dict with model and train_set (and fit's other "
                             f"arguments: {', '.join(FIT_ARGUMENTS)})")
        unknown = sorted(set(arguments) - {"model", "train_set", *FIT_ARGUMENTS})
        if unknown:
            raise InputError(f"{args.entry}() returned {', '.join(unknown)}, which verify does not take; it takes "
                             f"model, train_set, {', '.join(FIT_ARGUMENTS)}")
        trainer = Trainer(**dict(setting(text) for text in args.settings))
        report = trainer.verify(arguments.pop("model"), arguments.pop("train_set"), steps=args.steps, **arguments)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return {"exact": 0, "refused": 2}.get(report.verdict, 1)


if __name__ == "__main__":
    sys.exit(main())
