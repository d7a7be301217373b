"""Run it as operators run jobs: scheduler signals, hung workers, resumes that keep their schedule."""
import copy
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
import pytest
import torch
import torch.nn.functional as F

from helpers import ReportsPlacement, SmallConvNet, assert_exact, assert_same_parameters, in_a_worker, live_children, \
    plain_fit, processes_with_marker, tiny_dataset
from sn_trainer import CheckpointError, Trainer, WorkerFailed
from sn_trainer.checkpoint import CheckpointDir
from test_faults import LONG_RUN, start_cli, wait_for_step

pytestmark = pytest.mark.timeout(300)
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_warm_and_cold_workers_are_pinned_and_threaded_as_asked(tmp_path, start_method, no_leaks):
    """The second fit's forkserver workers come from a server that is already warm. Each worker leads a
    session of its own: where the kernel shares CPU time between sessions first (autogroup), the run's
    workers then weigh as much as other programs' processes, not all of them together as much as one."""
    earlier = set()
    for fit_index in range(2):
        log = tmp_path / f"fit-{fit_index}.jsonl"
        torch.manual_seed(0)
        Trainer(workers=2, threads=1, pin=True, batch_size=8, max_steps=4, start_method=start_method).fit(
            ReportsPlacement(SmallConvNet(), str(log)), tiny_dataset(), optimizer=SGD)
        calls = {}
        for line in log.read_text().splitlines():
            call = json.loads(line)
            calls.setdefault(call["pid"], []).append(call)
        workers = {pid: seen for pid, seen in calls.items() if len(seen) >= 4}  # the preflight runs one batch
        assert len(workers) == 2, calls
        cpus = [set(seen[0]["cpus"]) for seen in workers.values()]
        assert all(len(c) == 1 for c in cpus) and not cpus[0] & cpus[1], cpus
        assert all(c["threads"] == 1 and c["interop"] == 1 for seen in workers.values() for c in seen), workers
        assert all(c["session"] == pid for pid, seen in workers.items() for c in seen), workers
        assert not earlier & workers.keys()  # every fit has processes of its own
        earlier |= workers.keys()


def test_beside_busy_cores_pin_auto_leaves_the_workers_to_the_os_and_says_why(tmp_path, caplog, no_leaks):
    """Other work on every usable core as the run starts: pin=auto pins nothing (a pinned worker could not
    move off a core that work shares), and says so; pin=false pins nothing either, pin=true pins."""
    allowed = sorted(os.sched_getaffinity(0))
    loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in allowed]
    try:
        seen = {}
        for pin in ("auto", False, True):
            log = tmp_path / f"{pin}.jsonl"
            with caplog.at_level(logging.INFO, logger="sn_trainer"):
                Trainer(workers=2, threads=1, pin=pin, batch_size=8, max_steps=2).fit(
                    ReportsPlacement(SmallConvNet(), str(log)), tiny_dataset(), optimizer=SGD)
            seen[pin] = [json.loads(line)["cpus"] for line in log.read_text().splitlines()]
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert all(cpus == allowed for cpus in seen["auto"] + seen[False]), seen
    assert {len(cpus) for cpus in seen[True]} == {1}, seen[True]
    assert "of this machine's" in caplog.text and "the workers are not pinned (pin=auto)" in caplog.text


