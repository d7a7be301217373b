"""What a shared machine can see and touch: loopback only, no code from files, owner-only modes."""
import json
import os
import pickle
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from helpers import SmallConvNet, in_a_worker, tiny_dataset
from sn_trainer import CheckpointError, DataError, Trainer
from sn_trainer import checkpoint
from sn_trainer.cli.run_config import DatasetConfig
from sn_trainer.cli.named_datasets import load_datasets

pytestmark = pytest.mark.timeout(240)


class SocketProbe(nn.Module):
    """On its third forward (a worker's third step; the preflight, without an evaluation set, calls
    it twice), each worker writes down its listening sockets and /dev/shm entries."""

    def __init__(self, inner, out_dir):
        super().__init__()
        self.inner, self.out_dir, self.calls = inner, out_dir, 0

    def forward(self, x):
        import psutil

        self.calls += in_a_worker()
        if self.calls == 3:
            listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"]
            record = {"listening": listening, "shm": os.listdir("/dev/shm")}
            with open(os.path.join(self.out_dir, f"{os.getpid()}.json"), "w") as f:
                json.dump(record, f)
        return self.inner(x)


@pytest.mark.parametrize("comm", ["gloo", pytest.param("auto", marks=pytest.mark.quick)])
@pytest.mark.alone  # what it asserts of /dev/shm holds only with no other test beside it
def test_no_socket_listens_beyond_loopback(tmp_path, comm):
    shm_before = set(os.listdir("/dev/shm"))
    model = SocketProbe(SmallConvNet(), str(tmp_path))
    Trainer(workers=2, batch_size=8, max_steps=4, comm=comm).fit(model, tiny_dataset())
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(records) == 2
    for record in records:
        assert all(ip in ("127.0.0.1", "::1") for ip in record["listening"]), record
        assert set(record["shm"]) - shm_before == set()  # shared memory is unlinked as soon as mapped
    if comm == "gloo":
        assert all(record["listening"] for record in records)  # gloo did listen, on loopback


class Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    target = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": "sn_trainer-checkpoint", "version": 1, "payload": Payload(target)}, path)
    with pytest.raises(CheckpointError, match="would run code or build arbitrary objects"):
        checkpoint.load(path)
    assert not target.exists()
    with pytest.raises(CheckpointError, match="would run code"):
        Trainer(workers=1, batch_size=4, max_steps=2, resume=str(path)).fit(SmallConvNet(), tiny_dataset())
    assert not target.exists()


def test_a_cifar_batch_that_would_run_code_is_refused(tmp_path):
    target = tmp_path / "pwned"
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    good = {b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0, 1]}
    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        (folder / name).write_bytes(pickle.dumps(good))
    (folder / "test_batch").write_bytes(pickle.dumps({**good, b"labels": Payload(target)}))
    with pytest.raises(DataError, match="not a readable CIFAR-10 batch"):
        load_datasets(DatasetConfig(name="cifar10", root=str(tmp_path)))
    assert not target.exists()


def test_checkpoints_are_owner_only(tmp_path):
    ckpt = tmp_path / "deep" / "ckpt"
    Trainer(workers=2, batch_size=8, max_steps=2, checkpoint_dir=str(ckpt)).fit(SmallConvNet(), tiny_dataset())
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o700
    files = list(ckpt.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_the_output_directory_gets_no_environment_secrets(tmp_path):
    secret = "s3cr3t-" + os.urandom(8).hex()
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sn_trainer", "dataset=synthetic", "dataset.train_size=64",
                           "dataset.test_size=16", "batch_size=16", "workers=2", "max_steps=2",
                           f"hydra.run.dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=200,
                          env={**os.environ, "MY_API_TOKEN": secret})
    assert proc.returncode == 0, proc.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "summary.json" for p in written)
    for path in written:
        assert secret.encode() not in path.read_bytes(), path
