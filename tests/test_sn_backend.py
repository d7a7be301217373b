"""The "sn" torch.distributed backend: every collective against the exact result, bitwise equal on every
rank; DDP over it against DDP over gloo and a plain float64 loop; a dead, a late and a mismatched rank.

One spawned group runs many checks (process start-ups are what costs); each rank writes what it got to
a file, and the test computes the exact results itself from the same seeded inputs.
"""
from __future__ import annotations

import datetime
import logging
import os

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks, saved_results

pytestmark = pytest.mark.timeout(180)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
# Elements per check: not a multiple of 2 or 3, and over the tiny slots below, so that chunks and uneven
# splits of a chunk between the ranks are exercised.
NUMEL = 157
SMALL_SLOT_BYTES = 96


def inputs(rank: int, dtype: torch.dtype, numel: int = NUMEL, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small values, so that integer products do not overflow."""
    g = torch.Generator().manual_seed(1000 * salt + 10 * rank + DTYPES.index(dtype))
    if dtype.is_floating_point:
        return (torch.rand(numel, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randint(1, 4, (numel,), generator=g).to(dtype)


def exact(op: str, values: list[torch.Tensor]) -> torch.Tensor:
    """The combination in float64, from the inputs themselves."""
    wide = torch.stack([v.double() for v in values])
    return {"SUM": wide.sum(0), "AVG": wide.mean(0), "PRODUCT": wide.prod(0),
            "MIN": wide.min(0).values, "MAX": wide.max(0).values}[op]


def init(rank: int, world: int, store_path: str, timeout_s: float = 30.0) -> None:
    import sn_trainer.distributed  # noqa: F401  (registers "sn")
    from sn_trainer.distributed import backend

    backend.SLOT_BYTES = SMALL_SLOT_BYTES
    dist.init_process_group("sn", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


# --- every collective, op and dtype, and DDP ---------------------------------------------------

def all_collectives(rank: int, world: int, store: str, out_dir: str) -> None:
    """Every check in the group of all ``world`` ranks, then in the group of ranks 0 and 1 (the same
    processes: a group of two for the price of no start-up)."""
    init(rank, world, store)
    pair, gloo_all, gloo_pair = (dist.new_group([0, 1], backend="sn"), dist.new_group(backend="gloo"),
                                 dist.new_group([0, 1], backend="gloo"))
    got = {world: checks(rank, world, None, gloo_all)}
    if rank < 2:
        got[2] = checks(rank, 2, pair, gloo_pair)
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def sn_backend(group):
    """The "sn" backend inside ``group`` (None: the default group), which torch wraps in a ProcessGroup."""
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def checks(rank: int, size: int, group, gloo_group) -> dict:
    backend = sn_backend(group)
    got: dict = {"segment": backend._group.segment.shmid, "native": backend._group.native is not None}
    for dtype in DTYPES:
        for op in OPS:
            if op == "AVG" and not dtype.is_floating_point:
                continue
            tensor = inputs(rank, dtype)
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
            got[("all_reduce", dtype, op)] = tensor
        tensor = inputs(rank, dtype)
        dist.broadcast(tensor, src=size - 1, group=group)
        got[("broadcast", dtype)] = tensor
        parts = [torch.empty(NUMEL, dtype=dtype) for _ in range(size)]
        dist.all_gather(parts, inputs(rank, dtype), group=group)
        got[("all_gather", dtype)] = torch.stack(parts)
        into = torch.empty(size * NUMEL, dtype=dtype)
        dist.all_gather_into_tensor(into, inputs(rank, dtype), group=group)
        got[("all_gather_into_tensor", dtype)] = into
        for op in ("SUM", "MAX"):
            scattered = torch.empty(NUMEL, dtype=dtype)
            dist.reduce_scatter_tensor(scattered, inputs(rank, dtype, NUMEL * size), op=getattr(dist.ReduceOp, op),
                                       group=group)
            got[("reduce_scatter", dtype, op)] = scattered
    got.update(odd_shapes(rank, group))
    for dtype in FLOATS:
        for op in NAN_OPS:
            for name, on in (("sn", group), ("gloo", gloo_group)):
                tensor = nan_inputs(rank, dtype)
                dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=on)
                got[("nan", name, dtype, op)] = tensor
    dist.barrier(group=group)
    got["ddp sn"], got["ddp gloo"] = ddp_steps(rank, group), ddp_steps(rank, gloo_group)
    return got


FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
NAN_OPS = ["SUM", "PRODUCT", "MIN", "MAX"]


def nan_inputs(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """NaN on every rank (first), on rank 0 alone (second), -NaN on every rank (third), then numbers."""
    values = torch.full((40,), 1.5 + rank, dtype=dtype)
    values[0] = float("nan")
    values[1] = float("nan") if rank == 0 else 2.0
    values[2] = -torch.tensor(float("nan"), dtype=dtype)
    return values


def check_nans(ranks: list[dict]) -> None:
    """NaNs as gloo writes them where every rank holds the same NaN, and every NaN the dtype's quiet NaN
    (torch's vector kernels write payloads of their own: all ones in bfloat16 here, in float32 on AVX-512)."""
    bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
    quiet = {torch.float64: 0x7FF8000000000000, torch.float32: 0x7FC00000, torch.float16: 0x7E00,
             torch.bfloat16: 0x7FC0}
    for dtype in FLOATS:
        for op in NAN_OPS:
            sn, gloo = ranks[0][("nan", "sn", dtype, op)], ranks[0][("nan", "gloo", dtype, op)]
            same = [0] if op in ("MIN", "MAX") else [0, 2]  # gloo's MIN of -NaNs is one of them, sn's the quiet NaN
            assert bitwise(sn[same], gloo[same]), (dtype, op, sn[:3], gloo[:3])
            nan = torch.isnan(sn)
            assert bool(nan[:2].all()) and not bool(nan[3:].any()), (dtype, op, sn)
            payload = sn.view(bits[dtype])[nan].long() & ((1 << (8 * dtype.itemsize - 1)) - 1)  # the sign dropped
            assert payload.tolist() == [quiet[dtype]] * int(nan.sum()), (dtype, op, [hex(v) for v in payload.tolist()])


def odd_shapes(rank: int, group) -> dict:
    """A transposed (non-contiguous) tensor, an empty one, coalesced tensors, and send/recv (gloo's)."""
    got = {}
    transposed = inputs(rank, torch.float64, 12).view(3, 4).t()
    dist.all_reduce(transposed, group=group)
    got["transposed"] = transposed
    empty = torch.empty(0)
    dist.all_reduce(empty, group=group)
    got["empty"] = empty
    pair = [inputs(rank, torch.float64, 5, salt=1), inputs(rank, torch.float64, 7, salt=2)]
    (group or dist.group.WORLD).allreduce_coalesced(pair, dist.AllreduceCoalescedOptions()).wait()
    got["coalesced"] = pair
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sn_trainer").addHandler(handler)
    logging.getLogger("sn_trainer").setLevel(logging.INFO)
    message = torch.arange(3.0) if rank == 0 else torch.zeros(3)
    for _ in range(2):
        if rank == 0:
            dist.send(message, dst=1, group=group)
        elif rank == 1:
            dist.recv(message, src=0, group=group)
    logging.getLogger("sn_trainer").removeHandler(handler)
    got["recv"], got["gloo notes"] = message, [r.getMessage() for r in records]
    return got


def ddp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def ddp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)


def ddp_steps(rank: int, process_group, steps: int = 4) -> list[torch.Tensor]:
    model = ddp_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group, bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = ddp_batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def plain_steps(world: int, steps: int = 4) -> list[torch.Tensor]:
    """The same training as one process over the whole global batch."""
    model = ddp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        batches = [ddp_batch(rank, step) for rank in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def segment_ids() -> set[int]:
    """The System V shared-memory segments of this IPC namespace (the kernel's list)."""
    with open("/proc/sysvipc/shm") as listing:
        return {int(line.split()[1]) for line in listing.readlines()[1:]}


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def assert_exact(got: torch.Tensor, expected: torch.Tensor, what) -> None:
    """Integers exactly; floats to the dtype's rounding of the exact float64 result."""
    if not got.dtype.is_floating_point:
        assert torch.equal(got.double(), expected), what
        return
    tolerance = {torch.float64: 1e-13, torch.float32: 4e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[got.dtype]
    assert torch.allclose(got.double(), expected, rtol=tolerance, atol=0), what


def check_reductions(ranks: list[dict], world: int) -> None:
    for dtype in DTYPES:
        for op in OPS:
            if ("all_reduce", dtype, op) in ranks[0]:
                key = ("all_reduce", dtype, op)
                assert_exact(ranks[0][key], exact(op, [inputs(r, dtype) for r in range(world)]), key)
        for op in ("SUM", "MAX"):
            key = ("reduce_scatter", dtype, op)
            whole = exact(op, [inputs(r, dtype, NUMEL * world) for r in range(world)])
            for rank in range(world):
                assert_exact(ranks[rank][key], whole[rank * NUMEL : (rank + 1) * NUMEL], (key, rank))


def check_movements(ranks: list[dict], world: int) -> None:
    for dtype in DTYPES:
        mine = [inputs(r, dtype) for r in range(world)]
        for rank in range(world):
            assert bitwise(ranks[rank][("broadcast", dtype)], mine[world - 1])
            assert bitwise(ranks[rank][("all_gather", dtype)], torch.stack(mine))
            assert bitwise(ranks[rank][("all_gather_into_tensor", dtype)], torch.cat(mine))


def check_odd_shapes(ranks: list[dict], world: int) -> None:
    transposed = sum(inputs(r, torch.float64, 12) for r in range(world)).view(3, 4).t()
    assert torch.allclose(ranks[0]["transposed"], transposed, rtol=1e-13, atol=0)
    assert ranks[0]["empty"].numel() == 0
    for index, (numel, salt) in enumerate([(5, 1), (7, 2)]):
        expected = exact("SUM", [inputs(r, torch.float64, numel, salt) for r in range(world)])
        assert torch.allclose(ranks[0]["coalesced"][index], expected, rtol=1e-13, atol=0)
    assert torch.equal(ranks[1]["recv"], torch.arange(3.0))
    assert [n for n in ranks[0]["gloo notes"] if "send" in n] == [
        "sn backend: send is not implemented in shared memory; gloo on the same store runs it"]


@pytest.mark.parametrize("path", ["C core", "Python path"])
def test_every_collective_is_exact_and_bitwise_equal_on_every_rank_and_ddp_trains_as_over_gloo(tmp_path, path,
                                                                                                monkeypatch):
    monkeypatch.setenv("SN_TRAINER_NATIVE", "1" if path == "C core" else "0")  # the spawned ranks inherit it
    codes = run_ranks(all_collectives, 3, tmp_path)
    assert codes == [0, 0, 0]
    saved = saved_results(tmp_path, 3)
    for size in (3, 2):
        ranks = [saved[rank][size] for rank in range(size)]
        for key, value in ranks[0].items():
            for other in ranks[1:]:
                if isinstance(value, torch.Tensor) and key[0] != "reduce_scatter" and key != "recv":  # each its own
                    assert bitwise(other[key], value), (size, key)
        check_reductions(ranks, size)
        check_movements(ranks, size)
        check_odd_shapes(ranks, size)
        check_nans(ranks)
        plain = plain_steps(size)
        for rank in range(size):
            for sn, gloo, reference in zip(ranks[rank]["ddp sn"], ranks[rank]["ddp gloo"], plain):
                assert (sn - gloo).abs().max().item() < 1e-12
                assert (sn - reference).abs().max().item() < 1e-12
        assert ranks[0]["segment"] not in segment_ids()  # gone with the processes that had it attached
        assert [r["native"] for r in ranks] == [path == "C core"] * size


def on_another_machine(host: str) -> None:
    """This process in a UTS namespace of its own, under another host name: another machine to the
    backend (the boot id stays; the host name differs)."""
    import ctypes
    import socket

    if ctypes.CDLL(None, use_errno=True).unshare(0x04000000) != 0:  # CLONE_NEWUTS (root)
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
    socket.sethostname(host)


def across_machines(rank: int, world: int, store: str, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the host names given here resolve nowhere
    if rank >= world // 2:
        on_another_machine("sn-test-machine-b")
    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    dist.init_process_group("sn", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    got = checks(rank, world, None, dist.new_group(backend="gloo"))
    got["machines"] = len(sn_backend(None)._collectives.members)
    torch.save({world: got}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_group_across_two_machines_sums_in_each_then_between_them_exactly(tmp_path):
    """Ranks 0, 1 on this machine, 2, 3 on "another" (a UTS namespace): every collective as on one."""
    codes = run_ranks(across_machines, 4, tmp_path, timeout_s=170)
    assert codes == [0, 0, 0, 0]
    saved = saved_results(tmp_path, 4)
    ranks = [saved[rank][4] for rank in range(4)]
    assert [r["machines"] for r in ranks] == [2, 2, 2, 2]
    for key, value in ranks[0].items():
        for other in ranks[1:]:
            if isinstance(value, torch.Tensor) and key[0] != "reduce_scatter" and key != "recv":
                assert bitwise(other[key], value), key
    check_reductions(ranks, 4)
    check_movements(ranks, 4)
    check_odd_shapes(ranks, 4)
    plain = plain_steps(4)
    for rank in range(4):
        for sn, gloo, reference in zip(ranks[rank]["ddp sn"], ranks[rank]["ddp gloo"], plain):
            torch.testing.assert_close(sn, gloo, rtol=0, atol=1e-12)
            torch.testing.assert_close(sn, reference, rtol=0, atol=1e-12)


@pytest.mark.unit
@pytest.mark.quick
def test_the_c_core_through_ctypes_as_where_no_python_headers_are_found(monkeypatch):
    """One rank, in this process: each collective through the ctypes surface (a machine without Python's
    headers builds the library without its CPython module) gives what the module gives."""
    from sn_trainer.shm import native
    from sn_trainer.shm.chunked import Collectives
    from sn_trainer.shm.group import Group
    from sn_trainer.shm.layout import Layout
    from sn_trainer.shm.segment import Segment

    monkeypatch.setenv("SN_TRAINER_NATIVE", "1")  # this test is the C core's, in the portable-kernels pass too
    monkeypatch.setitem(native._loaded, "lib", native._functions(native.build(), as_module=False))
    layout = Layout(1, 2 * 64)
    group = Group(Segment.create(layout.size), layout, 0, 1, 10.0, slot_bytes=64)
    collectives = Collectives(group, 64)
    try:
        assert group.native.via == "ctypes"
        values = torch.arange(40, dtype=torch.float64)  # several chunks of the 64-byte slots
        collectives.all_reduce(values, "AVG")
        collectives.broadcast(values, 0)
        gathered = torch.empty(40, dtype=torch.float64)
        collectives.all_gather(gathered, values)
        scattered = torch.empty(40, dtype=torch.float64)
        collectives.reduce_scatter(scattered, values, "SUM")
        collectives.barrier()
        assert torch.equal(gathered, torch.arange(40.0, dtype=torch.float64)) and torch.equal(scattered, gathered)
        with pytest.raises(Exception, match="root 3 is not a rank"):
            collectives.broadcast(values, 3)
    finally:
        collectives.close()
        group.close()