@pytest.mark.parametrize("early", [False, True])
def test_a_late_start_of_the_warm_workers_server_says_how_to_start_it_early(early):
    script = ("import logging, sys\n"
              "import sn_trainer\n"
              "if __name__ == '__main__':\n"
              "    if sys.argv[1] == 'early': sn_trainer.warm_up()\n"
              "    import torch\n"
              "    logging.basicConfig(level=logging.INFO)\n"
              "    sn_trainer.Trainer(workers=1); sn_trainer.Trainer(workers=1)\n")
    done = subprocess.run([sys.executable, "-c", script, "early" if early else "late"], capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stderr.count("call sn_trainer.warm_up() before importing torch") == (0 if early else 1), done.stderr


@pytest.mark.quick
def test_sigint_to_one_worker_stops_the_run_at_a_step_boundary(tmp_path):
    marker = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = start_cli([*LONG_RUN, "max_steps=100000"], run, marker)
    wait_for_step(run, 5, proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if not p.children() and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 2
    workers[-1].send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "stopped by SIGINT after step" in stderr
    assert CheckpointDir(run / "checkpoints").latest() is not None
    assert processes_with_marker(marker) == []


class Stalls(torch.nn.Module):
    """On its ``at_call``-th forward, worker ``rank`` stops itself (SIGSTOP), as a swapped-out or
    deadlocked process would."""

    def __init__(self, inner, at_call: int, rank: int):
        super().__init__()
        self.inner, self.at_call, self.rank, self.calls = inner, at_call, rank, 0

    def forward(self, x):
        self.calls += in_a_worker()
        if self.calls == self.at_call and torch.initial_seed() % 1000 == self.rank:
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.inner(x)


class SlowToRead(torch.utils.data.Dataset):
    """Worker ``rank`` takes ``delay_s`` to read its slice of step ``at_step`` (a slow disk): its
    peers start that step's forward pass first."""

    def __init__(self, data, at_step: int, rank: int, delay_s: float):
        self.data, self.at_step, self.rank, self.delay_s, self.calls = data, at_step, rank, delay_s, 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]

    def get_batch(self, indices):
        self.calls += 1
        if self.calls == self.at_step and torch.initial_seed() % 1000 == self.rank:
            time.sleep(self.delay_s)
        return tuple(t[indices] for t in self.data.tensors)


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_a_stopped_worker_is_named_not_the_peers_waiting_in_batch_norm(comm, no_leaks):
    """With sync_batchnorm, worker 0 waits inside its forward pass (batch norm's sums) for worker
    1, which stopped in its own: worker 0 went quiet first, but waits; worker 1 is named."""
    from test_byo_optimizer import BatchNormNet

    model = Stalls(BatchNormNet(), at_call=4, rank=1)
    data = SlowToRead(tiny_dataset(), at_step=4, rank=1, delay_s=2.0)
    with pytest.raises(WorkerFailed) as caught:
        Trainer(workers=2, batch_size=8, max_steps=100, comm=comm, sync_batchnorm=True, worker_timeout=5).fit(
            model, data, optimizer=SGD)
    message = str(caught.value)
    assert message.startswith("worker 1 failed: made no progress for") and "stage forward" in message, message


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_a_stopped_worker_ends_the_run_naming_it(comm, no_leaks):
    model = Stalls(SmallConvNet(), at_call=4, rank=1)
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as caught:
        Trainer(workers=2, batch_size=8, max_steps=100, comm=comm, worker_timeout=10).fit(model, tiny_dataset(),
                                                                                           optimizer=SGD)
    assert time.monotonic() - started < 30
    message = str(caught.value)
    assert message.startswith("worker 1 failed: made no progress for") and "stage forward" in message, message
    assert "in step 4" in message


def test_a_hung_worker_is_restarted_from_the_last_checkpoint(tmp_path, no_leaks):
    torch.manual_seed(0)
    reference = SmallConvNet()
    hung = Stalls(copy.deepcopy(reference), at_call=6, rank=0)
    result = Trainer(workers=2, batch_size=8, max_steps=8, seed=3, worker_timeout=8, max_restarts=1,
                     checkpoint_dir=str(tmp_path), checkpoint_every_steps=2).fit(hung, tiny_dataset(), optimizer=SGD)
    assert result.restarts == 1
    Trainer(workers=2, batch_size=8, max_steps=8, seed=3).fit(reference, tiny_dataset(), optimizer=SGD)
    assert_same_parameters(hung.inner, reference)


def lr_per_step(tmp_path, name, epochs, resume=None):
    result = Trainer(workers=2, batch_size=12, epochs=epochs, seed=3, log_every=1, checkpoint_dir=str(tmp_path / name),
                     resume=resume).fit(
        SmallConvNet(), tiny_dataset(), optimizer=SGD,
        scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=7 * epochs))
    return {r["step"]: r["lr"] for r in result.history if "lr" in r}


