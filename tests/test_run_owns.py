"""A run owns its checkpoint folder, and what a side effect does wrong never takes training down.

Each test here failed before the change it checks (issue "Never lose a run"): a fresh run in
another run's folder pruned its own checkpoints and resumed the other's; a live writer's file was
pruned; a failing evaluation killed the run from the loggers and monitors; a misspelt monitor
was found after a whole epoch; a metric that counted nothing vanished and NaN became a best; an
update that overflowed the parameters ended in a bare RuntimeError.
"""
import contextlib
import copy
import csv
import errno
import fcntl
import functools
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from helpers import SmallConvNet, tiny_dataset
from sn_trainer import BestCheckpoint, Callback, CheckpointError, ConfigError, EarlyStopping, Trainer, \
    TrainingDiverged, TrainingInterrupted
from sn_trainer.checkpoint import CheckpointDir
from sn_trainer.report.metrics import ProgressLog
from sn_trainer.report.tensorboard import TensorBoardLog

pytestmark = pytest.mark.timeout(180)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def fit(folder, steps, every, **settings):
    return Trainer(workers=2, batch_size=8, max_steps=steps, checkpoint_dir=str(folder), checkpoint_every_steps=every,
                   **settings).fit(SmallConvNet(), tiny_dataset(), optimizer=SGD)


@pytest.mark.quick
def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(tmp_path):
    fit(tmp_path, 6, 2)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps 2, 4, 6\) of another run: "
                                              r"resume=latest goes on from them, or give this run a new checkpoint"):
        fit(tmp_path, 15, 5)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before  # nothing saved is touched
    with pytest.raises(CheckpointError, match=r"later than or other than the one this run resumes from"):
        fit(tmp_path, 15, 5, resume=str(tmp_path / "step-000000002.pt"))  # would branch from its own past
    result = fit(tmp_path, 15, 5, resume="latest")  # going on owns the folder
    assert result.last_checkpoint == str(tmp_path / "step-000000015.pt") and Path(result.last_checkpoint).exists()
    assert CheckpointDir(tmp_path).latest().name == "step-000000015.pt"


HOLDS_THE_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("held", flush=True)
time.sleep(120)
"""


def test_a_folder_another_live_run_writes_is_refused_and_a_dead_ones_taken_over(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", HOLDS_THE_LOCK, str(tmp_path / CheckpointDir.LOCK)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline() == "held\n"
        with pytest.raises(CheckpointError, match=f"is being written by another run \\(process {live.pid}\\); give "
                                                  "this run a checkpoint directory of its own"):
            fit(tmp_path, 4, 2)
        assert CheckpointDir(tmp_path).steps() == []
    finally:
        live.kill()
        live.wait()
    # The same lock, its process gone: taken over, and let go at the end.
    result = fit(tmp_path, 4, 2)
    assert result.last_checkpoint is not None and not (tmp_path / CheckpointDir.LOCK).exists()


@pytest.fixture
def someone_elses_process():
    """A live process that is no run: a killed run's pid given to another program."""
    process = subprocess.Popen(["sleep", "120"])
    yield process.pid
    process.kill()
    process.wait()


def test_a_lock_nobody_flocks_is_taken_over_whatever_process_has_its_pid_now(tmp_path, someone_elses_process):
    """A killed run's pid reused by another program, and pid 1 left by a run in another container, own
    nothing: the flock decides."""
    lock = tmp_path / CheckpointDir.LOCK
    for pid in (someone_elses_process, 1):
        lock.write_text(str(pid))
        with CheckpointDir(tmp_path).claimed():
            assert lock.read_text().split("\n")[0] == str(os.getpid())
        assert not lock.exists()


def test_a_file_system_without_hard_links_claims_in_place_and_stays_exclusive(tmp_path, monkeypatch,
                                                                             someone_elses_process):
    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted", str(source))

    monkeypatch.setattr(os, "link", no_links)
    folder, lock = CheckpointDir(tmp_path), tmp_path / CheckpointDir.LOCK
    with folder.claimed():
        with pytest.raises(CheckpointError, match=f"another run \\(process {os.getpid()}\\)"):
            with CheckpointDir(tmp_path).claimed():  # another open of the file: flock() tells them apart
                pass
    assert not lock.exists() and list(tmp_path.iterdir()) == []
    lock.write_text(str(someone_elses_process))  # left by a killed run
    with folder.claimed():
        assert lock.read_text().split("\n")[0] == str(os.getpid())
    assert race_for_the_lock(tmp_path, racers=2, rounds=300).count(1) == 300  # forked racers keep the patch


