"""Chaos: training jobs with one random fault each, resumed or restarted until they finish, then checked.

Each job trains LeNet on synthetic data with 2 workers, checkpointing every few steps, with
restarts and a worker timeout, as an operator would run it. At a random step one fault strikes:
a worker SIGKILLed or SIGSTOPped, SIGTERM to the whole process group, SIGINT to the launcher,
the newest checkpoint truncated, the checkpoint directory full (a small tmpfs), a worker that
raises, a second run started in the same folder, an evaluation that fails, an MLflow tracking
server that goes away (tests/tracking_stub.py, a stand-in that drops every call). Every job evaluates
every few steps and keeps stateful callbacks (BestCheckpoint, and one that keeps the steps it was
told of): a restart or a resume must go on from their checkpointed state. Whether a fault really
struck is read from what the job said (its exit codes and log), not assumed. The job is resumed
(``resume=latest``) until it finishes; then its final parameters are compared with an
uninterrupted run's (bit-identical: the worker count is the same), and so are the evaluations its
callbacks were told of and the step best.pt holds; the script counts what the job left behind:
processes, /dev/shm entries, temporary directories and half-written checkpoint files.

    python scripts/chaos.py --faults 50 [--seed 0] [--out results/chaos]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __name__ == "__main__" and "--job" in sys.argv:
    import sn_trainer

    sn_trainer.warm_up()  # before torch: the fork server imports it while this process does

import torch  # noqa: E402
from torch import nn  # noqa: E402

from sn_trainer import Callback  # noqa: E402

# The tests' stand-in tracking server (test_mlflow_down.py uses it too): one copy of it, kept with them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tracking_stub import TrackingStub  # noqa: E402

FAULTS = ("kill_worker", "stop_worker", "term_group", "int_launcher", "truncate_checkpoint", "full_disk",
          "worker_raises", "second_run", "eval_fails", "tracker_gone")
STEPS, EVERY, TIMEOUT_S = 40, 5, 6
HERE = Path(__file__).resolve()


# --- one job: what an operator starts (and starts again) ------------------------------------------

def job(work: Path, trigger: Path) -> int:
    """Train (or go on training) in ``work``; exit codes as the command line's."""
    from torch.utils.data import TensorDataset

    from sn_trainer import BestCheckpoint, CheckpointError, Trainer, TrainingInterrupted, WorkerFailed
    from sn_trainer.models import build_model

    torch.manual_seed(0)
    model = Faulty(build_model("lenet", (1, 28, 28), 10), str(trigger))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 1, 28, 28, generator=g), torch.randint(0, 10, (2048,), generator=g))
    test = FailingOnce(TensorDataset(torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)),
                       str(trigger) + ".eval")
    ckpt = work / "ckpt"
    progress = (work / "progress").open("a")
    trainer = Trainer(workers=2, batch_size=64, max_steps=STEPS, seed=0, comm="shm", log_every=1, eval_every=EVERY,
                      checkpoint_dir=str(ckpt), checkpoint_every_steps=EVERY, checkpoint_keep=3, max_restarts=2,
                      worker_timeout=TIMEOUT_S, resume="latest" if any(ckpt.glob("step-*.pt")) else None)
    told, best = Told(), BestCheckpoint("eval_loss")
    callbacks = [told, best, Hold(str(trigger) + ".hold")]
    if os.environ.get("CHAOS_TRACKING"):
        from sn_trainer.report.mlflow_log import MLflowLog

        callbacks.append(MLflowLog(os.environ["CHAOS_TRACKING"], "chaos", work.name, {"steps": STEPS}))
    try:
        trainer.fit(model, data, eval_set=test, optimizer=functools.partial(torch.optim.SGD, lr=0.02, momentum=0.9),
                    callbacks=callbacks, on_log=lambda r: (progress.write(f"{r['step']}\n"), progress.flush()))
    except TrainingInterrupted as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (WorkerFailed, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except CheckpointError as exc:  # refused before training: nothing of the folder's is touched
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.save({k.removeprefix("inner."): v for k, v in model.state_dict().items()}, work / "final.pt")
    best_step = torch.load(ckpt / "best.pt", weights_only=True)["step"] if (ckpt / "best.pt").exists() else None
    (work / "outcome.json").write_text(json.dumps({"evaluations": told.steps, "losses": told.losses,
                                                   "best_step": best_step}))
    return 0


class Told(Callback):
    """A stateful callback: the evaluations it was told of, with their losses (None: it failed).
    Kept in every checkpoint, so that a run resumed or restarted is told of each evaluation once,
    as the uninterrupted run is."""

    def __init__(self):
        self.steps, self.losses = [], {}

    def on_eval_end(self, trainer, evaluation):
        self.steps.append(evaluation.step)
        self.losses[str(evaluation.step)] = evaluation.metrics.get("eval_loss")

    def state_dict(self):
        return {"steps": list(self.steps), "losses": dict(self.losses)}

    def load_state_dict(self, state):
        self.steps, self.losses = list(state["steps"]), dict(state["losses"])


class Hold(Callback):
    """Holds the run at a step while ``path`` exists: a first run still training when a second one
    is started beside it (a whole job here takes about as long as a run's start)."""

    def __init__(self, path: str):
        self.path = path

    def on_step_end(self, trainer, record):
        while os.path.exists(self.path):
            time.sleep(0.05)  # a file of another program: nothing to wait on instead


class FailingOnce(torch.utils.data.Dataset):
    """An evaluation set one of whose samples fails to load once, after ``trigger`` appears."""

    def __init__(self, inner, trigger: str):
        self.inner, self.trigger = inner, trigger

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        try:
            os.rename(self.trigger, self.trigger + ".fired")  # exactly one worker wins, once
        except OSError:
            return self.inner[index]
        raise RuntimeError("chaos: an evaluation fails")


class Faulty(nn.Module):
    """A model whose worker raises once, in the training step after ``trigger`` appears (not in an
    evaluation: that is the fault eval_fails)."""

    def __init__(self, inner: nn.Module, trigger: str):
        super().__init__()
        self.inner, self.trigger = inner, trigger

    def forward(self, x):
        if not self.training:
            return self.inner(x)
        try:
            os.rename(self.trigger, self.trigger + ".fired")  # exactly one worker wins, once
        except OSError:
            return self.inner(x)
        raise RuntimeError("chaos: a worker raises")


# --- the orchestra ---------------------------------------------------------------------------------

def start(work: Path, trigger: Path, marker: str, tracking: str | None = None) -> subprocess.Popen:
    """The job in a process group of its own, as a scheduler starts one; tracked at ``tracking``."""
    env = {**os.environ, "CHAOS_MARKER": marker, **({"CHAOS_TRACKING": tracking} if tracking else {})}
    with (work / "stderr").open("a") as stderr:
        return subprocess.Popen([sys.executable, str(HERE), "--job", str(work), "--trigger", str(trigger)],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)


def reached(work: Path) -> int:
    path = work / "progress"
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-1]) if lines else 0


