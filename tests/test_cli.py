"""The command line, run for real in subprocesses, from a directory other than the checkout."""
import csv
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers import openmp_registrations, processes_with_marker

pytestmark = pytest.mark.timeout(300)
TINY = ["dataset=synthetic", "dataset.train_size=256", "dataset.test_size=64", "log_every=2"]


def sn_train(args, cwd, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "sn_trainer", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_run_writes_summary_metrics_and_log(tmp_path):
    out = tmp_path / "run"
    proc = sn_train([*TINY, "workers=2", "batch_size=32", "max_steps=6", "dataset.data_seed=1", f"hydra.run.dir={out}"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy" in proc.stdout and "samples/s" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["per_worker_batch"] == 16 and summary["steps"] == 6
    assert summary["channels_last"] is True  # auto, and the default model (lenet) is a conv net
    assert summary["comm"] in ("shm", "gloo") and summary["plan"]["comm"] == summary["comm"]  # what auto chose
    assert summary["precision"] == summary["plan"]["precision"] == "fp32"
    assert 0 <= summary["test_accuracy"] <= 1 and summary["samples_per_sec"] > 0
    assert summary["peak_memory_bytes"] > 0
    assert set(summary["stage_seconds"]) == {"data", "forward", "backward", "reduce", "update", "verify", "wait"}
    assert summary["machine"]["physical_cores"] >= 1 and summary["config"]["batch_size"] == 32
    assert summary["config"]["dataset"]["data_seed"] == 1 and summary["config"]["seed"] == 0  # one name each
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r["loss"]] == [2, 4, 6]
    assert summary["weights"] == ["model.safetensors"] and (out / "model.safetensors").stat().st_size > 0
    assert rows[-1]["eval_accuracy"] != ""
    assert (out / "__main__.log").exists() or any(out.glob("*.log"))


@pytest.mark.alone  # what it asserts of /dev/shm holds only with no other test beside it
def test_multirun_two_by_two_leaves_nothing_behind(tmp_path):
    """Intel's OpenMP in the workers and their fork server, as tuning tries it: it registers each
    process in /dev/shm until its exit handler runs, which none of them reaches; nothing stays."""
    marker = uuid.uuid4().hex
    sweep = tmp_path / "sweep"
    before = openmp_registrations()
    proc = sn_train(["--multirun", *TINY, "batch_size=16,32", "workers=1,2", "max_steps=3", "openmp=intel",
                     f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={"SN_TEST_MARKER": marker})
    assert proc.returncode == 0, proc.stderr
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted((s["batch_size"], s["workers"]) for s in summaries) == [(16, 1), (16, 2), (32, 1), (32, 2)]
    assert all(s["plan"]["openmp"] == "intel" for s in summaries)
    assert processes_with_marker(marker) == []
    assert openmp_registrations() - before == set()


@pytest.mark.parametrize("args, message", [
    ([*TINY, "batch_size=1", "workers=2"], "error: batch_size=1 is smaller than workers=2"),
    ([*TINY, "model.name=lenet5"], "error: unknown model 'lenet5'; choose one of lenet, cifar10_quick, "),
    ([*TINY, "optim.lr=-1"], "error: optim.lr must be > 0, got -1"),
    (["dataset=mnist", "dataset.root=/nonexistent"], "error: mnist not found. Provide it one of three ways"),
    ([*TINY, "+batchsize=3"], "error: unknown setting batchsize; did you mean batch_size? (every key: "),
    pytest.param([*TINY, "batchsize=3"], "error: unknown setting batchsize; did you mean batch_size? (every key: ",
                 marks=pytest.mark.quick),  # no Hydra +
    ([*TINY, "--multirun", "optim.momentm=0.5,0.9"], "error: unknown setting optim.momentm; did you mean optim.mom"),
    ([*TINY, "optim.momentum=abc"], "error: optim.momentum must be a number, got 'abc'"),
    ([*TINY, "dataset.num_classes=abc"], "error: dataset.num_classes must be an integer, got 'abc'"),
    ([*TINY, "dataset.seed=3"], "error: dataset.seed is now called dataset.data_seed (it seeds the synthetic data, "),
    # A real key that the chosen option does not read: refused before Hydra, not left to its advice to add it with +.
    (["dataset.data_seed=3", "max_steps=1"], "error: dataset.data_seed does not apply to dataset=fashion_mnist (its "
                                             "settings: name, root, download, augment); dataset=folder and "
                                             "dataset=synthetic have it: choose one of them, or leave it out"),
    ([*TINY, "+dataset.root=/data"], "error: dataset.root does not apply to dataset=synthetic ("),  # once ran, unread
    ([*TINY, "model.dropout=0.1"], "error: model.dropout does not apply to model=lenet (its settings: name); "
                                   "model=gpt has it: choose it, or leave it out"),
    ([*TINY, "--multirun", "optim=sgd,adamw", "optim.nesterov=true"], "error: optim.nesterov does not apply to "
                                                                      "optim=adamw ("),
    (["+experiment=gpt_text", "dataset.root=/data"], "error: dataset.root does not apply to dataset=text ("),
])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, args, message):
    proc = sn_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr


def image_folder(root: Path) -> Path:
    """train/ and test/, two classes of four 10x10 JPEGs each."""
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(4):
                colour = (60 * i, 90, 200 if cls == "a" else 20)
                Image.new("RGB", (10, 10), colour).save(root / split / cls / f"{i}.jpg")
    return root


def test_the_imagenet_recipe_runs_from_the_command_line(tmp_path):
    """dataset.augment=resized_crop: random resized crops of the 8x8 images to 6, a center crop to test."""
    out = tmp_path / "run"
    proc = sn_train(["dataset=folder", f"dataset.root={image_folder(tmp_path / 'images')}", "dataset.image_size=8",
                     "dataset.augment=resized_crop", "dataset.crop_size=6", "model=mlp", "batch_size=4", "workers=2",
                     "max_steps=2", f"hydra.run.dir={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 <= summary["test_accuracy"] <= 1, summary
    assert summary["config"]["dataset"]["augment"] == "resized_crop" and summary["config"]["dataset"]["crop_size"] == 6


@pytest.mark.parametrize("bad", ["train/b/3.jpg", "test/a/1.jpg"])
def test_an_image_file_nothing_decodes_is_one_line_naming_it(tmp_path, bad):
    """A PNG named .jpg is read (as ImageFolder reads it); a file neither torchvision nor Pillow
    decodes is named in one line, whether the launcher reads it (the training set's statistics) or
    a worker does (the first evaluation batch)."""
    from PIL import Image

    root = image_folder(tmp_path / "images")
    Image.new("RGB", (10, 10), (1, 2, 3)).save(root / "train" / "a" / "png-named.jpg", format="PNG")
    (root / bad).write_bytes(b"\xff\xd8\xff\xe0 and then nothing a decoder reads")
    proc = sn_train(["dataset=folder", f"dataset.root={root}", "dataset.image_size=8", "model=mlp", "batch_size=4",
                     "workers=2", "max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and re.fullmatch(
        rf"error: {re.escape(str(root / bad))}: not an image that torchvision or Pillow can decode \(\w[^)]*\); "
        "replace the file with a readable image, or remove it from the folder", error_lines[0]), proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_group_option_lists_the_available_ones(tmp_path):
    proc = sn_train(["model=lenet5", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "Could not find 'model/lenet5'" in proc.stderr
    assert "cifar10_quick" in proc.stderr and "lenet" in proc.stderr


def test_installed_package_carries_its_configs(tmp_path):
    """A wheel, installed away from the checkout, composes its config from inside the package."""
    root = Path(__file__).resolve().parents[1]
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheel_dir), str(root)], capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr
    wheel = next(wheel_dir.glob("sn_trainer-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=240)
    assert install.returncode == 0, install.stderr
    env = {"PYTHONPATH": str(target)}
    proc = sn_train(["--cfg", "job", "model=cifar10_quick", "optim=adamw"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "name: cifar10_quick" in proc.stdout and "name: adamw" in proc.stdout
    where = subprocess.run([sys.executable, "-c", "import sn_trainer; print(sn_trainer.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, env={**os.environ, **env})
    assert where.stdout.startswith(str(target))


def test_progress_bar_on_a_terminal_and_log_lines_on_a_pipe(tmp_path):
    """On a terminal (tmux, with a real screen size) a bar; on a pipe, log lines instead."""
    import shlex
    import time

    session, out = f"sn{uuid.uuid4().hex[:8]}", tmp_path / "tty"
    command = shlex.join([sys.executable, "-m", "sn_trainer", *TINY, "workers=1", "batch_size=32", "max_steps=4",
                          f"hydra.run.dir={out}"])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "220", "-y", "50", f"{command}; sleep 60"],
                   check=True, cwd=tmp_path, timeout=30)
    try:
        deadline, screen = time.monotonic() + 120, ""
        while "test accuracy" not in screen:  # the run's last line: the pane is final then
            assert time.monotonic() < deadline, f"the run in tmux did not finish:\n{screen}"
            time.sleep(0.2)  # polling another process's screen; there is nothing to wait on instead
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                                    check=True, timeout=30).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=30)
    assert "4/4" in screen and "loss=" in screen and "samples_s=" in screen, screen  # tqdm's bar and postfix
    piped = sn_train([*TINY, "workers=1", "batch_size=32", "max_steps=4", f"hydra.run.dir={tmp_path / 'pipe'}"],
                     cwd=tmp_path)
    assert "4/4" not in piped.stdout + piped.stderr and "step 4 (epoch" in piped.stdout
