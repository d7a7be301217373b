"""The gloo reducer's buckets: sent while the backward pass runs, summed exactly, reset each step."""
import pytest
import torch
from torch import nn

from sn_trainer.engine.comm import GlooReducer
from sn_trainer.engine.shared import attach_gradients, shard_bounds

pytestmark = pytest.mark.timeout(60)


def test_buckets_leave_during_the_backward_pass_and_unused_ones_at_the_reduce(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    unused = nn.Linear(32, 32)  # never in the graph: its bucket can only leave from reduce()
    params = [*model.parameters(), *unused.parameters()]
    numel = sum(p.numel() for p in params)
    reducer = GlooReducer(str(tmp_path / "store"), 0, 1, shard_bounds(numel, 1)[0], numel, torch.float32)
    try:
        holder = nn.ModuleList([model, unused])
        attach_gradients(holder, reducer.grad_flat, channels_last=False)
        reducer.watch(params, backward_passes=1, bucket_bytes=256)  # one layer per bucket
        buckets = reducer._buckets
        assert len(buckets) == 4
        # The first layer's weight is the last gradient the backward pass computes: when it
        # arrives, the buckets of the later layers have left already; the first layer's (held
        # for reduce()) and the unused layer's (never filled) have not.
        seen = []
        model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append([b.sent for b in buckets]))
        x = torch.randn(8, 32)
        expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        for _ in range(2):  # a second step: buckets start over
            reducer.grad_flat.zero_()
            model(x).square().sum().backward()
            sent = seen.pop()
            unused_bucket = [b for b in buckets if any(p is unused.weight for p in b.params)][0]
            assert sent == [b is not unused_bucket and b is not buckets[-1] for b in buckets]  # all but those two
            local = reducer.local_sum()
            reducer.reduce()  # a world of one: the sum is the gradient itself
            got = [p.grad for p in model.parameters()]
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e)
            assert local == pytest.approx(sum(e.sum().item() for e in expected), rel=1e-5)
            assert not any(b.sent for b in buckets)
    finally:
        reducer.close()
