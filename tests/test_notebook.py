"""Where PyTorch code is first written: a notebook's cells, a script on standard input. Their
classes and functions live in ``__main__``, which no worker can import: they travel by value."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
TESTS = Path(__file__).resolve().parent

CELLS = [
    f"import sys; sys.path.insert(0, {str(TESTS)!r})",
    """
import copy, functools
import torch
import torch.nn.functional as F
from torch import nn
from helpers import plain_batches, tiny_dataset
from sn_trainer import Trainer
""",
    """
class Net(nn.Module):  # defined in a cell: __main__.Net
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3), nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def collate(items):  # a cell's collate: stacks (image, label) pairs
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])


def step(model, batch):  # a cell's step function
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="sum"), len(targets)
""",
    """
torch.manual_seed(0)
model = Net().double()
data = tiny_dataset(dtype=torch.float64)
sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
reference = copy.deepcopy(model)
optimizer = sgd(reference.parameters())
for _, batch in zip(range(4), plain_batches(data, 7, seed=3)):
    optimizer.zero_grad()
    loss_sum, count = step(reference, batch)
    (loss_sum / count).backward()
    optimizer.step()
""",
    """
result = Trainer(workers=2, batch_size=7, max_steps=4, seed=3, log_every=2, eval_every=2).fit(
    model, data, eval_set=data, optimizer=sgd, step_fn=step, collate_fn=collate)
worst = max(((p - q).abs() / q.abs().clamp_min(1e-12)).max().item()
            for p, q in zip(model.parameters(), reference.parameters()))
losses = {key: [r[key] for r in result.history if key in r][-1] for key in ("loss", "eval_loss")}
print(f"losses {losses['loss']:.4f} {losses['eval_loss']:.4f}")
print(f"workers {result.workers}, largest relative difference {worst:.3g}")
""",
]


def test_a_notebook_trains_its_own_classes_and_functions_exactly(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in CELLS])
    NotebookClient(notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                   ).execute()
    # What the cell printed (stdout), not what the run logged on stderr: a busy machine's pin=auto
    # warning speaks of workers too.
    printed = "".join(out.get("text", "") for out in notebook.cells[-1].outputs if out.get("name") == "stdout")
    workers, worst = printed.split("\nworkers ")[1].split(", largest relative difference ")
    assert int(workers) == 2 and float(worst) < 1e-10, printed
    # The progress: tqdm's notebook bar (a widget) over the 4 steps, finished, with the last training
    # loss and the last evaluation's under names of their own; its text form (what a front-end
    # without widgets shows, and the saved notebook) advanced with it.
    loss, eval_loss = printed.split("losses ")[1].split()[:2]
    assert loss != eval_loss
    shown = [out["data"] for out in notebook.cells[-1].outputs
             if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert len(shown) == 1 and "4/4" in shown[0]["text/plain"], shown
    assert f"loss={loss}," in shown[0]["text/plain"] and f"eval_loss={eval_loss}" in shown[0]["text/plain"], shown
    state = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
    bars = [m["state"] for m in state if m["model_name"] == "FloatProgressModel"]
    assert [(b["value"], b["max"], b["bar_style"]) for b in bars] == [(4.0, 4.0, "success")]
    assert any("4/4" in m["state"]["value"] and f"loss={loss}," in m["state"]["value"]
               and f"eval_loss={eval_loss}" in m["state"]["value"] for m in state if m["model_name"] == "HTMLModel")


@pytest.mark.quick
def test_a_script_read_from_standard_input_trains():
    script = "\n".join(textwrap.dedent(c) for c in CELLS)
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    workers, worst = done.stdout.split("workers ")[1].split(", largest relative difference ")
    assert int(workers) == 2 and float(worst) < 1e-10, done.stdout