def workers_of(proc: subprocess.Popen) -> list:
    import psutil

    try:
        return [p for p in psutil.Process(proc.pid).children(recursive=True)
                if not p.children() and "resource_tracker" not in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)  # polling files and processes of other programs: nothing to wait on instead


def marked(marker: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("CHAOS_MARKER") == marker:
                found.append(p)
        except psutil.Error:
            continue
    return found


def inject(kind: str, proc: subprocess.Popen, work: Path, trigger: Path, marker: str, rng: random.Random,
           tracker) -> int | None:
    """Strike; a second run's exit code (the others: None)."""
    if kind == "tracker_gone":
        tracker.go_away()
    elif kind in ("kill_worker", "stop_worker"):
        wait_for(lambda: len(workers_of(proc)) == 2, 60, "two workers")
        rng.choice(workers_of(proc)).send_signal(signal.SIGKILL if kind == "kill_worker" else signal.SIGSTOP)
    elif kind in ("term_group", "truncate_checkpoint"):
        os.killpg(proc.pid, signal.SIGTERM)
    elif kind == "int_launcher":
        proc.send_signal(signal.SIGINT)
    elif kind == "worker_raises":
        trigger.write_text("")
    elif kind == "eval_fails":
        Path(str(trigger) + ".eval").write_text("")
    elif kind == "second_run":  # another operator starts the same job in the same folder
        hold = Path(str(trigger) + ".hold")
        hold.write_text("")  # the first run waits at its next step until the second has ended
        try:
            return start(work, trigger, marker).wait(timeout=240)  # its processes are this job's to account for
        finally:
            hold.unlink()
    elif kind == "full_disk":
        fd = os.open(work / "ckpt" / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 65536):  # until the file system is full
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
    return None


def damage_newest(work: Path) -> None:
    newest = sorted((work / "ckpt").glob("step-*.pt"))[-1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])