@pytest.fixture
def no_flock(monkeypatch):
    real = fcntl.flock

    def unsupported(fd, operation):
        if operation & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", unsupported)


def test_without_flock_the_locks_process_decides_where_this_machine_can_tell(tmp_path, no_flock,
                                                                             someone_elses_process):
    import psutil

    from sn_trainer.checkpoint.lock import _identity_fields

    lock, mine = tmp_path / CheckpointDir.LOCK, _identity_fields()
    here = f"boot={mine['boot']} pidns={mine['pidns']}"
    running = repr(psutil.Process(someone_elses_process).create_time())
    lock.write_text(f"{someone_elses_process}\n{here} start={running}\n")
    with pytest.raises(CheckpointError, match=f"another run \\(process {someone_elses_process}\\)"):
        with CheckpointDir(tmp_path).claimed():
            pass
    lock.write_text(f"{someone_elses_process}\n{here} start=12.5\n")  # its pid, another process: taken over
    with CheckpointDir(tmp_path).claimed():
        pass
    lock.write_text("1\nboot=another pidns=1 start=12.5\n")  # another machine or container: cannot tell
    with pytest.raises(CheckpointError, match=r"may be written by a run on another machine or container \(process "
                                              r"1 there; this file system has no flock\(\) to tell\); if none is, "
                                              r"delete .*\.lock$"):
        with CheckpointDir(tmp_path).claimed():
            pass
    assert lock.read_text() == "1\nboot=another pidns=1 start=12.5\n"  # refused: left as found


def _claim_in_rounds(folder, me, racers, rounds, dead_pid, barrier, outcomes):
    """One racer: each round, claim ``folder`` at the barrier's release; an owner holds it until
    every racer has tried, then lets go. ``dead_pid``: racer 0 first leaves a dead run's lock."""
    folder, lock = CheckpointDir(folder), Path(folder) / CheckpointDir.LOCK
    for round_ in range(rounds):
        if dead_pid is not None and me == 0:
            lock.with_name("stale").write_text(str(dead_pid))
            os.replace(lock.with_name("stale"), lock)
        barrier.wait(timeout=60)  # the lock as it should be for this round; all start together
        try:
            with folder.claimed():
                outcomes[round_ * racers + me] = 1
                barrier.wait(timeout=60)  # every other racer has tried while this one owns
        except CheckpointError:
            outcomes[round_ * racers + me] = 0
            barrier.wait(timeout=60)
        barrier.wait(timeout=60)  # the owner has let go