def plain_lr_per_step(steps, t_max):
    """The lr each optimizer step of a plain loop uses: read before optimizer.step(), then scheduler.step()."""
    optimizer = SGD([torch.zeros(1, requires_grad=True)])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)
    used = {}
    for step in range(1, steps + 1):
        used[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
    return used


def test_a_resume_with_more_epochs_follows_the_longer_schedule(tmp_path):
    two_epochs = lr_per_step(tmp_path, "whole", 2)
    one_epoch = lr_per_step(tmp_path, "first", 1)
    assert one_epoch == pytest.approx(plain_lr_per_step(7, 7), rel=1e-12)  # the lr each step used, not the next's
    assert two_epochs == pytest.approx(plain_lr_per_step(14, 14), rel=1e-12)
    resumed = lr_per_step(tmp_path, "second", 2, resume=str(tmp_path / "first"))
    assert sorted(resumed) == list(range(8, 15))
    for step, lr in resumed.items():
        assert lr == pytest.approx(two_epochs[step], rel=1e-12), step


@pytest.mark.parametrize("change, message", [
    (dict(batch_size=6), "written with batch_size 12, this run has 6"),
    (dict(accumulate=2), "written with accumulate 1, this run has 2"),
    (dict(seed=4), "written with seed 3, this run has 4"),
    (dict(shuffle=False), "written with shuffle True, this run has False"),
])
def test_a_resume_that_would_shift_the_sample_order_is_refused(tmp_path, change, message):
    settings = dict(workers=2, batch_size=12, max_steps=2, seed=3, checkpoint_dir=str(tmp_path))
    Trainer(**settings).fit(SmallConvNet(), tiny_dataset(), optimizer=SGD)
    saved = (tmp_path / "step-000000002.pt").read_bytes()
    with pytest.raises(CheckpointError, match=message + ": the samples of each step would differ"):
        Trainer(**{**settings, "max_steps": 4, "resume": "latest", **change}).fit(SmallConvNet(), tiny_dataset(),
                                                                                 optimizer=SGD)
    assert (tmp_path / "step-000000002.pt").read_bytes() == saved
    with pytest.raises(CheckpointError, match="training-set size 84, this run has 60"):
        Trainer(**{**settings, "max_steps": 4, "resume": "latest"}).fit(SmallConvNet(), tiny_dataset(n=60),
                                                                       optimizer=SGD)
    Trainer(**{**settings, "max_steps": 4, "resume": "latest", "resume_strict": False, **change}).fit(
        SmallConvNet(), tiny_dataset(), optimizer=SGD)  # not strict: a warning, and it goes on


@pytest.mark.parametrize("workers, batch_size", [(1, 8), (2, 8), (3, 8), (3, 7)])
def test_drop_last_false_trains_the_last_partial_batch_exactly(workers, batch_size):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    data = tiny_dataset(n=30, dtype=torch.float64)  # 30 = 3 x 8 + 6 = 4 x 7 + 2: the last step of an epoch is short
    steps = 2 * -(-30 // batch_size)  # with batch 7 and 3 workers, one worker has nothing in it
    reference = plain_fit(copy.deepcopy(model), data, batch_size, steps=steps, seed=3, drop_last=False,
                          optimizer=lambda m: SGD(m.parameters()), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    result = Trainer(workers=workers, batch_size=batch_size, epochs=2, seed=3, drop_last=False).fit(
        model, data, optimizer=SGD)
    assert result.steps == steps
    assert_exact(model, reference)


@pytest.mark.alone  # what it asserts of the temporary folder holds only with no other test beside it
def test_a_killed_launcher_leaves_no_process_and_its_directory_goes_with_the_next_run(tmp_path):
    script = ("import os, signal, sys; sys.path.insert(0, %r)\n"
              "from helpers import Bomb, SmallConvNet, in_a_worker, tiny_dataset\n"
              "from sn_trainer import Trainer\n"
              "class KillLauncher(Bomb):\n"
              "    def forward(self, x):\n"
              "        self.calls += in_a_worker()\n"
              "        if self.calls == 3: os.kill(int(self.flag_path), signal.SIGKILL)\n"
              "        return self.inner(x)\n"
              "if __name__ == '__main__':\n"
              "    model = KillLauncher(SmallConvNet(), str(os.getpid()), '')\n"
              "    Trainer(workers=2, batch_size=8, max_steps=50).fit(model, tiny_dataset())\n"
              % os.path.dirname(__file__))
    path = tmp_path / "job.py"
    path.write_text(script)
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "SN_TEST_MARKER": marker})
    assert proc.wait(timeout=120) == -signal.SIGKILL
    deadline = time.monotonic() + 10  # its workers and fork server end on their own, as soon as they notice
    while processes_with_marker(marker):
        assert time.monotonic() < deadline, processes_with_marker(marker)
        time.sleep(0.1)
    left = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"sn_trainer-{proc.pid}-")]
    assert len(left) == 2  # the launcher had no chance to remove its two: rendezvous, multiprocessing's...
    Trainer(workers=2, batch_size=8, max_steps=1).fit(SmallConvNet(), tiny_dataset())
    assert not any(os.path.exists(os.path.join(tempfile.gettempdir(), d)) for d in left)  # ...the next run did
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("pymp-")]
    assert live_children() == []


