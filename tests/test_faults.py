"""Checkpoints, exact resume, restarts, signals, divergence: with real processes and real signals."""
import csv
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import torch

from helpers import Bomb, NaNAt, NaNGradAt, SmallConvNet, processes_with_marker, tiny_dataset
from sn_trainer import CheckpointError, ConfigError, Trainer, TrainingDiverged
from sn_trainer import checkpoint
from sn_trainer.checkpoint import CheckpointDir

pytestmark = pytest.mark.timeout(240)
SGD = __import__("functools").partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)


def fit(model, tmp_path, steps=12, **settings):
    settings = {"workers": 2, "batch_size": 8, "max_steps": steps, "seed": 3, "comm": "shm",
                "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every_steps": 2, **settings}
    return Trainer(**settings).fit(model, tiny_dataset(), optimizer=SGD)


def fresh(wrapper=None):
    torch.manual_seed(0)
    model = SmallConvNet()
    return wrapper(model) if wrapper else model


def assert_identical(a, b):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_checkpoints_hold_everything_and_keep_the_last_k(tmp_path, no_leaks):
    model = fresh()
    result = fit(model, tmp_path, checkpoint_keep=2)
    directory = CheckpointDir(tmp_path / "ckpt")
    assert [s for s, _ in directory.steps()] == [10, 12]
    saved = checkpoint.load(directory.latest())
    assert (saved["format"], saved["version"], saved["step"], len(saved["rng"])) == ("sn_trainer-checkpoint", 3, 12, 2)
    assert {tuple(sorted(r)) for r in saved["rng"]} == {("numpy", "random", "torch")}  # every worker's three streams
    state = saved["optimizer"]["state"]
    assert list(state) == [name for name, _ in model.named_parameters()]  # gathered from both shards, by name
    for name, p in model.named_parameters():
        assert state[name]["momentum_buffer"].shape == p.shape
    assert_identical(model, _loaded(saved))
    assert result.last_checkpoint == str(directory.latest())
    assert oct(directory.latest().stat().st_mode & 0o777) == "0o600"


def _loaded(saved):
    model = SmallConvNet()
    model.load_state_dict(saved["model"])
    return model


def test_resume_continues_bit_exactly(tmp_path, no_leaks):
    whole = fresh()
    fit(whole, tmp_path / "whole")
    first_half = fresh()
    fit(first_half, tmp_path / "split", steps=6)
    resumed = fresh()  # the checkpoint, not this model's values, decides where training goes on
    fit(resumed, tmp_path / "split", resume="latest")
    assert_identical(whole, resumed)


def test_resume_with_another_worker_count_is_exact_but_for_rounding(tmp_path):
    whole = fresh()
    fit(whole, tmp_path / "whole")
    fit(fresh(), tmp_path / "split", steps=6)
    resumed = fresh()
    fit(resumed, tmp_path / "split", resume="latest", workers=1)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_resume_with_the_other_memory_layout_is_exact_but_for_rounding(tmp_path):
    def two_convs():  # 3 input channels to the second: channels_last really reorders its weight
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                   torch.nn.Linear(64, 3))

    whole = two_convs()
    fit(whole, tmp_path / "whole", channels_last=False)
    fit(two_convs(), tmp_path / "split", steps=6, channels_last=True)
    resumed = two_convs()
    fit(resumed, tmp_path / "split", resume="latest", channels_last=False)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_sigkilled_worker_restarts_from_checkpoint_bit_exactly(tmp_path, no_leaks):
    reference = fresh(lambda m: Bomb(m, str(tmp_path / "never"), "kill", at_call=10**9))
    fit(reference, tmp_path / "reference")
    flag = tmp_path / "flag"
    model = fresh(lambda m: Bomb(m, str(flag), "kill", at_call=7))
    result = fit(model, tmp_path / "restarted", max_restarts=1)
    assert flag.exists() and result.restarts == 1
    assert_identical(reference, model)


def test_without_restarts_a_dead_worker_is_an_error(tmp_path, no_leaks):
    """With Intel's OpenMP in the workers (it registers each in /dev/shm until its exit handler runs):
    neither the killed worker nor the one torn down leaves its registration (no_leaks)."""
    from sn_trainer import WorkerFailed

    model = fresh(lambda m: Bomb(m, str(tmp_path / "flag"), "kill", at_call=3))
    with pytest.raises(WorkerFailed, match="killed by SIGKILL"):  # spawned: a fork server would outlive the test
        fit(model, tmp_path, max_restarts=0, openmp="intel", start_method="spawn")


