"""Models of thousands of tensors start: every tensor shared with the workers holds a file
descriptor in the launcher (and in each worker), and none of the waits may be limited to select's
1,024 descriptors."""
import functools
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from sn_trainer import Trainer

pytestmark = pytest.mark.timeout(300)


class ManyLayers(nn.Module):
    """1,000 Linear layers side by side: 2,000 parameter tensors."""

    def __init__(self, layers: int = 1000):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 3) for _ in range(layers))

    def forward(self, x):
        return torch.stack([layer(x) for layer in self.layers]).mean(0)


def data(n, shape, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick)])
def test_a_model_of_two_thousand_parameter_tensors_trains(workers, no_leaks):
    torch.manual_seed(0)
    model = ManyLayers()
    assert len(list(model.parameters())) == 2000
    before = [p.detach().clone() for p in model.parameters()]
    result = Trainer(workers=workers, batch_size=8, max_steps=2, threads=1).fit(
        model, data(32, (4,), 3), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert result.steps == 2
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_resnet152_takes_a_step(no_leaks):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet152(num_classes=4)
    assert len(list(model.parameters())) + len(list(model.buffers())) > 900  # each a descriptor, with the rest
    result = Trainer(workers=2, batch_size=4, max_steps=1, threads=1).fit(
        model, data(8, (3, 32, 32), 4), optimizer=functools.partial(torch.optim.SGD, lr=0.01))
    assert result.steps == 1 and torch.isfinite(torch.tensor(result.final_loss))


def test_a_soft_limit_of_1024_open_files_is_no_limit_to_the_model(tmp_path):
    """Many systems start processes with a soft limit of 1,024 descriptors: the launcher raises it
    to the hard limit for itself and its workers."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard == resource.RLIM_INFINITY or hard > 4096, "this machine's hard limit leaves nothing to show"
    script = tmp_path / "many.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "from test_many_tensors import ManyLayers, data\n"
                      "import functools, torch\nfrom sn_trainer import Trainer\n"
                      "if __name__ == '__main__':\n"
                      "    r = Trainer(workers=2, batch_size=8, max_steps=1, threads=1).fit(ManyLayers(), data(16, (4,), 3),"
                      " optimizer=functools.partial(torch.optim.SGD, lr=0.1))\n"
                      "    print('steps', r.steps)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["steps", "1"], done.stderr[-3000:]