def snapshot() -> dict:
    tmp = tempfile.gettempdir()
    return {"shm": set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set(),
            "tmp": {d for d in os.listdir(tmp) if d.startswith(("sn_trainer-", "pymp-"))}}


# What the job says when each fault struck it: a fault injected after the job finished, or one
# its processes never met, did not fire.
EVIDENCE = {"kill_worker": "killed by SIGKILL", "stop_worker": "made no progress for",
            "worker_raises": "chaos: a worker raises", "truncate_checkpoint": "passing over a damaged checkpoint",
            "full_disk": "cannot write the checkpoint", "second_run": "is being written by another run",
            "eval_fails": "passes over the evaluation after step", "tracker_gone": "the run goes on untracked"}


def fired(kind: str, row: dict, work: Path) -> bool:
    """Whether the fault struck the job, from its exit codes and its log."""
    if kind == "term_group":
        return 128 + signal.SIGTERM in row["exit_codes"]
    if kind == "int_launcher":
        return 128 + signal.SIGINT in row["exit_codes"]
    if kind == "second_run":  # refused, exit 2, while the first went on
        return row.get("second_run_exit") == 2 and EVIDENCE[kind] in (work / "stderr").read_text()
    return EVIDENCE[kind] in (work / "stderr").read_text()


def same_outcome(got: dict, reference: dict) -> bool:
    """Told of the same evaluations, with the same losses (bit for bit) where they did not fail,
    and best.pt at the uninterrupted run's best among the evaluations that did not fail here."""
    failed = {step for step, loss in got["losses"].items() if loss is None}
    kept = [(loss, int(step)) for step, loss in reference["losses"].items() if step not in failed]
    return (got["evaluations"] == reference["evaluations"]
            and all(got["losses"][step] == loss for step, loss in reference["losses"].items() if step not in failed)
            and got["best_step"] == min(kept)[1])  # the first of equal bests is kept: the lowest step