def race_for_the_lock(folder, racers, rounds, dead_pid=None):
    """Each round's owners: how many of ``racers`` processes, claiming ``folder`` at one instant, owned it."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # cheap to start; the owner's identity is its process
    barrier, outcomes = context.Barrier(racers), context.RawArray("b", [-1] * (racers * rounds))
    processes = [context.Process(target=_claim_in_rounds, args=(folder, me, racers, rounds, dead_pid, barrier, outcomes))
                 for me in range(racers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [process.exitcode for process in processes] == [0] * racers  # every claim owned or refused
    return [sum(outcomes[r * racers:(r + 1) * racers]) for r in range(rounds)]


def test_runs_claiming_one_folder_at_the_same_instant_have_one_owner(tmp_path):
    owners = race_for_the_lock(tmp_path, racers=2, rounds=2000)
    assert [round_ for round_, n in enumerate(owners) if n != 1] == []
    assert not (tmp_path / CheckpointDir.LOCK).exists()  # the last owner let go


def test_runs_finding_a_dead_runs_lock_at_the_same_instant_one_takes_it_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    owners = race_for_the_lock(tmp_path, racers=2, rounds=1000, dead_pid=dead.pid)
    assert [round_ for round_, n in enumerate(owners) if n != 1] == []


def test_a_run_killed_while_a_child_it_forked_lives_leaves_a_lock_the_next_run_takes_over(tmp_path):
    """The lock is flock()ed, and a forked child shares its parent's flock: it must let go of it."""
    import threading

    said, says = os.pipe()
    run = os.fork()
    if run == 0:  # a run that claims the folder and forks a child that outlives it
        try:
            with CheckpointDir(tmp_path).claimed():
                child = os.fork()
                if child == 0:
                    threading.Event().wait()  # until the test kills it
                os.write(says, str(child).encode())
                threading.Event().wait()  # until the test kills it
        finally:
            os._exit(1)
    child = int(os.read(said, 32))
    try:
        with pytest.raises(CheckpointError, match=f"another run \\(process {run}\\)"):
            with CheckpointDir(tmp_path).claimed():
                pass
        os.kill(run, signal.SIGKILL)
        os.waitpid(run, 0)
        with CheckpointDir(tmp_path).claimed():  # the child lives on, and the lock is the next run's
            assert (tmp_path / CheckpointDir.LOCK).read_text().split("\n")[0] == str(os.getpid())
    finally:
        for pid in (run, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not (tmp_path / CheckpointDir.LOCK).exists()


def test_pruning_leaves_a_live_writers_file_alone(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        tmp_path.mkdir(exist_ok=True)
        writing = tmp_path / f".step-000000009.pt.tmp-{live.pid}"
        left = tmp_path / f".step-000000009.pt.tmp-{gone.pid}"
        writing.write_bytes(b"half"), left.write_bytes(b"half")
        CheckpointDir(tmp_path)._prune()
        assert writing.exists() and not left.exists()
    finally:
        live.kill()
        live.wait()


def test_command_line_runs_started_together_get_folders_of_their_own(tmp_path):
    command = [sys.executable, "-m", "sn_trainer", "dataset=synthetic", "dataset.train_size=64", "dataset.test_size=16",
               "model=mlp", "workers=1", "batch_size=32", "max_steps=2", "logger=none"]
    runs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outcomes = [run.communicate(timeout=150) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outcomes
    folders = sorted(p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir())
    assert len(folders) == 2 and all((folder / "summary.json").exists() for folder in folders)


class BreaksAfterFlag(Dataset):
    """An evaluation set whose items fail once ``flag`` exists (a disk gone, a corrupt file)."""

    def __init__(self, inner, flag: str):
        self.inner, self.flag = inner, flag

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if os.path.exists(self.flag):
            raise KeyError("the evaluation set broke")
        return self.inner[index]


class FlagsAfterFirstEvaluation(Callback):
    def __init__(self, flag: str):
        self.flag = flag

    def on_eval_end(self, trainer, evaluation):
        Path(self.flag).touch()


def test_a_failing_evaluation_takes_down_no_logger_monitor_or_checkpoint(tmp_path, caplog):
    flag = str(tmp_path / "broken")
    callbacks = [FlagsAfterFirstEvaluation(flag), ProgressLog(tmp_path, 9, show_bar=False), TensorBoardLog(tmp_path),
                 EarlyStopping(patience=1), BestCheckpoint()]
    with caplog.at_level(logging.WARNING, logger="sn_trainer"):
        result = Trainer(workers=2, batch_size=8, max_steps=9, eval_every=3, checkpoint_dir=str(tmp_path / "ckpt")).fit(
            SmallConvNet(), tiny_dataset(), eval_set=BreaksAfterFlag(tiny_dataset(24, seed=4), flag), optimizer=SGD,
            callbacks=callbacks)
    callbacks[1].close()
    callbacks[2].close()
    assert result.steps == 9 and result.stopped_early is None  # trained on to the end
    assert "KeyError: 'the evaluation set broke'" in result.eval_error
    assert CheckpointDir(tmp_path / "ckpt").latest().name == "step-000000009.pt"
    assert callbacks[4].best_step == 3 and (tmp_path / "ckpt" / "best.pt").exists()  # the one evaluation that worked
    said = [r.getMessage() for r in caplog.records]
    assert sum("EarlyStopping passes over the evaluation after step 6" in m for m in said) == 1  # once, not per failure
    assert sum("evaluation after step" in m and "failed, training goes on" in m for m in said) == 2  # steps 6 and 9
    with open(tmp_path / "metrics.csv") as rows:
        assert [row["step"] for row in csv.DictReader(rows) if row["eval_loss"]] == ["3"]  # what evaluated, as it was


class Records(Callback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, record):
        self.steps.append(record.step)


def test_a_misspelt_monitor_is_refused_before_any_step_trains():
    seen = Records()
    with pytest.raises(ConfigError, match=r"EarlyStopping monitors eval_los, which evaluation does not report"):
        Trainer(workers=2, batch_size=8, epochs=3, log_every=1).fit(
            SmallConvNet(), tiny_dataset(), eval_set=tiny_dataset(24), optimizer=SGD,
            callbacks=[seen, EarlyStopping(monitor="eval_los")])
    assert seen.steps == []
    with pytest.raises(ConfigError, match=r"BestCheckpoint monitors eval_loss after each evaluation, and this run "
                                          r"evaluates nothing: pass eval_set=\.\.\."):
        Trainer(workers=1, batch_size=8, max_steps=2, checkpoint_dir="unused").fit(
            SmallConvNet(), tiny_dataset(), optimizer=SGD, callbacks=[BestCheckpoint()])


def positives(model, batch):
    """The mean score of the positive class's samples: it counts nothing where the batch has none."""
    inputs, targets = batch
    kept = targets == 99
    return {"positives": (model(inputs)[kept].sum(), int(kept.sum()))}


def test_a_metric_that_counts_nothing_is_nan_and_never_a_best():
    stopper = EarlyStopping(monitor="eval_positives", patience=2)
    result = Trainer(workers=2, batch_size=8, max_steps=20, eval_every=4).fit(
        SmallConvNet(), tiny_dataset(), eval_set=tiny_dataset(24), optimizer=SGD, metric_fn=positives,
        callbacks=[stopper])
    assert "eval_positives" in result.eval_metrics and result.eval_metrics["eval_positives"] != \
        result.eval_metrics["eval_positives"]  # NaN
    assert stopper.best is None and result.stopped_early == 8  # two evaluations without a value: out of patience


def test_an_update_that_overflows_the_parameters_is_a_divergence_naming_its_step(tmp_path):
    with pytest.raises(TrainingDiverged, match="the parameters became non-finite at step 1, from finite gradients"):
        Trainer(workers=2, batch_size=8, max_steps=4, checkpoint_dir=str(tmp_path), checkpoint_every_steps=1).fit(
            SmallConvNet(), tiny_dataset(), optimizer=functools.partial(torch.optim.SGD, lr=float("inf")))
    assert CheckpointDir(tmp_path).steps() == []


# Every step worse on the training set, evaluated on it: the best evaluation is the first.
ASCENT = functools.partial(torch.optim.SGD, lr=0.05, maximize=True)
ASCENT_GENTLE = functools.partial(torch.optim.SGD, lr=0.01, maximize=True)  # a plateau scheduler halves it


def test_best_checkpoint_after_a_resume_keeps_the_best_so_far(tmp_path):
    def run(folder, steps, resume=None):
        torch.manual_seed(0)
        best = BestCheckpoint()
        Trainer(workers=2, batch_size=8, max_steps=steps, eval_every=2, checkpoint_dir=str(folder), resume=resume,
                checkpoint_every_steps=2).fit(SmallConvNet(), tiny_dataset(), eval_set=tiny_dataset(),
                                              optimizer=ASCENT, callbacks=[best])
        return best

    straight = run(tmp_path / "straight", 10)
    run(tmp_path / "stopped", 4)
    resumed = run(tmp_path / "stopped", 10, resume="latest")
    assert straight.best_step == 2 and resumed.best_step == 2 and resumed.best == pytest.approx(straight.best)
    saved = torch.load(tmp_path / "stopped" / "best.pt", weights_only=True)
    assert saved["step"] == 2 and saved["callbacks"]["BestCheckpoint#0"]["best_step"] == 2


def test_a_restart_rewinds_the_callbacks_and_the_history_to_its_checkpoint(tmp_path):
    from helpers import Bomb, assert_same_parameters

    def run(name, bomb):
        torch.manual_seed(0)
        model = SmallConvNet()
        if bomb:  # each worker's 10th forward is step 7's: after the evaluation of step 6, past the checkpoint of 4
            model = Bomb(model, str(tmp_path / "flag"), "kill", at_call=10)
        stopper = EarlyStopping(patience=3)
        result = Trainer(workers=2, batch_size=8, max_steps=16, eval_every=2, log_every=1, max_restarts=1, seed=3,
                         checkpoint_dir=str(tmp_path / name), checkpoint_every_steps=4).fit(
            model, tiny_dataset(), eval_set=tiny_dataset(), optimizer=ASCENT, callbacks=[stopper])
        return model, result, stopper

    model, straight, stopper = run("straight", bomb=False)
    crashed_model, crashed, crashed_stopper = run("crashed", bomb=True)
    assert crashed.restarts == 1 and (tmp_path / "flag").exists()
    assert straight.stopped_early == crashed.stopped_early == 8 and crashed_stopper.waited == stopper.waited == 3
    assert [r["step"] for r in crashed.history] == [r["step"] for r in straight.history]  # none twice
    assert_same_parameters(crashed_model.inner, model)


@pytest.mark.unit
def test_a_checkpoint_keeps_the_callbacks_as_they_were_at_its_step_whichever_part_comes_last(tmp_path, monkeypatch):
    """Worker 0 sends its events (progress, evaluations) and its part of a checkpoint in order,
    but another worker's part can come after worker 0's events of later steps: the checkpoint of
    step 4 keeps the callbacks as worker 0's part of it found them, not as they are when the last
    part comes (CI saw a restart from step 4 resume an early stopping's patience counted at step 6)."""
    from types import SimpleNamespace

    from sn_trainer.callbacks import Callbacks
    from sn_trainer.checkpoint import contents
    from sn_trainer.checkpoint.writer import CheckpointWriter
    from sn_trainer.engine.events import CheckpointPart
    from sn_trainer.engine.processes.pickling import pack

    class Evaluations(Callback):
        def __init__(self):
            self.steps = []

        def state_dict(self):
            return {"steps": self.steps}  # the live list: what the checkpoint keeps must not follow it

    evaluations = Evaluations()
    directory = SimpleNamespace(path=tmp_path, save=lambda saved: tmp_path / f"step-{saved['step']}.pt")
    writer = CheckpointWriter(directory, SimpleNamespace(world_size=2), [], {}, None, Callbacks([evaluations]))
    kept = {}  # the file's contents stand for themselves: its step and the callbacks' states
    monkeypatch.setattr(contents, "build", lambda step, *args, callbacks, **kwargs: kept.setdefault(
        step, {"step": step, "model": {}, "callbacks": copy.deepcopy(callbacks)}))
    part = pack({"model": {}, "rng": None, "phases": []})  # a model without parameters, no optimizer
    evaluations.steps.append(4)
    writer.on_checkpoint_part(None, CheckpointPart(0, 4, part))
    evaluations.steps.append(6)  # worker 0's evaluation of step 6, handled before worker 1's part of step 4 came
    writer.on_checkpoint_part(None, CheckpointPart(1, 4, part))
    assert list(kept[4]["callbacks"].values()) == [{"steps": [4]}] and writer.last_saved == tmp_path / "step-4.pt"


class StopsAtStep(Callback):
    """Asks the run to stop when told of step ``step`` (a logged step)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record):
        if record.step == self.step:
            trainer.should_stop = True


def test_a_callbacks_stop_applies_to_the_step_it_saw_and_that_model_is_evaluated():
    from helpers import assert_exact, cross_entropy, plain_fit

    torch.manual_seed(0)
    model = SmallConvNet().double()
    data, test = tiny_dataset(dtype=torch.float64), tiny_dataset(24, seed=4, dtype=torch.float64)
    reference = plain_fit(copy.deepcopy(model), data, 8, 3, 3, lambda m: SGD(m.parameters()), cross_entropy)
    for _ in range(3):  # every time: the decision never depends on how fast the launcher was
        trained = copy.deepcopy(model)
        result = Trainer(workers=2, batch_size=8, max_steps=40, log_every=1, eval_every=10, seed=3).fit(
            trained, data, eval_set=test, optimizer=SGD, callbacks=[StopsAtStep(3)])
        assert result.steps == result.stopped_early == 3
        assert_exact(trained, reference)
        with torch.no_grad():
            assert result.eval_loss == pytest.approx(cross_entropy(reference.eval(), test.tensors).item(), rel=1e-10)


@pytest.mark.unit
def test_a_worker_reading_the_steps_stop_late_reads_what_the_others_read_and_meets_them_at_the_event():
    """Worker 1 descheduled between a step's barrier and its read of the step's decision, while
    worker 0 waits on the launcher and then decides to stop on a callback's ask: worker 1 must
    still read "go on", join the event's barrier, and stop there with worker 0. Two threads run
    the workers' side of the protocol; worker 1 reads only once worker 0 has decided."""
    import threading

    from sn_trainer.engine import StopFlags
    from sn_trainer.engine.processes.signals import StopAgreement

    flags, step = StopFlags.allocate(), 5
    met = threading.Barrier(2, timeout=10)
    decided = threading.Event()

    def worker_0_barrier():
        decided.set()  # worker 0 has decided after the event; worker 1 has not read the step's decision yet
        met.wait()

    agreements = [StopAgreement(flags, 0, worker_0_barrier), StopAgreement(flags, 1, met.wait)]
    flags.decide(step)  # the step's end: nothing asked yet
    flags.ask()  # a callback, told of the step's record
    flags.acknowledge()  # the launcher has handed that record to its callbacks
    stops = [None, None]

    def worker(rank):
        if rank == 1:
            decided.wait(10)
        stopping = flags.stops_after(step)
        if not stopping:  # the awaited record: every worker meets the decision made after it
            stopping = agreements[rank].after_event(step)
        stops[rank] = stopping

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not met.broken, "a worker left the event's barrier without the other"
    assert stops == [True, True]
    assert flags.ends_run()


def halving_on_plateau(optimizer):
    return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0),
            "monitor": "eval_loss"}


class SignalsAtStep(Callback):
    """SIGTERM to this process when told of step ``step``, as a scheduler's would arrive then."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record):
        if record.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Evaluations(Callback):
    def __init__(self):
        self.steps = []

    def on_eval_end(self, trainer, evaluation):
        self.steps.append(evaluation.step)


@pytest.mark.parametrize("at", [4, 5])  # the step before an evaluation, and the evaluation's own
def test_a_signal_stops_at_the_step_it_came_on_keeping_its_evaluation_and_the_resume_changes_nothing(tmp_path, at):
    from helpers import assert_exact

    def run(callbacks, folder, resume=None):
        torch.manual_seed(0)
        model = SmallConvNet().double()
        trainer = Trainer(workers=2, batch_size=8, max_steps=15, log_every=1, eval_every=5, seed=3, resume=resume,
                          checkpoint_dir=str(tmp_path / folder))
        return model, lambda: trainer.fit(model, tiny_dataset(dtype=torch.float64), optimizer=ASCENT_GENTLE,
                                          eval_set=tiny_dataset(24, seed=4, dtype=torch.float64),
                                          scheduler=halving_on_plateau, callbacks=callbacks)

    straight_model, fit_straight = run([], "straight")
    straight = fit_straight()
    before = Evaluations()
    _, fit_stopped = run([before, SignalsAtStep(at)], "stopped")
    with pytest.raises(TrainingInterrupted) as stopped:
        fit_stopped()
    assert stopped.value.step == at and stopped.value.checkpoint.name == f"step-{at:09d}.pt"
    after = Evaluations()
    resumed_model, fit_resumed = run([after], "stopped", resume="latest")
    resumed = fit_resumed()
    assert [r["step"] for r in straight.history if "eval_loss" in r] == [5, 10, 15] == before.steps + after.steps
    assert resumed.eval_loss == pytest.approx(straight.eval_loss, rel=1e-10)
    assert_exact(resumed_model, straight_model)  # the plateau scheduler stepped on the same losses


class Slow(Callback):
    """Takes ``seconds`` over the record of step ``step`` (a callback writing a large file, say)."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_step_end(self, trainer, record):
        if record.step == self.step:
            import time

            time.sleep(self.seconds)  # the fault itself: a callback slower than worker_timeout


@pytest.mark.parametrize("awaited", [True, False])
def test_time_spent_in_a_slow_callback_is_no_workers_hang(awaited):
    """Awaited (a callback that may act on records): the workers wait for it; not awaited (one
    that only observes): the launcher reads their messages late. Neither is a worker's hang."""
    torch.manual_seed(0)
    slow = Slow(2, 3.0)
    slow.observes_only = not awaited
    result = Trainer(workers=2, batch_size=8, max_steps=6, log_every=1, worker_timeout=1.0).fit(
        SmallConvNet(), tiny_dataset(), optimizer=SGD, callbacks=[slow])
    assert result.steps == 6


class Raises(Callback):
    def on_step_end(self, trainer, record):
        raise KeyError("a callback's own bug")

    def on_eval_end(self, trainer, evaluation):
        raise ValueError("and another")


@pytest.mark.quick
def test_a_callback_that_raises_is_reported_once_per_hook_and_training_goes_on(tmp_path, caplog):
    def run(callbacks):
        torch.manual_seed(0)
        model = SmallConvNet()
        result = Trainer(workers=2, batch_size=8, max_steps=6, log_every=1, eval_every=2, seed=1,
                         checkpoint_dir=str(tmp_path / str(len(callbacks))), checkpoint_every_steps=3).fit(
            model, tiny_dataset(), eval_set=tiny_dataset(16, seed=2), optimizer=SGD, callbacks=callbacks)
        return model, result

    reference, _ = run([])
    with caplog.at_level(logging.ERROR, logger="sn_trainer.callbacks"):
        model, result = run([Raises()])
    assert result.steps == 6 and Path(result.last_checkpoint).name == "step-000000006.pt"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    failures = [r for r in caplog.records if "callback Raises failed" in r.getMessage()]
    assert sorted(r.getMessage().split()[4] for r in failures) == ["on_eval_end;", "on_step_end;"]
    assert all(r.exc_info is not None for r in failures)


class Snapshots(Callback):
    """What a callback reads of the model it trains, at each record and evaluation: the weights,
    and an EMA of them stepped in on_step_end as torch.optim.swa_utils users write one."""

    def __init__(self, model):
        self.model, self.seen = model, {}
        self.ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))

    def on_step_end(self, trainer, record):
        import time

        time.sleep(0.05)  # a launcher busy elsewhere first: live weights would be a later step's by now
        self.ema.update_parameters(self.model)
        self.seen[("step", record.step)] = [p.detach().clone() for p in self.model.parameters()]

    def on_eval_end(self, trainer, evaluation):
        self.seen[("eval", evaluation.step)] = [p.detach().clone() for p in self.model.parameters()]


