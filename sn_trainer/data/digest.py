"""A digest of a stream's items, equal in two processes exactly when the items are: how the workers
of a run show that they read one order.

Items are digested by what they hold, not by how they are stored or where they live: a tensor by
its dtype, shape and bytes; an array likewise; numbers, strings and bytes by their value; lists,
tuples and dicts element by element, in order; sets whatever their order (string hashing differs
between processes); PIL images by mode, size and pixels; other objects by their class and
attributes. The hash is SHA-256, cut to 64 bits for the board the workers compare it on.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import DataError

_DEPTH = 64  # deeper than any sample a collate could take: an object that refers to itself


class ItemDigest:
    """Items added one after another; ``value()`` is a 64-bit digest of them in that order."""

    def __init__(self):
        self._hash = hashlib.sha256()

    def add(self, items: Iterable[Any]) -> None:
        for item in items:
            _feed(self._hash, item, 0)

    def value(self) -> int:
        return int.from_bytes(self._hash.digest()[:8], "little")


def _tag(h, name: str, *parts: Any) -> None:
    h.update(f"\x00{name}:{':'.join(str(p) for p in parts)}\x00".encode())


def _feed(h, obj: Any, depth: int) -> None:
    if depth > _DEPTH:
        raise DataError(f"a stream item nests deeper than {_DEPTH} levels (an object that holds itself?): yield "
                        "tensors, arrays, numbers, strings, bytes, or lists, tuples and dicts of them")
    if _feed_value(h, obj):
        return
    if isinstance(obj, np.ndarray):  # an array of objects: element by element
        _tag(h, "objects", obj.shape)
        for element in obj.reshape(-1):
            _feed(h, element, depth + 1)
    elif isinstance(obj, Mapping):
        _tag(h, "map", type(obj).__name__, len(obj))
        for key, value in obj.items():
            _feed(h, key, depth + 1)
            _feed(h, value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        _tag(h, "seq", type(obj).__name__, len(obj))
        for element in obj:
            _feed(h, element, depth + 1)
    elif isinstance(obj, (set, frozenset)):
        parts = []
        for element in obj:
            part = hashlib.sha256()
            _feed(part, element, depth + 1)
            parts.append(part.digest())
        _tag(h, "set", len(parts))
        for part in sorted(parts):
            h.update(part)
    elif dataclasses.is_dataclass(obj):
        _tag(h, "dataclass", type(obj).__qualname__)
        for field in dataclasses.fields(obj):
            _feed(h, field.name, depth + 1)
            _feed(h, getattr(obj, field.name), depth + 1)
    elif hasattr(obj, "__dict__"):
        _tag(h, "object", type(obj).__module__, type(obj).__qualname__)
        _feed(h, vars(obj), depth + 1)
    else:
        _feed_pickled(h, obj)


def _feed_value(h, obj: Any) -> bool:
    """Digest what holds no other objects (a number, string, bytes, tensor, array of numbers,
    image); False for anything else."""
    if obj is None or isinstance(obj, (bool, int, float, complex)):
        _tag(h, type(obj).__name__, repr(obj))  # repr is exact: a float's repr reads back as that float
    elif isinstance(obj, str):
        _tag(h, "str", len(obj))
        h.update(obj.encode("utf-8", "surrogatepass"))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = memoryview(obj).cast("B")
        _tag(h, "bytes", len(data))
        h.update(data)
    elif isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().resolve_conj().resolve_neg().contiguous()
        _tag(h, "tensor", tensor.dtype, tuple(tensor.shape))
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, (np.ndarray, np.generic)) and not np.asarray(obj).dtype.hasobject:
        array = np.ascontiguousarray(obj)
        _tag(h, "array", array.dtype.str, array.shape)
        h.update(array.reshape(-1).view(np.uint8))
    elif type(obj).__module__.startswith("PIL.") and hasattr(obj, "tobytes"):
        _tag(h, "image", obj.mode, obj.size)
        h.update(obj.tobytes())
    else:
        return False
    return True


def _feed_pickled(h, obj: Any) -> None:
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - named in the refusal below
        raise DataError(f"cannot compare a stream item of type {type(obj).__name__} between workers ({exc}): "
                        "yield tensors, arrays, numbers, strings, bytes, or lists, tuples and dicts of them") from None
    _tag(h, "pickle", type(obj).__qualname__, len(data))
    h.update(data)
