"""A worker that raises or dies stops the run fast, with its story, and leaves nothing behind."""
import functools
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

from helpers import Bomb, SmallConvNet, tiny_dataset
from sn_trainer import ConfigError, Trainer, WorkerFailed

pytestmark = pytest.mark.timeout(120)
SGD = functools.partial(torch.optim.SGD, lr=0.05)


def failing_fit(tmp_path, action):
    flag = tmp_path / "flag"
    model = Bomb(SmallConvNet(), str(flag), action)
    with pytest.raises(WorkerFailed) as caught:
        Trainer(workers=2, batch_size=8, max_steps=50).fit(model, tiny_dataset(), optimizer=SGD)
    failed_at = float(flag.read_text().split()[0])
    return caught.value, time.time() - failed_at


def test_a_worker_that_raises_stops_fit_with_its_traceback(tmp_path, no_leaks):
    error, seconds = failing_fit(tmp_path, "raise")
    assert "boom: injected failure" in str(error)
    assert "Traceback" in str(error) and f"worker {error.rank} failed" in str(error)
    assert seconds < 10


@pytest.mark.quick
def test_a_sigkilled_worker_stops_fit_naming_the_signal(tmp_path, no_leaks):
    error, seconds = failing_fit(tmp_path, "kill")
    assert "killed by SIGKILL" in str(error)
    assert seconds < 10


@pytest.mark.timeout(60)
def test_a_worker_stopped_halfway_through_a_message_is_still_watched(no_leaks):
    from helpers import stops_halfway_through_a_message
    from sn_trainer.engine import Heartbeats, Watchdog, run_workers

    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="worker 0 failed: made no progress for"):
        run_workers(stops_halfway_through_a_message, [None], watchdog=Watchdog(Heartbeats.allocate(1), 2.0), tick_s=0.2)
    assert time.monotonic() - started < 20


def test_lambdas_and_local_functions_reach_the_workers(no_leaks):
    scale = 0.1

    def optimizer(params):  # local, with a closure
        return torch.optim.SGD(params, lr=scale)

    result = Trainer(workers=2, batch_size=8, max_steps=2).fit(ModelWithLambda(), tiny_dataset(), optimizer=optimizer,
                                                               loss_fn=lambda out, y: F.cross_entropy(out, y))
    assert result.steps == 2 and result.plan["loss_form"] == "mean"


def test_two_runs_at_once_both_succeed(no_leaks):
    models = []
    for _ in range(2):  # built here, not in the threads: torch's global RNG is shared between them
        torch.manual_seed(0)
        models.append(SmallConvNet())

    def run(model):
        Trainer(workers=2, batch_size=8, max_steps=10, seed=5).fit(model, tiny_dataset(), optimizer=SGD)
        return model

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(run, models)
    assert not torch.equal(first.fc.weight, SmallConvNet().fc.weight)
    for p, q in zip(first.parameters(), second.parameters()):
        assert torch.equal(p, q)


class DictDataset(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.zeros(1, 8, 8), "y": 0}


class Stream(IterableDataset):
    """A stream without a length."""

    def __iter__(self):
        return iter(tiny_dataset(n=10))


class ModelWithLambda(SmallConvNet):
    def __init__(self):
        super().__init__()
        self.activation = lambda x: torch.relu(x)  # travels by value (cloudpickle), as a notebook's code does

    def forward(self, x):
        return self.fc(self.activation(self.conv(x)).flatten(1))


class ModelWithALock(SmallConvNet):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()  # no process can receive a lock