def test_the_resource_tracker_has_ended_and_cleaned_up_when_the_launcher_exits(tmp_path):
    """multiprocessing's resource tracker, started with the first worker, would otherwise end after
    the launcher, on its own: just after a run, its processes were not all gone (seen in CI)."""
    script = ("import json, os, sys\n"
              "from multiprocessing import resource_tracker, shared_memory\n"
              "from sn_trainer.engine.processes import forkserver\n"
              "forkserver.stop_the_tracker_at_exit()\n"
              "left = shared_memory.SharedMemory(create=True, size=4096)\n"
              "left.close()\n"  # never unlinked: the tracker's to clean up
              "print(json.dumps([left._name, resource_tracker._resource_tracker._pid]), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name, tracker = json.loads(out.stdout)
    assert not psutil.pid_exists(tracker) or psutil.Process(tracker).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")


def test_a_damaged_newest_checkpoint_is_passed_over_when_resuming_from_a_directory(tmp_path, caplog):
    torch.manual_seed(0)
    start = SmallConvNet()
    whole = copy.deepcopy(start)
    Trainer(workers=2, batch_size=8, max_steps=6, seed=3).fit(whole, tiny_dataset(), optimizer=SGD)
    settings = dict(workers=2, batch_size=8, seed=3, checkpoint_dir=str(tmp_path), checkpoint_every_steps=2)
    Trainer(max_steps=4, **settings).fit(copy.deepcopy(start), tiny_dataset(), optimizer=SGD)
    newest = tmp_path / "step-000000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    resumed = copy.deepcopy(start)
    Trainer(max_steps=6, resume="latest", **settings).fit(resumed, tiny_dataset(), optimizer=SGD)
    assert "passing over a damaged checkpoint" in caplog.text and "step-000000004.pt is corrupt" in caplog.text
    assert_same_parameters(resumed, whole)


@pytest.mark.alone  # it counts what the machine holds (processes, /dev/shm, temporary folders) before and after
def test_chaos_script_runs_faults_and_finds_every_job_equal(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "chaos.py")
    proc = subprocess.run([sys.executable, script, "--faults", "2", "--kinds", "kill_worker,second_run", "--seed", "5",
                           "--out", str(tmp_path / "chaos")], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "chaos.md").read_text()
    assert "| **all** | 2 | 2 | 2 | 2 | 2 | | | 0 in all |" in table, table  # both fired; weights, evaluations, best


class ReadsEnvironment(torch.nn.Module):
    """Fails in a worker unless SN_TEST_SET_LATE is set and SN_TEST_UNSET_LATE is not."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if os.environ.get("SN_TEST_SET_LATE") != "yes" or "SN_TEST_UNSET_LATE" in os.environ:
            raise RuntimeError(f"environment as the fork server saw it: {os.environ.get('SN_TEST_SET_LATE')!r}")
        return self.inner(x)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_see_the_environment_as_it_is_when_fit_starts(start_method, monkeypatch):
    """A script's os.environ[...] = ..., or Hydra's hydra.job.env_set, after the warm workers'
    server started: forked workers must see it too, as spawned ones do."""
    monkeypatch.setenv("SN_TEST_UNSET_LATE", "1")
    Trainer(workers=1, batch_size=8, max_steps=1, start_method=start_method)  # the server starts here
    monkeypatch.setenv("SN_TEST_SET_LATE", "yes")
    monkeypatch.delenv("SN_TEST_UNSET_LATE")
    Trainer(workers=2, batch_size=8, max_steps=2, start_method=start_method).fit(
        ReadsEnvironment(SmallConvNet()), tiny_dataset(), optimizer=SGD)


def test_a_resume_with_another_optimizer_is_refused_before_any_worker_starts(tmp_path, no_leaks):
    settings = dict(workers=2, batch_size=8, seed=3, checkpoint_dir=str(tmp_path))
    Trainer(max_steps=2, **settings).fit(SmallConvNet(), tiny_dataset(), optimizer=SGD)
    adamw = functools.partial(torch.optim.AdamW, lr=0.01)
    with pytest.raises(CheckpointError, match=r"holds optimizer state \{momentum_buffer\}, and this run's AdamW "
                                              r"keeps \{exp_avg, exp_avg_sq, step\}: it was written with another "
                                              r"optimizer"):
        Trainer(max_steps=4, resume="latest", **settings).fit(SmallConvNet(), tiny_dataset(), optimizer=adamw)