def test_a_callback_reads_the_weights_of_the_step_it_is_told_of():
    from helpers import cross_entropy, plain_batches

    torch.manual_seed(0)
    model = SmallConvNet().double()
    data = tiny_dataset(64, dtype=torch.float64)
    reference = copy.deepcopy(model)
    expected_ema = torch.optim.swa_utils.AveragedModel(reference,
                                                       multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    opt, expected = SGD(reference.parameters()), {}
    for step, batch in zip(range(1, 9), plain_batches(data, 8, 3, True)):
        opt.zero_grad()
        cross_entropy(reference, batch).backward()
        opt.step()
        expected_ema.update_parameters(reference)
        expected[step] = [p.detach().clone() for p in reference.parameters()]
    seen = Snapshots(model)
    Trainer(workers=2, batch_size=8, max_steps=8, log_every=1, eval_every=4, seed=3).fit(
        model, data, eval_set=tiny_dataset(16, seed=2, dtype=torch.float64), optimizer=SGD, callbacks=[seen])
    assert sorted(seen.seen) == sorted([("step", s) for s in range(1, 9)] + [("eval", 4), ("eval", 8)])
    for (_, step), weights in seen.seen.items():
        for got, want in zip(weights, expected[step]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for got, want in zip(seen.ema.parameters(), expected_ema.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_a_stale_rendezvous_folder_another_run_removes_first_is_no_error(tmp_path, monkeypatch):
    """Two runs starting together (two nodes' Trainers of one machine, restarted at once) each remove
    the folder a killed launcher left: the one that finds it gone already goes on."""
    import psutil
    import tempfile

    from sn_trainer.fit import session

    stale = tmp_path / "sn_trainer-999999999-left"
    stale.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def gone_meanwhile(pid):  # the other run removes it between this run's listing and its look at it
        if stale.exists():
            stale.rmdir()
        return False

    monkeypatch.setattr(psutil, "pid_exists", gone_meanwhile)
    made = session.rendezvous_dir()
    assert os.path.isdir(made) and os.path.dirname(made) == str(tmp_path) and not stale.exists()