@pytest.mark.unit
@pytest.mark.parametrize("settings, message", [
    (dict(workers=0), "workers must be >= 1"),
    (dict(workers=2, batch_size=1), "batch_size=1 is smaller than workers=2"),
    (dict(threads=0), "threads must be >= 1"),
    (dict(workers="many"), "workers must be a positive integer or 'auto'"),
    (dict(reduce="broadcast"), "reduce must be one of all_reduce, reduce_scatter"),
    (dict(accumulate=0), "accumulate must be >= 1"),
    (dict(epochs=0), "epochs must be >= 1"),
    (dict(clip_grad_norm="abc"), "^clip_grad_norm must be > 0 or null, got 'abc'$"),
])
def test_bad_settings_are_refused_up_front(settings, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(**settings)


def test_bad_arguments_to_fit_are_refused_before_any_process_starts(no_leaks):
    trainer = Trainer(workers=2, batch_size=8, max_steps=1)
    with pytest.raises(ConfigError, match=r"the model cannot be sent to a worker process \(cannot pickle '_thread.lock'"):
        trainer.fit(ModelWithALock(), tiny_dataset(), optimizer=SGD)
    with pytest.raises(ConfigError, match=r"not an \(input, target\) pair"):
        trainer.fit(SmallConvNet(), DictDataset(), optimizer=SGD)
    with pytest.raises(ConfigError, match="fewer than one step's batch"):
        trainer.fit(SmallConvNet(), tiny_dataset(n=5), optimizer=SGD)
    with pytest.raises(ConfigError, match="the optimizer factory cannot be sent"):
        trainer.fit(SmallConvNet(), tiny_dataset(), optimizer=functools.partial(torch.optim.SGD, lr=threading.Lock()))
    with pytest.raises(ConfigError, match=r"^train_set is a DataLoader; pass its dataset and collate function, "
                                          r"fit\(train_set=loader.dataset, collate_fn=loader.collate_fn\), and the "
                                          r"batch size as Trainer\(batch_size=...\)"):
        trainer.fit(SmallConvNet(), DataLoader(tiny_dataset(), batch_size=8), optimizer=SGD)
    with pytest.raises(ConfigError, match=r"^train_set is a stream without a length \(no __len__\): set max_steps="):
        Trainer(workers=2, batch_size=8, epochs=1).fit(SmallConvNet(), Stream(), optimizer=SGD)


def test_a_script_that_trains_at_import_is_told_to_guard_it(tmp_path):
    # Workers import the script's main module, as spawn does; unguarded, it would train again there.
    script = tmp_path / "unguarded.py"
    script.write_text(f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                      "from helpers import SmallConvNet, tiny_dataset\n"
                      "from sn_trainer import Trainer\n"
                      "Trainer(workers=2, batch_size=8, max_steps=1)"
                      ".fit(SmallConvNet(), tiny_dataset())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sn_trainer.errors.WorkerFailed: worker") and 'if __name__ == "__main__":' in last
    assert "bootstrapping phase" not in done.stderr


def test_an_image_no_decoder_reads_met_mid_run_is_one_data_error_naming_it(tmp_path, no_leaks, caplog):
    """A worker that meets an unreadable file stops the run with the file's name as bad input (no
    restart mends it), not as a failed worker's traceback; the checkpoints written before are whole."""
    from PIL import Image

    from helpers import plain_indices
    from sn_trainer.checkpoint.loading import load
    from sn_trainer.data.folder import ImageFiles
    from sn_trainer.errors import DataError

    files = []
    for i in range(24):
        Image.new("RGB", (8, 8), (10 * i, 50, 90)).save(tmp_path / f"{i}.png")
        files.append(str(tmp_path / f"{i}.png"))
    bad = files[int(plain_indices(24, 4, seed=0, step=3)[0])]  # read by worker 0 for step 4, after 3 steps
    with open(bad, "r+b") as file:
        file.truncate(30)
    data = ImageFiles(files, [i % 3 for i in range(24)], 8, [0.5] * 3, [0.25] * 3, 3)
    with pytest.raises(DataError) as caught:
        Trainer(workers=2, batch_size=4, epochs=1, seed=0, max_restarts=2, checkpoint_dir=str(tmp_path / "ckpt"),
                checkpoint_every_steps=1).fit(SmallConvNet(channels=3), data, optimizer=SGD)
    assert str(caught.value).startswith(f"{bad}: not an image that torchvision or Pillow can decode (")
    assert "\n" not in str(caught.value) and "restart" not in caplog.text
    saved = sorted((tmp_path / "ckpt").glob("step-*.pt"))
    assert saved and all(load(path)["step"] == int(path.stem[5:]) for path in saved)
