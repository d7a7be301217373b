"""Language models from the command line: text to tokens, the GPT, TensorBoard, a shared machine told apart."""
import copy
import functools
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch

from helpers import assert_exact, plain_fit
from sn_trainer import Trainer
from sn_trainer.data import text as text_data
from sn_trainer.data.text import load_text
from sn_trainer.models.gpt import GPT, decay_groups, language_model_step

pytestmark = pytest.mark.timeout(300)
SAMPLE = "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs!\n" * 12


def write_text(tmp_path, content=SAMPLE):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(content[: len(content) // 2])
    (folder / "b.txt").write_text(content[len(content) // 2 :])
    return folder


@pytest.mark.unit
def test_text_becomes_a_shared_token_file_of_windows_and_a_held_out_tail(tmp_path):
    folder = write_text(tmp_path)
    data = load_text(str(folder), "char", block_size=8, test_fraction=0.25)
    text = "\n".join([SAMPLE[: len(SAMPLE) // 2], SAMPLE[len(SAMPLE) // 2 :]])
    tokens = torch.tensor(data.encode(text))
    assert data.decode(tokens.tolist()) == text  # round trip
    assert data.vocab_size == len(set(text))
    split = int(len(tokens) * 0.75)
    x, y = data.train.get_batch(torch.tensor([0, 5, len(data.train) - 1]))
    for row, start in zip(range(3), (0, 5, len(data.train) - 1)):
        assert torch.equal(x[row], tokens[start : start + 8]) and torch.equal(y[row], tokens[start + 1 : start + 9])
    assert len(data.train) == split - 8  # every window whose targets stay in the training part
    x, y = data.test.get_batch(torch.arange(len(data.test)))
    assert torch.equal(x[0], tokens[split : split + 8]) and torch.equal(x[1], tokens[split + 8 : split + 16])
    assert torch.equal(y[-1][-1], tokens[split + 8 * len(data.test)])  # non-overlapping, within the tail
    assert len(pickle.dumps(data.train)) < 1000  # a worker maps the file: no token travels in the pickle
    token_file = next(folder.glob(".sn_trainer-tokens-*.u16"))  # beside the source, its folder being writable
    written = token_file.stat().st_mtime_ns
    load_text(str(folder), "char", block_size=8, test_fraction=0.25)
    assert token_file.stat().st_mtime_ns == written  # reused, not written again
    (folder / "a.txt").write_text("changed")
    load_text(str(folder), "char", block_size=8, test_fraction=0.25)
    assert len(list(folder.glob(".sn_trainer-tokens-*.u16"))) == 2  # a changed source is tokenised anew


class StubBPE:
    """Stands in for tiktoken's GPT-2 encoding (which is downloaded on first use): one token per word."""

    n_vocab = 50257

    def encode_ordinary(self, s):
        return [hash(w) % 50000 for w in s.split(" ")]

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.unit
def test_gpt2_tokens_fit_the_token_file(tmp_path, monkeypatch):
    monkeypatch.setattr(text_data, "_gpt2", StubBPE)
    data = load_text(str(write_text(tmp_path)), "gpt2", block_size=4, test_fraction=0.2, cache_dir=tmp_path / "cache")
    assert data.vocab_size == 50257
    x, _ = data.train.get_batch(torch.arange(3))
    assert x.max() < 50257 and x.dtype == torch.int64
    assert list((tmp_path / "cache").glob("sn_trainer-tokens-*.u16"))  # the cache directory asked for


@pytest.mark.parametrize("workers", [pytest.param(2, marks=pytest.mark.quick), 3])
def test_the_gpt_with_tied_embeddings_and_decay_groups_matches_one_process(tmp_path, workers):
    data = load_text(str(write_text(tmp_path)), "char", block_size=8, test_fraction=0.2)
    torch.manual_seed(0)
    model = GPT(data.vocab_size, 8, n_layer=2, n_head=2, n_embd=16).double()
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    reference = plain_fit(copy.deepcopy(model), data.train, 7, steps=4, seed=1,
                          optimizer=lambda m: sgd(decay_groups(m, 0.1)), loss=language_model_step)
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=1).fit(
        model, data.train, optimizer=sgd, step_fn=language_model_step,
        param_groups=functools.partial(decay_groups, weight_decay=0.1))
    assert model.head.weight is model.wte.weight
    assert_exact(model, reference)


def test_gpt_from_the_command_line_writes_a_sample_and_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sn_trainer", "+experiment=gpt_text",
                           f"dataset.path={write_text(tmp_path)}", "dataset.block_size=16", "model.n_layer=1",
                           "model.n_embd=32", "max_steps=6", "log_every=2", "workers=2", "batch_size=8",
                           f"hydra.run.dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "never reaching the 0.002 asked" in proc.stdout + proc.stderr  # a warm-up of 100 steps in a run of 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
    assert summary["tokens_per_sec"] == pytest.approx(summary["samples_per_sec"] * 16)
    assert len((out / "sample.txt").read_text()) > 100 and "sample:" in proc.stdout
    events = EventAccumulator(str(out))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "speed/samples_per_sec", "speed/tokens_per_sec", "eval/loss",
            "stage_ms/forward", "stage_ms/reduce", "cpu_percent/core0"} <= tags, tags
    for tag in tags:
        assert all(math.isfinite(e.value) for e in events.Scalars(tag)), tag
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]


def test_a_busy_machine_is_told_apart_and_said(tmp_path, caplog):
    from helpers import SmallConvNet, tiny_dataset

    burn = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(max(1, os.cpu_count() - 1))]
    try:
        result = Trainer(workers=1, batch_size=8, max_steps=150).fit(SmallConvNet(), tiny_dataset(n=1200))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert result.other_cpu_percent > 20  # every core but the worker's was busy with something else
    assert "other processes used" in caplog.text and "the speeds measured mean little" in caplog.text
