"""Lightning, Accelerate, a transformers Trainer and DDP's PowerSGD hook, trained for real at 2 processes over "sn".

Each job (tests/framework_jobs.py) records, on every rank, the backend of the group its DDP wrapper
reduced over and the parameters it trained. The float64 results are checked against gloo's and
against a plain one-process loop over the same global batches (written here).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data.distributed import DistributedSampler

from framework_jobs import regression_data, small_net

pytestmark = pytest.mark.timeout(300)
TESTS = Path(__file__).parent
JOB = TESTS / "framework_jobs.py"
LAUNCHER = [sys.executable, "-m", "sn_trainer.launch", "--nproc-per-node=2", "--monitor-interval=0.5"]
TIGHT = dict(rtol=1e-12, atol=1e-12)


def run_job(tmp_path, job, backend, launched=True, steps=4):
    """Runs one job at 2 processes and returns what each rank recorded."""
    out = tmp_path / f"{job}-{backend}-{'launched' if launched else 'alone'}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    command = [str(JOB), job, "--backend", backend, "--out", str(out), "--steps", str(steps)]
    done = subprocess.run([*LAUNCHER, *command] if launched else [sys.executable, *command], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def assert_over(ranks, backend):
    """Both ranks reduced over a 2-process group of this backend and hold the same parameters."""
    for found in ranks:
        assert (found["backend"], found["world_size"]) == (backend, 2)
        # The backend inside the group: sn_trainer's shared-memory one, not gloo under another name.
        assert found["backend_class"] == {"sn": "SnBackend", "gloo": "ProcessGroupGloo"}[backend]
    for name, value in ranks[0]["state"].items():
        assert torch.equal(ranks[1]["state"][name], value), name


def assert_close_states(state, reference, **tolerance):
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, **tolerance)


def in_order(step, per_rank=4):
    """Global batch ``step`` of a sequential loader split by batches (Accelerate, transformers)."""
    return list(range(step * 2 * per_rank, (step + 1) * 2 * per_rank))


def as_lightning_shuffles(step, per_rank=4):
    """Lightning's DDP puts a shuffling DistributedSampler (seed 0) under every training loader."""
    shards = [list(DistributedSampler(range(48), num_replicas=2, rank=rank, shuffle=True, seed=0)) for rank in (0, 1)]
    return [i for shard in shards for i in shard[step * per_rank : (step + 1) * per_rank]]


def plain_sgd(steps, batch_rows, momentum=0.0):
    """One process, each global batch (both ranks' rows) at once, torch's SGD."""
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    x, y = regression_data()
    for step in range(steps):
        rows = batch_rows(step)
        optimizer.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return {f"net.{name}": value for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def lightning_over_gloo(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("gloo"), "lightning", "gloo", launched=False)


@pytest.mark.parametrize("launched", [False, True], ids=["started-by-lightning", "under-the-launcher"])
def test_lightning_ddp_over_sn_trains_as_over_gloo(tmp_path, lightning_over_gloo, launched):
    ranks = run_job(tmp_path, "lightning", "sn", launched=launched)
    assert_over(ranks, "sn")
    assert_over(lightning_over_gloo, "gloo")
    assert_close_states(ranks[0]["state"], lightning_over_gloo[0]["state"], **TIGHT)
    assert_close_states(ranks[0]["state"], plain_sgd(4, as_lightning_shuffles, momentum=0.9), rtol=1e-10,
                        atol=1e-12)


def test_accelerate_refuses_sn_by_name_and_trains_over_a_group_made_first(tmp_path):
    ranks = run_job(tmp_path, "accelerate", "sn")
    assert "sn is not available" in ranks[0]["refused"]
    assert_over(ranks, "sn")
    state = {f"net.{name}": value for name, value in ranks[0]["state"].items()}
    assert_close_states(state, plain_sgd(4, in_order, momentum=0.9), rtol=1e-10, atol=1e-12)


def test_transformers_trainer_refuses_sn_by_name_and_trains_over_a_group_made_first(tmp_path):
    ranks = run_job(tmp_path, "hf", "sn")
    assert "sn is not available" in ranks[0]["refused"]
    assert_over(ranks, "sn")
    assert_close_states(ranks[0]["state"], plain_sgd(4, in_order), rtol=1e-10, atol=1e-12)


def test_powersgd_hook_over_sn_compresses_and_agrees_with_gloo(tmp_path):
    over_sn, over_gloo = run_job(tmp_path, "powersgd", "sn", steps=5), run_job(tmp_path, "powersgd", "gloo", steps=5)
    assert_over(over_sn, "sn")
    assert_over(over_gloo, "gloo")
    before, after = over_sn[0]["compressed"]
    assert 0 < after < before  # PowerSGD did compress, from its third step on
    assert over_sn[0]["compressed"] == over_gloo[0]["compressed"]
    assert_close_states(over_sn[0]["state"], over_gloo[0]["state"], **TIGHT)
