"""A training script's own classes and functions (its ``__main__``) in the workers: every kind a
user brings travels to the workers and back, and a traceback through them names the script's file,
line and source."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent('''
    import os
    import sys

    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from sn_trainer import Callback, Trainer


    class Pairs(Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i]}


    def collate(items):
        return torch.stack([i["x"] for i in items]), torch.stack([i["y"] for i in items])


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            failing = MODE == "fail_early" or (MODE == "fail_late" and os.path.exists(FLAG))
            return fail_here(x) if failing else self.fc(x)


    def fail_here(x):
        raise ValueError("the script's own forward fails")


    class Loss(nn.Module):
        def forward(self, out, y):
            return nn.functional.cross_entropy(out, y)


    class Plain(torch.optim.Optimizer):  # not proven elementwise: stepped whole, its state comes back
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["steps"] = self.state[p].get("steps", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"])


    class Halve(torch.optim.lr_scheduler.LRScheduler):
        def get_lr(self):
            return [base / (1 + self.last_epoch) for base in self.base_lrs]


    class Seen(Callback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, trainer, record):
            self.steps.append(record.step)
            if record.step == 2:
                open(FLAG, "w").close()  # the workers' forward fails from now on (MODE fail_late)


    def accuracy(model, batch):
        x, y = batch
        return {"hits": ((model(x).argmax(1) == y).sum().item(), len(y))}


    MODE, FLAG = sys.argv[1], sys.argv[2] + ".flag"

    if __name__ == "__main__":
        seen = Seen()
        result = Trainer(workers=2, batch_size=8, max_steps=4, log_every=1, eval_every=2, threads=1,
                         checkpoint_dir=sys.argv[2], checkpoint_every_steps=2).fit(
            Net(), Pairs(64), eval_set=Pairs(16), optimizer=Plain, scheduler=Halve, loss_fn=Loss(),
            collate_fn=collate, metric_fn=accuracy, callbacks=[seen])
        print("steps", result.steps, "seen", seen.steps, "hits", result.eval_metrics["eval_hits"])
''')


def run(tmp_path, mode):
    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), mode, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=150, cwd=tmp_path)


@pytest.mark.quick
def test_every_kind_of_object_a_script_defines_goes_to_the_workers_and_back(tmp_path, no_leaks):
    done = run(tmp_path, "train")
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    assert words[:2] == ["steps", "4"] and "".join(words[3:7]) == "[1,2,3,4]", done.stdout
    assert 0.0 <= float(words[-1]) <= 1.0


@pytest.mark.parametrize("mode, error", [("fail_early", "UserCodeError"), ("fail_late", "WorkerFailed")])
def test_a_traceback_through_the_scripts_own_code_names_its_file_line_and_source(tmp_path, no_leaks, mode, error):
    """fail_early: the rehearsal's first slice fails (in a worker process, before training);
    fail_late: a training worker fails at step 3."""
    done = run(tmp_path, mode)
    assert done.returncode != 0 and f"sn_trainer.errors.{error}" in done.stderr, done.stderr[-3000:]
    script = str(tmp_path / "train_mine.py")
    assert "<dynamic-code>" not in done.stderr
    lines = done.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f'File "{script}"') and "fail_here" in line)
    assert lines[at + 1].strip() == 'raise ValueError("the script\'s own forward fails")', done.stderr[-3000:]
