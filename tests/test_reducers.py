"""The gloo reducer's buckets: sent while the backward pass runs, in one fixed order, exact sums."""
import pytest
import torch
from torch import nn

from sn_trainer.engine.collectives.over_gloo import GlooReducer
from sn_trainer.engine.collectives.reducer import ReducerSetup
from sn_trainer.recipe.flat_layout import FlatLayout

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]  # the unit tier: starts no process


def three_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def watched(tmp_path, holder: nn.Module) -> GlooReducer:
    """A reducer in a world of one (the sum is the gradient itself), one layer per bucket."""
    layout = FlatLayout(holder, world_size=1)
    reducer = GlooReducer(ReducerSetup(rank=0, world_size=1, shard=layout.shards[0], padded_numel=layout.numel,
                                       dtype=torch.float32, store_path=str(tmp_path / "store"), mode="all_reduce",
                                       timeout_s=300.0))
    layout.attach_gradients(holder, reducer.grad_flat)
    reducer.watch(layout.parameters(holder), layout, backward_passes=1, bucket_bytes=256)
    return reducer


def step_and_check(model, reducer, sent_when_backward_ends):
    """One step: which buckets had left when the first layer's weight got its gradient, and sums."""
    seen = []
    hook = model[0].weight.register_post_accumulate_grad_hook(
        lambda p: seen.append([b.sent for b in reducer._buckets]))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    for _ in range(2):  # a second step: the buckets start over
        reducer.grad_flat.zero_()
        model(x).square().sum().backward()
        assert seen.pop() == sent_when_backward_ends
        local = reducer.local_sum()
        reducer.reduce()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, e)
        assert local == pytest.approx(sum(e.sum().item() for e in expected), rel=1e-5)
        assert not any(b.sent for b in reducer._buckets)
    hook.remove()


@pytest.mark.quick
def test_buckets_leave_during_the_backward_pass_but_the_last(tmp_path):
    model = three_layers()
    reducer = watched(tmp_path, model)
    try:
        assert len(reducer._buckets) == 3  # last layer, middle layer, first layer
        # The first layer's weight is the last gradient backward computes: by then the later
        # layers' buckets have left; the first layer's is held for reduce().
        step_and_check(model, reducer, [True, True, False])
    finally:
        reducer.close()


def test_a_bucket_that_never_fills_holds_back_those_after_it_and_sums_stay_exact(tmp_path):
    model, unused = three_layers(), nn.Linear(32, 32)  # unused: never in the graph, its bucket never fills
    reducer = watched(tmp_path, nn.ModuleList([model, unused]))
    try:
        assert len(reducer._buckets) == 4  # the unused layer's comes first: its parameters are last
        # Buckets leave in one order in every worker (gloo pairs collectives by order), so the
        # unused layer's keeps the others back until reduce() sends them all.
        step_and_check(model, reducer, [False, False, False, False])
    finally:
        reducer.close()
