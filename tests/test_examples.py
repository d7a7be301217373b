"""The examples in examples/ run as their users run them, at a tiny size. (ddp_train.py runs in
test_benchmarks.py, under torchrun and sn_trainer.launch, as ddp_bench.py's tiny run launches it;
slurm_torchrun.sbatch in test_ecosystem.py and test_elastic.py.)"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TEXT = "/usr/share/common-licenses/GPL-3"  # on every Debian machine


def run(script, *args):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--workers", "2", *args], capture_output=True,
                          text=True, timeout=280, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_word_level_lstm_language_model(tmp_path):
    args = ("--text", TEXT, "--emsize", "32", "--checkpoint-dir", str(tmp_path))
    out = run("word_lm.py", *args, "--max-steps", "6")
    perplexity = float(re.search(r"perplexity ([\d.]+)", out).group(1))
    assert 1 < perplexity < 2000  # a vocabulary of ~1000 words: better than uniform after a few steps
    resumed = run("word_lm.py", *args, "--max-steps", "8", "--resume", "latest")  # the carried state goes on
    assert re.search(r"perplexity ([\d.]+)", resumed)


@pytest.mark.quick
def test_vae_on_fashion_mnist():
    out = run("vae.py", "--max-steps", "6", "--limit", "1024")
    loss = float(re.search(r"test loss ([\d.]+) per image", out).group(1))
    assert 100 < loss < 600  # 784 pixels of BCE: ~543 untrained (ln 2 each), falling


def test_char_gpt_with_nanogpt_style_configure_optimizers():
    out = run("char_gpt.py", "--text", TEXT, "--max-steps", "6", "--n-embd", "32", "--sample-chars", "40",
              "--eval-every", "3", "--eval-batches", "1")
    assert "num decayed parameter tensors: 10" in out  # the method ran, once, in the launcher
    evaluated = re.findall(r"step (\d+): held-out loss [\d.]+, the weights' moving average [\d.]+", out)
    assert evaluated == ["3", "6"]  # every 3 steps, the live weights and their average
    assert float(re.search(r"held-out loss ([\d.]+)", out).group(1)) < 4.4  # ln(76 characters) = 4.33
    sample = out.split("sample:\n", 1)[1]
    assert len(sample.strip("\n")) >= 20


def test_dcgan_on_fashion_mnist(tmp_path):
    out = run("dcgan.py", "--max-steps", "4", "--limit", "512", "--out", str(tmp_path / "grid.png"))
    losses = re.search(r"4 steps: loss D ([\d.]+), G ([\d.]+)", out)
    assert losses and 0 < float(losses.group(1)) < 3 and 0 < float(losses.group(2)) < 5
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simclr_with_activation_checkpointing_on_fashion_mnist():
    out = run("simclr.py", "--max-steps", "6", "--limit", "512", "--batch-size", "32", "--log-every", "1")
    found = re.search(r"NT-Xent ([\d.]+) first, ([\d.]+) last \(gathered over the global batch of 32, 2 workers\); "
                      r"nearest-neighbour accuracy ([\d.]+)", out)
    assert found, out
    first, last, accuracy = map(float, found.groups())
    assert 0 < first < 4.2 and 0 < last < 4.2  # ln(63 other embeddings) = 4.14 for an encoder that tells none apart
    assert 0.1 < accuracy <= 1  # ten classes

