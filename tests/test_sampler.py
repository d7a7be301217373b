"""The global order and each worker's slice of it."""
import pytest
import torch

from sn_trainer.data.sampler import GlobalBatches, epoch_order, slice_bounds

pytestmark = pytest.mark.unit  # the unit tier: starts no process


@pytest.mark.quick
def test_slices_partition_the_batch_and_differ_by_at_most_one():
    for batch in range(1, 40):
        for world in range(1, batch + 1):
            bounds = [slice_bounds(batch, world, r) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == batch
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_order_depends_only_on_seed_and_epoch():
    assert torch.equal(epoch_order(100, 7, 2), epoch_order(100, 7, 2))
    assert not torch.equal(epoch_order(100, 7, 2), epoch_order(100, 7, 3))
    assert not torch.equal(epoch_order(100, 7, 2), epoch_order(100, 8, 2))
    assert sorted(epoch_order(100, 7, 2).tolist()) == list(range(100))


def test_accumulated_micro_batches_cover_the_same_samples():
    whole = GlobalBatches(50, 10, 1, seed=1)
    halves = GlobalBatches(50, 5, 2, seed=1)
    assert whole.steps_per_epoch == halves.steps_per_epoch == 5
    for step in range(5):
        joined = torch.cat([halves.indices(0, step, 0), halves.indices(0, step, 1)])
        assert torch.equal(joined, whole.indices(0, step, 0))


def test_last_incomplete_batch_is_dropped():
    batches = GlobalBatches(23, 5, 1, seed=0)
    assert batches.steps_per_epoch == 4
    seen = torch.cat([batches.indices(0, s, 0) for s in range(4)])
    assert len(set(seen.tolist())) == 20
