"""How the launcher and its workers talk: payloads and messages by cloudpickle, tensors in shared
memory as handles (``WorkerPickler``), and tensors by value where they must hold no shared memory
(``pack``)."""
from __future__ import annotations

import collections
import io
import marshal
import pickle
import types
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle
import torch

from ...recipe import metric_states


def _code_reduce(code: types.CodeType):
    """A code object whole, its file name and line table included: cloudpickle names every file
    ``<dynamic-code>`` (for payloads that pickle the same wherever they were made), and a worker's
    traceback through the user's own code would then name no file and show no line."""
    return marshal.loads, (marshal.dumps(code),)  # the launcher and its workers run one interpreter


class WorkerPickler(cloudpickle.Pickler):
    """How a launch and its workers talk, both ways: cloudpickle, so that classes and functions of
    ``__main__`` (a notebook's cells, a script read from stdin, ``python -c``), lambdas and local
    functions travel by value, as Ray, Dask and joblib send them, and come back as the very classes
    they left as (a result holding a script's own optimizer); with multiprocessing's reducers, so
    that tensors in shared memory travel as handles, never as copies."""

    dispatch_table = collections.ChainMap({types.CodeType: _code_reduce}, ForkingPickler._extra_reducers,
                                          cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        if metric_states.is_metric(obj):  # a torchmetrics Metric: its states each worker's own
            return metric_states.reduce_with_private_states(obj)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    WorkerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(dumps(obj))


def pack(obj: Any) -> bytes:
    """Tensors and plain data as bytes: they cross the pipe by value, holding no shared memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
