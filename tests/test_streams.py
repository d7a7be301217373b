"""IterableDatasets: read in order, micro-batch j = items [jB, (j+1)B), exact against plain loops
over the same global batches, and resumed from the position a checkpoint records."""
import copy
import functools
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from helpers import SmallConvNet, assert_exact, cross_entropy, tiny_dataset
from sn_trainer import Trainer, checkpoint
from sn_trainer.checkpoint import CheckpointDir
from sn_trainer.config import TrainerConfig
from sn_trainer.data.stream import StreamSource
from sn_trainer.errors import DataError

pytestmark = pytest.mark.timeout(240)

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


class Shuffled(IterableDataset):
    """A stream of ``n`` (image, label) samples whose order changes with set_epoch, as a Hugging
    Face stream's shuffle does; ``sized``: whether it has a length."""

    def __init__(self, n: int = 20, sized: bool = True, seed: int = 1):
        self.data = tiny_dataset(n=n, seed=seed, dtype=torch.float64)
        self.n, self.sized, self.epoch = n, sized, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        if not self.sized:
            raise TypeError("a stream without a length")
        return self.n

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch))
        for i in order:
            yield self.data[int(i)]


def plain_sized(model, stream, batch_size, epochs, drop_last=True, accumulate=1):
    """Plain PyTorch over a stream with a length: a DataLoader per epoch, set_epoch before it."""
    optimizer = SGD(model.parameters())
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        micro = list(DataLoader(stream, batch_size=batch_size, drop_last=drop_last))
        for first in range(0, len(micro) - (len(micro) % accumulate if drop_last else 0), accumulate):
            group = micro[first : first + accumulate]
            total = sum(len(targets) for _, targets in group)
            optimizer.zero_grad()
            for inputs, targets in group:
                (torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum") / total).backward()
            optimizer.step()
    return model


def passes(stream):
    """A stream without a length, read again each time it ends: one sequence of passes."""
    for epoch in itertools.count():
        stream.set_epoch(epoch)
        yield from stream


def plain_unsized(model, stream, batch_size, steps):
    optimizer = SGD(model.parameters())
    items = passes(stream)
    for _ in range(steps):
        optimizer.zero_grad()
        cross_entropy(model, default_collate(list(itertools.islice(items, batch_size)))).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_a_stream_with_a_length_trains_as_a_dataloader_over_it_each_epoch(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = plain_sized(copy.deepcopy(model), Shuffled(), batch_size=6, epochs=3)
    result = Trainer(workers=workers, batch_size=6, epochs=3).fit(model, Shuffled(), optimizer=SGD)
    assert result.steps == 9 and result.plan["data"] == "stream"  # 20 items: 3 full batches an epoch
    assert_exact(model, reference)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_stream_without_a_length_runs_on_across_its_passes(workers):
    """20 items, batches of 6: batches 3, 6 and 9 run across the seam between two passes."""
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = plain_unsized(copy.deepcopy(model), Shuffled(sized=False), batch_size=6, steps=10)
    result = Trainer(workers=workers, threads=1, batch_size=6, max_steps=10, prefetch=True).fit(
        model, Shuffled(sized=False), optimizer=SGD)
    assert result.steps == 10 and result.plan["steps_per_epoch"] == 10 and result.plan["prefetch"] is True
    assert_exact(model, reference)


def test_a_stream_keeps_its_short_last_batch_and_accumulates_as_a_dataloader_does():
    """drop_last=false: 20 items in micro-batches of 3, two per step: the last step has 2 items."""
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = plain_sized(copy.deepcopy(model), Shuffled(), batch_size=3, epochs=2, drop_last=False, accumulate=2)
    result = Trainer(workers=2, batch_size=3, accumulate=2, epochs=2, drop_last=False).fit(
        model, Shuffled(), optimizer=SGD)
    assert result.steps == 8
    assert_exact(model, reference)


def test_a_stream_evaluates_exactly():
    torch.manual_seed(0)
    model = SmallConvNet().double()
    result = Trainer(workers=2, batch_size=6, max_steps=2, eval_batch_size=4).fit(
        model, Shuffled(), eval_set=Shuffled(n=11, sized=False, seed=5), optimizer=SGD)
    inputs, targets = default_collate(list(Shuffled(n=11, seed=5)))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(inputs), targets).item()
    assert result.eval_metrics["eval_samples"] == 11
    assert result.eval_loss == pytest.approx(expected, rel=1e-12)


class Liar(Shuffled):
    def __len__(self):
        return 30  # yields 20


def test_a_stream_shorter_than_its_length_is_named():
    # Found by a worker mid-run, and raised as itself (one line, no restart).
    with pytest.raises(DataError, match=r"the stream has len\(\) 30 but its pass 0 ended after 20 items"):
        Trainer(workers=2, batch_size=6, epochs=1).fit(SmallConvNet().double(), Liar(), optimizer=SGD)


STREAM_SCRIPT = """
import functools, logging, os, sys
sys.path.insert(0, {tests!r})
import torch
from helpers import SmallConvNet
from test_streams import Shuffled
from sn_trainer import Trainer

class Stopping(Shuffled):
    '''SIGTERMs the worker reading it, the first time a worker reads item {stop_at} of the whole sequence.'''

    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if self.epoch * self.n + i == {stop_at}:
                try:
                    os.close(os.open({flag!r}, os.O_CREAT | os.O_EXCL))
                    os.kill(os.getpid(), 15)
                except FileExistsError:
                    pass
            yield item

class Recording(Shuffled):
    '''Notes each pass it is asked for: a resume opens the checkpoint's pass, not the first.'''

    def set_epoch(self, epoch):
        super().set_epoch(epoch)
        with open({passes!r}, "a") as f:
            f.write(f"{{os.getpid()}} {{epoch}}\\n")

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    model = SmallConvNet().double()
    stream = dict(stop=Stopping, resume=Recording).get(sys.argv[1], Shuffled)(sized=False)
    Trainer(workers=2, batch_size=6, max_steps={steps}, checkpoint_dir=sys.argv[2], checkpoint_every_steps=1,
            resume=sys.argv[3] if len(sys.argv) > 3 else None).fit(
        model, stream, optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))
"""


# The signal goes to the worker that read the item, whose handler runs in the step it reads for. Sent to the
# launcher, it waited while the launcher wrote a checkpoint (the workers do not wait for that): the workers,
# at about 2 ms a step, were 20 steps further on when its handler ran. The launcher's signal is tested with
# the launcher's own timing in test_faults and test_run_owns.
STEPS = 14


def test_a_stream_stopped_by_sigterm_resumes_bit_exactly_from_its_position(tmp_path, no_leaks):
    """Stopped in the third pass of a 20-item stream; the checkpoint records the pass and the
    items of it already read, and the resumed run ends where the uninterrupted one does."""
    script = tmp_path / "train_stream.py"
    script.write_text(STREAM_SCRIPT.format(tests=os.path.dirname(__file__), stop_at=45, steps=STEPS,
                                           flag=str(tmp_path / "stopped.flag"), passes=str(tmp_path / "passes")))

    def run(*args):
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=180)

    whole = run("whole", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    stopped = run("stop", str(tmp_path / "stopped"))
    assert stopped.returncode == 1 and "TrainingInterrupted: stopped by SIGTERM after step" in stopped.stderr
    saved = checkpoint.load(CheckpointDir(tmp_path / "stopped").latest())
    step = saved["step"]
    assert 6 <= step < STEPS  # item 45 is read for step 7 (or, a step ahead, for step 8)
    assert saved["run"]["stream"] == {"pass": step * 6 // 20, "offset": step * 6 % 20}
    resumed = run("resume", str(tmp_path / "resumed"), str(tmp_path / "stopped"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {tmp_path / 'stopped'}" in resumed.stderr
    opened = [line.split() for line in (tmp_path / "passes").read_text().splitlines()]
    workers = {pid for pid, _ in opened}  # the launcher reads its first items without set_epoch
    first = {pid: min(int(p) for q, p in opened if q == pid) for pid in workers}
    assert len(workers) == 2 and set(first.values()) == {step * 6 // 20}  # no earlier pass read again
    mine = checkpoint.load(CheckpointDir(tmp_path / "resumed").latest())
    theirs = checkpoint.load(CheckpointDir(tmp_path / "whole").latest())
    assert mine["step"] == theirs["step"] == STEPS
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    assert json.dumps(mine["run"]["stream"]) == json.dumps(theirs["run"]["stream"])


class SharedEpoch(Shuffled):
    """Keeps its epoch in a tensor in shared memory, as a Hugging Face stream does (so that
    DataLoader workers see set_epoch): every process it is sent to shares that tensor."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shared = torch.zeros((), dtype=torch.long).share_memory_()

    def set_epoch(self, epoch):
        self.shared.fill_(epoch)

    @property
    def epoch(self):
        return int(self.shared)

    @epoch.setter
    def epoch(self, value):
        pass  # Shuffled.__init__ sets it; the shared tensor holds it


@pytest.mark.unit
def test_each_worker_reads_a_copy_of_the_stream_of_its_own():
    """A worker's passes must not move another's: each source reads its own copy of the stream,
    and the stream it was given (whose state other workers may share) is left as it was."""
    stream = SharedEpoch(sized=False)
    ahead, behind = StreamSource(stream, TrainerConfig(batch_size=6)), StreamSource(stream, TrainerConfig(batch_size=6))
    ahead.micro_slice(4, 0, 0, 1)  # items 24-29: into pass 1
    assert stream.epoch == 0
    first, _ = behind.micro_slice(0, 0, 0, 1)  # pass 0's first batch, in pass 0's order
    expected = default_collate(list(itertools.islice(iter(SharedEpoch(sized=False)), 6)))
    assert torch.equal(first[0], expected[0]) and torch.equal(first[1], expected[1])
