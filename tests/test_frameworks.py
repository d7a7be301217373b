"""Lightning, Accelerate, a transformers Trainer and a plain DDP script (with DDP's PowerSGD hook), written
for gloo and trained unchanged at 2 processes under ``python -m sn_trainer.launch --cpu-backend=sn``.

Each job (tests/framework_jobs.py) records, on every rank, the backend of the group its DDP wrapper
reduced over and the parameters it trained. The four jobs run one after another in the same two
processes: once under the launcher as they are (gloo), once with the flag ("sn"); and Lightning once
more started by itself with "sn" named in its strategy. The float64 results are checked against each
other and against a plain one-process loop over the same global batches (written here).
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
JOBS = ["accelerate", "hf", "powersgd", "lightning"]
LAUNCHER = [sys.executable, "-m", "sn_trainer.launch", "--nproc-per-node=2", "--monitor-interval=0.5"]
TIGHT = dict(rtol=1e-12, atol=1e-12)
SAYS = 'is made on "sn" (--cpu-backend=sn)'


def run_jobs(out: Path, jobs, flags=(), launched=True, backend=None):
    """Runs ``jobs`` in one pair of processes; returns what each rank recorded per job, and the log."""
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    command = [str(JOB), *jobs, "--out", str(out), *(["--backend", backend] if backend else [])]
    done = subprocess.run([*LAUNCHER, *flags, *command] if launched else [sys.executable, *command], env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = {job: [torch.load(out / f"{job}-rank{rank}.pt", weights_only=True) for rank in range(2)] for job in jobs}
    return ranks, done.stderr


@pytest.fixture(scope="module")
def over_gloo(tmp_path_factory):
    """The jobs as written (gloo), under the launcher."""
    return run_jobs(tmp_path_factory.mktemp("jobs") / "gloo", JOBS)[0]


@pytest.fixture(scope="module")
def redirected(tmp_path_factory):
    """The same jobs, unchanged, under ``--cpu-backend=sn``."""
    return run_jobs(tmp_path_factory.mktemp("jobs") / "flag", JOBS, ["--cpu-backend=sn"])


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


def test_the_log_says_once_that_the_groups_are_made_on_sn_and_why(redirected):
    _, log = redirected
    assert log.count(SAYS) == 1, log[-3000:]  # local rank 0, at its first group; later groups likewise, unsaid
    assert 'the process group asked for "gloo" is made on "sn" (--cpu-backend=sn)' in log


@pytest.mark.parametrize("job", JOBS)
def test_an_unchanged_gloo_job_under_the_flag_reduces_over_sn_to_the_same_weights(job, over_gloo, redirected):
    over_sn = redirected[0][job]
    assert_over(over_sn, "sn")
    assert_over(over_gloo[job], "gloo")
    assert_close_states(over_sn[0]["state"], over_gloo[job][0]["state"], **TIGHT)


@pytest.mark.quick
def test_lightnings_default_ddp_trains_as_a_plain_loop_over_sn(redirected):
    state = redirected[0]["lightning"][0]["state"]
    assert_close_states(state, plain_sgd(4, as_lightning_shuffles, momentum=0.9), rtol=1e-10, atol=1e-12)


def test_lightning_started_by_itself_with_sn_named_trains_as_over_gloo(tmp_path, over_gloo):
    """Without the launcher there is no flag: ``DDPStrategy(process_group_backend="sn")``."""
    ranks = run_jobs(tmp_path / "alone", ["lightning"], launched=False, backend="sn")[0]["lightning"]
    assert_over(ranks, "sn")
    assert_close_states(ranks[0]["state"], over_gloo["lightning"][0]["state"], **TIGHT)


@pytest.mark.parametrize("job, momentum", [("accelerate", 0.9), ("hf", 0.0)])
def test_accelerate_and_transformers_refuse_sn_by_name_and_train_as_a_plain_loop_under_the_flag(redirected, job,
                                                                                              momentum):
    ranks = redirected[0][job]
    assert "sn is not available" in ranks[0]["refused"]
    state = {f"net.{name}": value for name, value in ranks[0]["state"].items()} if job == "accelerate" else \
        ranks[0]["state"]
    assert_close_states(state, plain_sgd(4, in_order, momentum=momentum), rtol=1e-10, atol=1e-12)


def test_the_powersgd_hook_over_sn_compresses_as_over_gloo(over_gloo, redirected):
    over_sn = redirected[0]["powersgd"]
    before, after = over_sn[0]["compressed"]
    assert 0 < after < before  # PowerSGD did compress, from its third step on
    assert over_sn[0]["compressed"] == over_gloo["powersgd"][0]["compressed"]
