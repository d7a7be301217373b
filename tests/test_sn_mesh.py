"""What torch builds on a process group, over "sn" as over gloo: group names and subgroups (made, overlapping,
destroyed), functional collectives, DeviceMesh, DTensor and FSDP2, a refused PREMUL_SUM, and "sn" made again
on the same store after destroy_process_group().

One spawned set of 4 processes runs it all, once as "sn", once as gloo, then "sn" again on the same store;
each rank saves what it got, and the test compares the two backends and the exact results.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks, saved_results as results
from test_sn_backend import bitwise

pytestmark = pytest.mark.timeout(240)

WORLD = 4
STEPS = 3
CPU = torch.device("cpu")


def mesh_job(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    store = dist.FileStore(store_path, world)
    got = {}
    for phase, backend, run in (("sn", "sn", everything), ("gloo", "gloo", everything), ("sn again", "sn", again)):
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        got[phase] = run(rank, world, backend)
        dist.destroy_process_group()
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))


def everything(rank: int, world: int, backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    got = subgroups(rank, backend)
    got.update(functional(rank, world))
    line = init_device_mesh("cpu", (world,))
    square = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    got["mesh backends"] = [(dist.get_backend(g), type(g._get_backend(CPU)).__name__)
                            for g in (line.get_group(), square.get_group("replicate"), square.get_group("shard"))]
    got.update(dtensors(rank, line, square))
    got["fsdp line"] = fsdp_steps(rank, line)
    got["hsdp square"] = fsdp_steps(rank, square)
    got["fsdp pair"] = fsdp_steps(rank, square["shard"])  # ranks 0, 1 and ranks 2, 3: FSDP2 at 2 processes
    got["fsdp pair float32"] = fsdp_steps(rank, square["shard"], torch.float32)
    got["refused"] = refusals()
    return got


def subgroups(rank: int, backend: str) -> dict:
    """Two overlapping subgroups (ranks 1 and 2 in both), one with the backend named, one inheriting
    it; each reduces, is found by its name, and is destroyed (its segment unmapped)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    low, high = dist.new_group([0, 1, 2], backend=backend), dist.new_group([1, 2, 3])
    got = {"world name": dist.group.WORLD.group_name}
    for name, group, ranks in (("low", low, [0, 1, 2]), ("high", high, [1, 2, 3])):
        if rank not in ranks:
            continue
        tensor = torch.full((3,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(tensor, group=group)
        segment = segment_of(group)
        got[name] = {"sum": tensor, "backend": dist.get_backend(group), "size": group.size(), "name": group.group_name,
                     "timeout": group._get_backend(CPU).options._timeout.total_seconds(),
                     "found by name": _resolve_process_group(group.group_name) is group,
                     "mapped before": segment is None or is_mapped(segment)}
        dist.destroy_process_group(group)
        got[name]["mapped after"] = segment is not None and is_mapped(segment)
        got[name]["destroyed"] = group not in dist.distributed_c10d._world.pg_map
    inherited = dist.new_group()
    got["inherited"] = (dist.get_backend(inherited), inherited.group_name)
    dist.destroy_process_group(inherited)
    return got


def segment_of(group) -> int | None:
    """The id of an "sn" group's shared-memory segment (None for gloo's)."""
    backend = group._get_backend(CPU)
    return backend._group.segment.shmid if hasattr(backend, "_group") else None


def is_mapped(shmid: int) -> bool:
    """Whether this process still maps segment ``shmid`` (a /SYSV mapping whose inode is the id)."""
    with open("/proc/self/maps") as maps:
        return any(len(f := line.split()) >= 6 and f[5].startswith("/SYSV") and int(f[4]) == shmid for line in maps)


def functional(rank: int, world: int) -> dict:
    """torch.distributed._functional_collectives, which find a group by its name (here given as one)."""
    import torch.distributed._functional_collectives as funcol

    name = dist.group.WORLD.group_name
    mine = torch.arange(4, dtype=torch.float64) + 10 * rank
    return {"funcol all_reduce": funcol.wait_tensor(funcol.all_reduce(mine, "sum", name)),
            "funcol all_gather": funcol.wait_tensor(funcol.all_gather_single(mine, 0, name)),
            "funcol reduce_scatter": funcol.wait_tensor(funcol.reduce_scatter_single(
                torch.arange(2.0 * world, dtype=torch.float64) * (rank + 1), "sum", 0, name))}


def dtensors(rank: int, line, square) -> dict:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    whole = torch.randn(6, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    sharded = distribute_tensor(whole, square, [Shard(0), Shard(1)])
    moved = sharded.redistribute(square, [Replicate(), Shard(0)])
    partial = DTensor.from_local(torch.full((2, 3), float(rank + 1), dtype=torch.float64), line, [Partial()])
    return {"dtensor local": sharded.to_local(), "dtensor redistributed": moved.to_local(),
            "dtensor full": moved.full_tensor(), "dtensor partial": partial.full_tensor()}


def fsdp_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def fsdp_batch(data_rank: int, step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + data_rank)
    return (torch.randn(5, 4, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(5, 3, generator=g, dtype=torch.float64).to(dtype))


def fsdp_steps(rank: int, mesh, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """FSDP2 (HSDP on a 2-D mesh) with SGD and momentum, on this rank's batches; the whole parameters after
    ``STEPS`` steps."""
    from torch.distributed.fsdp import fully_shard

    model = fsdp_model(dtype)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = fsdp_batch(rank, step, dtype)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.full_tensor() for p in model.parameters()]


def plain_steps(data_ranks) -> list[torch.Tensor]:
    """One process over the global batch of ``data_ranks``' batches."""
    model = fsdp_model(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        batches = [fsdp_batch(r, step) for r in data_ranks]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat([b[0] for b in batches])),
                                     torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def plain_gradients() -> list[torch.Tensor]:
    model = fsdp_model(torch.float32)
    model(torch.ones(2, 4)).sum().backward()
    return [p.grad for p in model.parameters()]


def refusals() -> tuple[list[str], list[torch.Tensor]]:
    """The gradients with the advice of the refusal below taken (SUM, divided after); then PREMUL_SUM,
    asked for directly and by FSDP2 under a gradient divide factor of its own (float32). Each on a group
    of its own: a refused collective breaks an "sn" group for every rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    refused, gradients = [], None
    for advised in (True, False):
        model = fsdp_model(torch.float32)
        fully_shard(model, mesh=DeviceMesh.from_group(dist.new_group(), "cpu"))
        model.set_gradient_divide_factor(3.0)
        model.set_force_sum_reduction_for_comms(advised)
        try:
            model(torch.ones(2, 4)).sum().backward()
        except Exception as error:
            refused.append(f"{type(error).__name__}: {error}")
        gradients = gradients or [p.grad.full_tensor() for p in model.parameters()]
    try:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.PREMUL_SUM(0.5), group=dist.new_group())
    except Exception as error:
        refused.append(f"{type(error).__name__}: {error}")
    return refused, gradients


def again(rank: int, world: int, backend: str) -> dict:
    """The default group made again on the same store (named "0" again): it reduces, and meshes; a group
    made under TORCH_DISTRIBUTED_DEBUG=DETAIL is refused, and the default group carries on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    tensor = torch.full((2,), float(rank + 1))
    dist.all_reduce(tensor)
    whole = torch.arange(8.0)
    got = {"sum": tensor, "name": dist.group.WORLD.group_name,
           "dtensor": distribute_tensor(whole, init_device_mesh("cpu", (world,)), [Shard(0)]).full_tensor()}
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # as TORCH_DISTRIBUTED_DEBUG=DETAIL sets it
    try:
        dist.new_group(backend="sn")
    except Exception as error:
        got["detail refused"] = f"{type(error).__name__}: {error}"
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # the default group unharmed
    got["after"] = tensor.item()
    return got


# --- the test ----------------------------------------------------------------------------------

def assert_same(a, b, what) -> None:
    """Equal tensors (bitwise), lists and dicts of them, or equal plain values."""
    if isinstance(a, torch.Tensor):
        assert bitwise(a, b), what
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, (what, index))
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            assert_same(a[key], b[key], (what, key))
    else:
        assert a == b, what


@pytest.mark.quick
def test_subgroups_funcol_device_mesh_dtensor_and_fsdp2_over_sn_as_over_gloo(tmp_path, no_leaks):
    codes = run_ranks(mesh_job, WORLD, tmp_path, timeout_s=220)
    assert codes == [0] * WORLD, [p.read_text() for p in tmp_path.glob("error*.txt")]
    ranks = results(tmp_path, WORLD)
    sn, gloo = [r["sn"] for r in ranks], [r["gloo"] for r in ranks]
    check_names(sn)
    check_names(gloo)
    plain = {"line": plain_steps(range(WORLD)), "pairs": [plain_steps([0, 1]), plain_steps([2, 3])]}
    for rank in range(WORLD):
        check_subgroups(sn[rank], rank, "sn")
        check_subgroups(gloo[rank], rank, "gloo")
        for name in ("low", "high"):
            if name in sn[rank]:
                assert sn[rank][name]["timeout"] == gloo[rank][name]["timeout"]  # what torch reads of a backend
        assert sn[rank]["mesh backends"] == [("sn", "SnBackend")] * 3
        assert gloo[rank]["mesh backends"] == [("gloo", "ProcessGroupGloo")] * 3
        check_functional(sn[rank], rank)
        check_dtensors(sn[rank], rank)
        check_training(sn, gloo, rank, plain)
        check_refusals(sn[rank]["refused"], gloo[rank]["refused"])
        check_again(ranks[rank]["sn again"], sn[rank])


def check_names(ranks: list[dict]) -> None:
    """Each group its own name, the same on every rank."""
    names = [ranks[0]["world name"], ranks[0]["low"]["name"], ranks[3]["high"]["name"], ranks[0]["inherited"][1]]
    assert len(set(names)) == 4
    assert all([r["world name"], r["inherited"][1]] == [names[0], names[3]] for r in ranks)
    assert all(r[k]["name"] == names[1 + (k == "high")] for r in ranks for k in ("low", "high") if k in r)


def check_training(sn: list[dict], gloo: list[dict], rank: int, plain: dict) -> None:
    """Every result over "sn" bitwise equal to gloo's (each sum there has two terms, and a + b == b + a),
    but FSDP2 over all 4 ranks: 1e-12 (the backends add the 4 ranks' gradients in different orders)."""
    for key in ("funcol all_reduce", "funcol all_gather", "funcol reduce_scatter", "dtensor local",
                "dtensor redistributed", "dtensor full", "dtensor partial", "hsdp square", "fsdp pair",
                "fsdp pair float32"):
        assert_same(sn[rank][key], gloo[rank][key], (rank, key))
    for ours, theirs in zip(sn[rank]["fsdp line"], gloo[rank]["fsdp line"]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    for key in ("fsdp line", "hsdp square", "fsdp pair"):
        assert_same(sn[rank][key], sn[0 if key != "fsdp pair" else rank // 2 * 2][key], (rank, key))
    for key, reference in (("fsdp line", plain["line"]), ("hsdp square", plain["line"]),
                           ("fsdp pair", plain["pairs"][rank // 2])):
        for ours, theirs in zip(sn[rank][key], reference):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def check_refusals(sn: tuple[list[str], list[torch.Tensor]], gloo: tuple[list[str], list[torch.Tensor]]) -> None:
    refused, advised = sn
    advice = ("asked for ReduceOp.PREMUL_SUM, which the 'sn' backend does not have (nor gloo); scale the tensors and "
              "use SUM (FSDP2: call set_force_sum_reduction_for_comms(True) on the module)")
    assert len(refused) == 2 and all(r.startswith("CollectiveFailed: sn: rank ") and advice in r for r in refused)
    assert [r.startswith("RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo") for r in gloo[0]] == [True, True]
    # Every rank's batch the same: the sum is W times one rank's gradient (float32: a few roundings).
    for ours, one in zip(advised, plain_gradients()):
        torch.testing.assert_close(ours, one * WORLD / 3.0, rtol=1e-6, atol=1e-7)


def check_again(again: dict, before: dict) -> None:
    assert again["name"] == before["world name"]  # the same name, hence the same store prefix, as before
    assert again["sum"].tolist() == [10.0, 10.0] and again["dtensor"].tolist() == list(range(8))
    assert again["detail refused"] == (
        "CollectiveFailed: the 'sn' backend does not run under TORCH_DISTRIBUTED_DEBUG=DETAIL; set it to INFO or "
        "unset it (sn itself checks that every rank calls the same collective on the same sizes and dtypes), or "
        "debug over backend='gloo'")
    assert again["after"] == WORLD


def check_subgroups(got: dict, rank: int, backend: str) -> None:
    for name, ranks in (("low", [0, 1, 2]), ("high", [1, 2, 3])):
        if rank not in ranks:
            assert name not in got
            continue
        mine = got[name]
        assert mine["sum"].tolist() == [float(sum(r + 1 for r in ranks))] * 3
        assert (mine["backend"], mine["size"], mine["found by name"], mine["destroyed"]) == (backend, 3, True, True)
        assert mine["mapped before"] and not mine["mapped after"]
    assert got["inherited"][0] == backend


def check_functional(got: dict, rank: int) -> None:
    mine = [torch.arange(4, dtype=torch.float64) + 10 * r for r in range(WORLD)]
    assert torch.equal(got["funcol all_reduce"], sum(mine))
    assert torch.equal(got["funcol all_gather"], torch.cat(mine))
    summed = torch.arange(2.0 * WORLD, dtype=torch.float64) * sum(r + 1 for r in range(WORLD))
    assert torch.equal(got["funcol reduce_scatter"], summed[2 * rank : 2 * rank + 2])


def check_dtensors(got: dict, rank: int) -> None:
    whole = torch.randn(6, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    row, column = divmod(rank, 2)  # Shard(0) over "replicate", Shard(1) over "shard"
    assert torch.equal(got["dtensor local"], whole.tensor_split(2, 0)[row].tensor_split(2, 1)[column])
    assert torch.equal(got["dtensor redistributed"], whole.tensor_split(2, 0)[column])
    assert torch.equal(got["dtensor full"], whole)
    assert torch.equal(got["dtensor partial"], torch.full((2, 3), float(sum(range(1, WORLD + 1))), dtype=torch.float64))
