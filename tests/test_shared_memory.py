"""Parameters exist once, in shared memory; optimizer state exists once, sharded."""
import functools

import pytest
import torch

from helpers import SmallConvNet, probe_replica, tiny_dataset
from sn_trainer import Trainer
from sn_trainer.engine.shared import FlatOrder, SharedParams, shard_bounds

pytestmark = pytest.mark.timeout(120)


def test_parameters_are_views_of_one_shared_tensor_and_state_is_sharded(no_leaks):
    torch.manual_seed(0)
    model = SmallConvNet()
    numel = sum(p.numel() for p in model.parameters())
    trainer = Trainer(workers=2, threads=1, batch_size=8, max_steps=1)
    plan = trainer._plan(model, 1, 1)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    reports, _ = trainer._run(model, tiny_dataset(), None, sgd, None, torch.nn.CrossEntropyLoss(), plan, None,
                              target=probe_replica)
    assert all(r["storages"] and r["all_shared"] for r in reports)
    assert [r["seen"] for r in reports] == [42.0, 42.0]
    # Optimizer state: one momentum buffer per shard, adding up to the parameters, once.
    assert sum(r["shard_size"] for r in reports) == numel
    assert sum(r["state_numel"] for r in reports) == numel
    # The caller's model saw the write and the step: 42 - lr * (1 + 1) from two workers' ones.
    assert model.conv.weight.view(-1)[0].item() == pytest.approx(42.0 - 0.1 * 2)
    assert not any(p.is_shared() for p in model.parameters())  # handed back as private memory


def test_shards_cover_the_parameters_exactly():
    for numel in (1, 5, 97, 1000):
        for world in (1, 2, 3, 7):
            shards = shard_bounds(numel, world)
            assert sum(s.size for s in shards) == numel
            assert shards[0].start == 0 and shards[-1].stop == numel
            assert len({s.padded_size for s in shards}) == 1


def test_flat_order_converts_channels_last_state_to_contiguous_and_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    contiguous = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shared = SharedParams(model, world_size=1, channels_last=True)
    order = FlatOrder(model, channels_last=True)
    laid_out = shared.flat[: shared.numel]
    assert not torch.equal(laid_out, contiguous)  # a 3-channel weight really is permuted
    assert torch.equal(order.to_contiguous(laid_out), contiguous)
    assert torch.equal(order.to_flat(contiguous), laid_out)
    assert FlatOrder(model, channels_last=False).to_flat(contiguous) is contiguous