def run_fault(kind: str, index: int, rng: random.Random, base: Path, reference: dict, outcome: dict) -> dict:
    work = base / f"{index:03d}-{kind}"
    (work / "ckpt").mkdir(parents=True)
    mounted = False
    if kind == "full_disk":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(work / "ckpt")], check=True)
        mounted = True
    trigger, marker, before = work / "trigger", uuid.uuid4().hex, snapshot()
    tracker = TrackingStub().start() if kind == "tracker_gone" else None
    at = rng.randrange(EVERY + 1, STEPS - EVERY)
    row = {"fault": kind, "at_step": at, "attempts": 0, "exit_codes": []}
    try:
        proc = start(work, trigger, marker, tracker.uri if tracker else None)
        wait_for(lambda: reached(work) >= at or proc.poll() is not None, 180, f"step {at}")
        second = inject(kind, proc, work, trigger, marker, rng, tracker)
        if second is not None:
            row["second_run_exit"] = second
        for attempt in range(6):
            code = proc.wait(timeout=240)
            row["attempts"] += 1
            row["exit_codes"].append(code)
            if code == 0:
                break
            if kind == "truncate_checkpoint" and attempt == 0:
                damage_newest(work)
            if kind == "full_disk":
                (work / "ckpt" / "filler").unlink(missing_ok=True)
            proc = start(work, trigger, marker)  # the operator resumes: resume=latest
        row["fired"] = fired(kind, row, work)
        row["finished"] = (work / "final.pt").exists()
        if row["finished"]:
            final = torch.load(work / "final.pt", weights_only=True)
            row["equal"] = all(torch.equal(final[k], reference[k]) for k in reference)
            row["outcome"] = json.loads((work / "outcome.json").read_text())
            row["same_outcome"] = same_outcome(row["outcome"], outcome)
        else:
            row["equal"] = row["same_outcome"] = False
        wait_for(lambda: not marked(marker), 15, "the job's processes to end")
    finally:
        if mounted:
            subprocess.run(["umount", str(work / "ckpt")], check=False)
    after = snapshot()
    row["left"] = {"processes": len(marked(marker)), "shm": len(after["shm"] - before["shm"]),
                   "tmp": len(after["tmp"] - before["tmp"]),
                   "partial_checkpoints": len(list((work / "ckpt").glob(".*.tmp-*")))}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--kinds", default=",".join(FAULTS), help="comma-separated fault kinds to draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trigger", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        from sn_trainer.engine.processes.forkserver import leave

        leave(job(args.job, args.trigger))
    from sn_trainer.node.cpu import describe_machine
    from sn_trainer.report.results import write_result

    kinds = args.kinds.split(",")
    if "full_disk" in kinds and os.geteuid() != 0:
        print("full_disk needs root (a tmpfs mount): left out")
        kinds.remove("full_disk")
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        base = Path(tmp)
        reference_dir = base / "reference"
        (reference_dir / "ckpt").mkdir(parents=True)
        started = time.monotonic()
        code = start(reference_dir, reference_dir / "never", "reference").wait(timeout=300)
        if code != 0:
            raise SystemExit(f"the uninterrupted run failed ({code}): {(reference_dir / 'stderr').read_text()}")
        reference = torch.load(reference_dir / "final.pt", weights_only=True)
        outcome = json.loads((reference_dir / "outcome.json").read_text())
        print(f"uninterrupted run: {time.monotonic() - started:.0f} s", flush=True)
        for index in range(args.faults):
            kind = rng.choice(kinds)
            row = run_fault(kind, index, rng, base, reference, outcome)
            rows.append(row)
            print(f"{index + 1:3d} {kind:20s} at step {row['at_step']:2d}: fired {row['fired']}, exits "
                  f"{row['exit_codes']}, finished {row['finished']}, equal {row['equal']}, same evaluations and best "
                  f"{row['same_outcome']}, left {row['left']}",
                  flush=True)
    table = summarise(rows)
    if not args.out:
        print(table)
    else:
        machine = describe_machine()
        report = {"machine": machine, "seed": args.seed, "rows": rows,
                  "command": f"python scripts/chaos.py --faults {args.faults}"}
        write_result(args.out, report, (
            f"# Chaos: {len(rows)} jobs, one random fault each\n\nMachine: {machine['cpu_model']}, "
            f"{machine['physical_cores']} physical cores, torch {machine['torch']}. `python scripts/chaos.py "
            f"--faults {args.faults}` (seed {args.seed}): LeNet, 2 workers, {STEPS} steps, a checkpoint every "
            f"{EVERY}, an evaluation every {EVERY} with BestCheckpoint and a stateful callback, max_restarts=2, "
            f"worker_timeout={TIMEOUT_S}; each job resumed with resume=latest until it finished, then compared with "
            "an uninterrupted run (torch.equal on every tensor; the evaluations its callbacks were told of and "
            "best.pt's step, which after a failed evaluation is the best of the others). A second run in the same "
            "folder is refused (exit 2) while the first goes on.\n\n" + table))


def summarise(rows: list[dict]) -> str:
    by = collections.defaultdict(list)
    for r in rows:
        by[r["fault"]].append(r)
    lines = ["| fault | injected | fired | jobs finished | weights equal to the uninterrupted run "
             "| evaluations told and best.pt as uninterrupted | attempts (mean) | exit codes seen "
             "| processes, /dev/shm, temp dirs, partial checkpoints left |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for kind in FAULTS:
        group = by.get(kind, [])
        if not group:
            continue
        codes = sorted({c for r in group for c in r["exit_codes"]})
        left = [sum(r["left"][k] for r in group) for k in ("processes", "shm", "tmp", "partial_checkpoints")]
        lines.append(f"| {kind} | {len(group)} | {sum(r['fired'] for r in group)} | {sum(r['finished'] for r in group)} "
                     f"| {sum(r['equal'] for r in group)} | {sum(r['same_outcome'] for r in group)} "
                     f"| {sum(r['attempts'] for r in group) / len(group):.1f} "
                     f"| {', '.join(map(str, codes))} | {', '.join(map(str, left))} |")
    total_left = sum(v for r in rows for v in r["left"].values())
    lines.append(f"| **all** | {len(rows)} | {sum(r['fired'] for r in rows)} | {sum(r['finished'] for r in rows)} "
                 f"| {sum(r['equal'] for r in rows)} | {sum(r['same_outcome'] for r in rows)} | | | {total_left} in all |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
