"""Parameters exist once, in shared memory; optimizer state exists once, sharded."""
import functools
import resource

import pytest
import torch

from helpers import SmallConvNet, probe_replica, tiny_dataset
from sn_trainer import Trainer
from sn_trainer.data.source import IndexSource
from sn_trainer.recipe.flat_layout import FlatLayout
from sn_trainer.engine.memory.shared import SharedParams, resident_pages_by_node
from sn_trainer.engine.plan import Plan
from sn_trainer.recipe.objective import Objective
from sn_trainer.engine.step.phases import PhaseSpec
from sn_trainer.fit.preflight import Findings
from sn_trainer.fit.resolve import Run
from sn_trainer.fit.session import launch_workers

pytestmark = pytest.mark.timeout(120)


@pytest.mark.quick
def test_parameters_are_views_of_one_shared_tensor_and_state_is_sharded(no_leaks):
    torch.manual_seed(0)
    model = SmallConvNet()
    numel = sum(p.numel() for p in model.parameters())
    trainer = Trainer(workers=2, threads=1, batch_size=8, max_steps=1)
    layout = FlatLayout(model, world_size=2)
    plan = Plan(settings=trainer.settings, placement=trainer.placement, dataset_size=84, steps_per_epoch=10,
                total_steps=1, start_step=0, loss_form="mean", phase_forms=(), evaluates=False, metrics=(),
                evaluate_only=False, checkpointing=False)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    phases = [PhaseSpec("train", Objective(), sgd, None, (0,) * len(layout.slots))]
    run = Run(model=model, train=IndexSource(tiny_dataset(), trainer.settings), evaluation=None, objective=Objective(),
              phases=phases, layout=layout, findings=Findings((), ()), first_plan=plan, checkpoints=None,
              resume_from=None, sample_order={}, run_config=None, initial_state={})
    reports, _, _ = launch_workers(run, plan, trainer._stop, None, target=probe_replica)
    assert all(r["storages"] and r["all_shared"] for r in reports)
    assert [r["seen"] for r in reports] == [42.0, 42.0]
    # Optimizer state: one momentum buffer per shard, adding up to the parameters, once.
    assert sum(r["shard_size"] for r in reports) == numel
    assert sum(r["state_numel"] for r in reports) == numel
    # The caller's model saw the write and the step: 42 - lr * (1 + 1) from two workers' ones.
    assert model.conv.weight.view(-1)[0].item() == pytest.approx(42.0 - 0.1 * 2)
    assert not any(p.is_shared() for p in model.parameters())  # handed back as private memory


def vector(numel):
    return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(numel))])


@pytest.mark.unit
def test_elementwise_shards_cover_the_parameters_exactly():
    for numel in (1, 5, 97, 1000):
        for world in (1, 2, 3, 7):
            shards = FlatLayout(vector(numel), world).shards
            assert sum(s.size for s in shards) == numel
            assert shards[0].start == 0 and shards[-1].stop == numel
            assert len({s.padded_size for s in shards}) == 1


@pytest.mark.unit
def test_whole_tensor_shards_are_runs_of_whole_parameters_balanced_by_size():
    sizes = [50, 10, 10, 30, 5, 5, 40]
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])
    layout = FlatLayout(model, 3, shards="tensors")
    bounds = {0, *[sum(sizes[:i + 1]) for i in range(len(sizes))]}
    assert all(s.start in bounds and s.stop in bounds for s in layout.shards)
    assert [s.size for s in layout.shards] == [50, 50, 50]  # the best split of these sizes into 3 runs
    assert sum(len(layout.pieces(r)) for r in range(3)) == len(sizes)
    assert all(piece.whole for r in range(3) for piece in layout.pieces(r))
    few = FlatLayout(torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4))]), 3, shards="tensors")
    assert [s.size for s in few.shards] == [4, 0, 0]  # more workers than tensors: some update nothing


@pytest.mark.unit
def test_the_layout_converts_channels_last_values_to_each_parameters_shape_and_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    contiguous = [p.detach().clone() for p in model.parameters()]
    layout = FlatLayout(model, world_size=1, channels_last=True)
    shared = SharedParams(model, layout)
    stored = shared.flat[: layout.slots[0].numel]
    assert not torch.equal(stored, contiguous[0].reshape(-1))  # a 3-channel weight really is permuted
    assert torch.equal(layout.to_logical(0, stored), contiguous[0])
    assert torch.equal(layout.to_stored(0, contiguous[0]), stored)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    SharedParams.release(model)


def _reducer(shared, rank: int, numel: int):
    from sn_trainer.engine.collectives.in_node import ShmReducer
    from sn_trainer.engine.collectives.reducer import ReducerSetup
    from sn_trainer.recipe.flat_layout import Shard

    half = numel // 2
    return ShmReducer(ReducerSetup(rank=rank, world_size=2, shard=Shard(rank * half, (rank + 1) * half, half),
                                   padded_numel=numel, dtype=torch.float32, store_path="", mode="all_reduce",
                                   timeout_s=60.0, shared=shared))


def _other_worker(shared, numel: int, done) -> None:
    reducer = _reducer(shared, 0, numel)
    done.wait(60)
    reducer.close()


def test_each_gradient_row_is_first_touched_by_its_own_worker(tmp_path):
    """NUMA first touch: the launcher allocates the rows without touching a page; a worker's
    reducer touches its own row, and only that, so the kernel puts the row on the node of the
    worker's cores. Pages resident in this process (worker 1; worker 0 is another process), by
    node, from /proc/self/numa_maps."""
    import multiprocessing

    from sn_trainer.engine.collectives.in_node import ShmShared

    numel = 1 << 20  # 4 MiB of float32 a row: 1024 pages
    shared = ShmShared.allocate(2, numel, torch.float32)
    rows = shared.segment.bytes(shared.rows_offset, 2 * numel * 4)
    assert sum(resident_pages_by_node(rows).values()) == 0  # untouched by the launcher
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    other = context.Process(target=_other_worker, args=(shared, numel, done))
    other.start()
    try:
        reducer = _reducer(shared, 1, numel)
        row_pages, control_pages = numel * 4 // resource.getpagesize(), shared.rows_offset // resource.getpagesize()
        resident = sum(resident_pages_by_node(rows).values())  # of the whole segment's mapping
        assert row_pages <= resident <= row_pages + control_pages  # its own row, no other
        assert torch.count_nonzero(rows) == 0  # and every row reads as zeros
        reducer.close()
    finally:
        done.set()
        other.join(60)
    del rows
    shared.release()


@pytest.mark.unit
def test_numa_maps_lines_are_read_by_node(tmp_path):
    tensor = torch.zeros(4)
    address = tensor.data_ptr()
    maps = tmp_path / "numa_maps"
    maps.write_text(f"{address - 4096:x} default file=/dev/shm/x dirty=5 mapped=7 N0=3 N1=4 kernelpagesize_kB=4\n"
                    f"{address + (1 << 40):x} default anon=1 N0=1 kernelpagesize_kB=4\n")
    assert resident_pages_by_node(tensor, str(maps)) == {0: 3, 1: 4}