def test_non_finite_loss_stops_naming_the_step_and_saves_nothing_non_finite(tmp_path, no_leaks):
    model = fresh(lambda m: NaNAt(m, at_call=5))
    with pytest.raises(TrainingDiverged, match="non-finite at step 5"):
        fit(model, tmp_path)
    steps = CheckpointDir(tmp_path / "ckpt").steps()
    assert [s for s, _ in steps] == [2, 4]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_finite_loss_can_be_skipped_and_counted(tmp_path, no_leaks):
    model = fresh(lambda m: NaNAt(m, at_call=5))
    result = fit(model, tmp_path, on_nan="skip")
    assert result.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_a_non_finite_gradient_in_one_worker_stops_them_all(tmp_path, comm, no_leaks):
    model = fresh(lambda m: NaNGradAt(m, at_call=5, rank=1))
    with pytest.raises(TrainingDiverged, match="non-finite at step 5"):
        fit(model, tmp_path, comm=comm)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_checkpoint_write_killed_midway_leaves_the_previous_one(tmp_path):
    fit(fresh(), tmp_path, steps=2)
    directory = CheckpointDir(tmp_path / "ckpt")
    before = directory.latest().read_bytes()
    # A writer that dies (SIGKILL) after writing part of the next checkpoint.
    script = f"""
import os, signal, torch
from sn_trainer import checkpoint
saved = checkpoint.load({str(directory.latest())!r})
saved["step"] = 4
real_save = torch.save
def dying_save(obj, f):
    f.write(b"PK\\x03\\x04 partial")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
checkpoint.CheckpointDir({str(directory.path)!r}).save(saved)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert list(directory.path.glob(".step-000000004.pt.tmp-*"))  # the torn file is there...
    assert [s for s, _ in directory.steps()] == [2]  # ...but it is not a checkpoint
    assert checkpoint.load(directory.latest())["step"] == 2
    assert directory.latest().read_bytes() == before


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoints_are_refused_and_left_as_they_are(tmp_path, damage):
    fit(fresh(), tmp_path, steps=2)
    path = CheckpointDir(tmp_path / "ckpt").latest()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a checkpoint at all")
    damaged = path.read_bytes()
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        fit(fresh(), tmp_path / "again", resume=str(path))
    assert path.read_bytes() == damaged


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    fit(fresh(), tmp_path, steps=2)
    other = SmallConvNet(classes=5)
    with pytest.raises(CheckpointError, match=r"saved from another model: 'fc.bias' has shape \(3,\) there, \(5,\) here"):
        fit(other, tmp_path / "again", resume=str(tmp_path / "ckpt"))


def test_an_unwritable_checkpoint_dir_is_refused_up_front(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot write checkpoints to"):
        fit(fresh(), tmp_path, checkpoint_dir=str(tmp_path / "file" / "ckpt"))


# --- the command line, with real signals ---------------------------------------------------

LONG_RUN = ["dataset=synthetic", "dataset.train_size=4096", "dataset.test_size=64", "batch_size=32", "workers=2",
            "comm=shm", "max_steps=200", "log_every=1", "checkpoint.every_steps=50", "optim.schedule=step"]


def start_cli(args, run_dir, marker, new_session=False, job=False):
    """The CLI in a subprocess; ``new_session``: in a process group of its own, as a scheduler starts jobs;
    ``job``: in a process group of its own in this session, as a shell starts a job in a terminal."""
    env = {**os.environ, "SN_TEST_MARKER": marker}
    return subprocess.Popen([sys.executable, "-m", "sn_trainer", *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session, **({"process_group": 0} if job else {}))


def wait_for_step(run_dir, step, proc, timeout=120):
    """Until metrics.csv shows ``step`` (the run's own progress report), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        metrics = run_dir / "metrics.csv"
        if metrics.exists():
            rows = list(csv.DictReader(metrics.open()))
            if rows and rows[-1]["step"] and int(rows[-1]["step"]) >= step:
                return
        time.sleep(0.05)  # polling a file another process writes; nothing to wait on instead
    raise AssertionError(f"the run did not reach step {step} in {timeout} s")


def final_model(run_dir):
    return checkpoint.load(CheckpointDir(run_dir / "checkpoints").latest())["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final parameters of LONG_RUN run without interruption, once for the signal tests."""
    run, marker = tmp_path_factory.mktemp("whole") / "run", uuid.uuid4().hex
    whole = start_cli(LONG_RUN, run, marker)
    assert whole.wait(timeout=200) == 0, whole.communicate()
    return final_model(run)


@pytest.mark.parametrize("to", ["launcher", "group"])
def test_sigterm_checkpoints_exits_143_and_resumes_bit_exactly(tmp_path, uninterrupted, to):
    """SIGTERM to the launcher, or to every process of the group (what scancel, systemctl stop and
    kill -TERM -<pgid> do)."""
    marker = uuid.uuid4().hex
    run = tmp_path / "stopped"
    proc = start_cli([*LONG_RUN, "max_restarts=2"], run, marker, new_session=to == "group")
    wait_for_step(run, 20, proc)
    sent = time.monotonic()
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert time.monotonic() - sent < 10
    assert "interrupted: stopped by SIGTERM after step" in stderr and "resume with resume=" in stderr
    assert "restart" not in stderr  # a run asked to stop is never restarted
    stopped_at = checkpoint.load(CheckpointDir(run / "checkpoints").latest())["step"]
    assert 20 <= stopped_at < 200
    assert processes_with_marker(marker) == []

    resumed = start_cli([*LONG_RUN, f"resume={run / 'checkpoints'}"], tmp_path / "resumed", marker)
    assert resumed.wait(timeout=200) == 0, resumed.communicate()
    mine = final_model(tmp_path / "resumed")
    assert all(torch.equal(mine[k], uninterrupted[k]) for k in uninterrupted)
    assert processes_with_marker(marker) == []


def test_a_second_ctrl_c_stops_at_once_without_orphans(tmp_path):
    marker = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = start_cli([*LONG_RUN, "max_steps=100000"], run, marker)
    wait_for_step(run, 5, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.monotonic() - sent < 10
    assert processes_with_marker(marker) == []


def all_in(marker: str, status: str, timeout: float = 30) -> bool:
    """Whether every process of the run comes to ``status`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = {p.status() for p in processes_with_marker(marker) if p.is_running()}
        if statuses == {status}:
            return True
        time.sleep(0.05)  # the states of other processes: nothing to wait on instead
    return False


def test_ctrl_z_pauses_the_workers_with_the_launcher_and_fg_continues_them(tmp_path):
    """Ctrl-Z sends SIGTSTP to the terminal's foreground job (a process group), which the workers,
    each leading a session of its own, are not in: the launcher stops them with itself, and
    continues them when it is continued (fg sends the job SIGCONT)."""
    marker = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = start_cli(LONG_RUN, run, marker, job=True)
    wait_for_step(run, 5, proc)
    os.killpg(proc.pid, signal.SIGTSTP)
    assert all_in(marker, psutil.STATUS_STOPPED), [(p.pid, p.status()) for p in processes_with_marker(marker)]
    os.killpg(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=200)
    assert proc.returncode == 0, stderr
    assert processes_with_marker(marker) == []


def test_cli_refuses_a_checkpoint_of_another_model(tmp_path):
    first = tmp_path / "first"
    proc = start_cli([*LONG_RUN, "max_steps=2", "model=lenet"], first, uuid.uuid4().hex)
    assert proc.wait(timeout=120) == 0, proc.communicate()
    second = start_cli([*LONG_RUN, "model=mlp", f"resume={first / 'checkpoints'}"], tmp_path / "second", "x")
    _, stderr = second.communicate(timeout=120)
    assert second.returncode == 2
    assert stderr.strip().splitlines()[-1].startswith("error: ") and "was written for model=lenet" in stderr


def test_soak_twenty_jobs_hold_no_more_at_the_end_than_after_the_first(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "sn_trainer", "--multirun", "dataset=synthetic",
                           "dataset.train_size=128", "dataset.test_size=16", "batch_size=16", "workers=2",
                           "max_steps=2", "checkpoint.every_steps=1", "seed=range(0,20)",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(sweep.glob("*/summary.json"), key=lambda p: int(p.parent.name.split("_")[0]))
    hygiene = [json.loads(p.read_text())["process"] for p in jobs]
    assert len(hygiene) == 20
    for key in ("open_fds", "child_processes", "dev_shm_entries"):
        series = [h[key] for h in hygiene]
        assert max(series[1:]) <= series[1], f"{key} grew from job to job: {series}"
    assert max(h["child_processes"] for h in hygiene) == 0  # but multiprocessing's tracker and fork server


class FillsUp(io.FileIO):
    """A file on a disk with ``room`` bytes left: writes past them fail with ENOSPC, as a full disk's do."""

    def __init__(self, fd: int, mode: str, room: int):
        super().__init__(fd, mode)
        self.room = room

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@pytest.mark.unit
def test_a_full_disk_raises_the_os_error_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
    """torch.save's zip writer, failing to write, raises a RuntimeError of its own while closing:
    the caller must still see the OSError (ENOSPC), which the Trainer reports in one line."""
    directory = CheckpointDir(tmp_path)
    first = directory.save(checkpoint.build(1, {"w": torch.zeros(3)}, None, [], {}, None))
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FillsUp(fd, mode, room=4096))
    with pytest.raises(OSError) as caught:
        directory.save(checkpoint.build(2, {"w": torch.zeros(1 << 16)}, None, [], {}, None))
    assert caught.value.errno == errno.ENOSPC
    assert directory.steps() == [(1, first)] and sorted(os.listdir(tmp_path)) == [first.name]
