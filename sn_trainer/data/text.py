"""Text for language models: files tokenised once into a memory-mapped token file, read by every worker.

The tokens (uint16) are written once, atomically, beside the source when its folder is writable,
else in the user's cache directory, and reused while the source files are unchanged. Each
worker maps the same file: the page cache holds it once, whatever the worker count. Every
window of ``block_size`` tokens is a training sample (its targets: the same window one token
on); the last ``test_fraction`` of the tokens is held out, in windows that do not overlap.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError, DataError

TOKENIZERS = ("char", "gpt2")


class TokenWindows(Dataset):
    """Windows of ``block_size`` tokens from [start, stop) of a token file, every ``stride`` tokens."""

    def __init__(self, path: str | os.PathLike, start: int, stop: int, block_size: int, stride: int = 1):
        self.path, self.start, self.stop = str(path), start, stop
        self.block_size, self.stride = block_size, stride
        if stop - start <= block_size:
            raise DataError(f"{path}: {stop - start} tokens cannot make a window of block_size={block_size} and "
                            "its targets; use more text or a smaller dataset.block_size")
        self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")

    def __len__(self) -> int:
        return (self.stop - self.start - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int):
        tokens, targets = self.get_batch(torch.tensor([index]))
        return tokens[0], targets[0]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = self.start + indices.numpy()[:, None] * self.stride + np.arange(self.block_size + 1)
        chunk = torch.from_numpy(self._tokens[offsets].astype(np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def __getstate__(self):  # a worker maps the file itself: nothing of it travels in the pickle
        return {k: v for k, v in self.__dict__.items() if k != "_tokens"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")


@dataclass
class TextSplits:
    train: TokenWindows
    test: TokenWindows
    vocab_size: int
    block_size: int
    decode: Callable[[list[int]], str]
    encode: Callable[[str], list[int]]
    source: str  # where the text and its tokens are, for the log and summary.json


def load_text(path: str | None, tokenizer: str, block_size: int, test_fraction: float,
              cache_dir: str | os.PathLike | None = None) -> TextSplits:
    """Tokenise ``path`` (a UTF-8 file, or a folder of them) once, and split it into windows.

    Raises:
        ConfigError: no path, or an unknown tokenizer.
        DataError: the path holds no readable text.
    """
    if not path:
        raise ConfigError("dataset=text needs dataset.path=<a UTF-8 text file or a folder of them>, e.g. "
                          "/usr/share/common-licenses (on every Debian machine)")
    if tokenizer not in TOKENIZERS:
        raise ConfigError(f"dataset.tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    source = Path(path).expanduser()
    files = _text_files(source)
    token_file = _cached(source, _cache_key(files, tokenizer), cache_dir)
    meta_file = token_file.with_suffix(".json")
    if not meta_file.exists():
        _tokenise(files, tokenizer, token_file, meta_file)
    meta = json.loads(meta_file.read_text())
    encode, decode = _codec(tokenizer, meta)
    n = meta["tokens"]
    split = int(n * (1 - test_fraction))
    train = TokenWindows(token_file, 0, split, block_size)
    test = TokenWindows(token_file, split, n, block_size, stride=block_size)
    return TextSplits(train, test, meta["vocab_size"], block_size, decode, encode,
                      f"{path} ({n} {tokenizer} tokens in {token_file})")


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"dataset.path={str(path)!r} does not exist; give a text file or a folder of them")
    if not files:
        raise DataError(f"{path} holds no files")
    return files


def _cache_key(files: list[Path], tokenizer: str) -> str:
    digest = hashlib.sha256(tokenizer.encode())
    for f in files:
        stat = f.stat()
        digest.update(f"{f.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def _cached(source: Path, key: str, cache_dir) -> Path:
    """Beside the source when that folder is writable, else in the user's cache directory."""
    beside = source if source.is_dir() else source.parent
    name = f".sn_trainer-tokens-{key}.u16"
    if cache_dir is None and os.access(beside, os.W_OK):
        return beside / name
    base = Path(cache_dir) if cache_dir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sn_trainer"
    base.mkdir(parents=True, exist_ok=True)
    return base / name.lstrip(".")


def _tokenise(files: list[Path], tokenizer: str, token_file: Path, meta_file: Path) -> None:
    try:
        text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    except OSError as exc:
        raise DataError(f"cannot read the text ({exc})") from None
    if tokenizer == "char":
        chars = sorted(set(text))
        if len(chars) > 65535:
            raise DataError(f"{len(chars)} distinct characters do not fit uint16 tokens; use dataset.tokenizer=gpt2")
        index = {c: i for i, c in enumerate(chars)}
        tokens = np.fromiter((index[c] for c in text), dtype=np.uint16, count=len(text))
        meta = {"tokenizer": "char", "vocab": chars, "vocab_size": len(chars)}
    else:
        encoding = _gpt2()
        tokens = np.array(encoding.encode_ordinary(text), dtype=np.uint16)
        meta = {"tokenizer": "gpt2", "vocab_size": encoding.n_vocab}
    meta["tokens"] = int(len(tokens))
    # Tokens first, then the metadata that says they are complete: a killed writer leaves no half.
    for target, data in ((token_file, tokens.tobytes()), (meta_file, json.dumps(meta).encode())):
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, target)


def _gpt2():
    try:
        import tiktoken
    except ImportError:
        raise ConfigError("dataset.tokenizer=gpt2 needs tiktoken: pip install tiktoken") from None
    return tiktoken.get_encoding("gpt2")


def _codec(tokenizer: str, meta: dict):
    if tokenizer == "char":
        chars = meta["vocab"]
        index = {c: i for i, c in enumerate(chars)}
        return (lambda s: [index[c] for c in s if c in index]), (lambda ids: "".join(chars[i] for i in ids))
    encoding = _gpt2()
    return encoding.encode_ordinary, encoding.decode
