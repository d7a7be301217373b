"""The "sn" backend under faults, held to gloo's standard: any failed collective (a peer's death, a
timeout, a mismatch, a bad argument, a wait given up) raises a clear error on every rank of the group,
under DDP too; the group is then broken for every rank, and no rank completes a collective with a
peer's abandoned data; liveness holds across PID namespaces; no shared memory outlives its processes.

Each scenario runs in a fresh subgroup of one spawned set of processes (process start-ups are what
costs); the ranks order themselves with events, never with sleeps.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from helpers import SharedMemory, run_ranks, saved_results, shared_memory

pytestmark = pytest.mark.timeout(180)


def init(rank: int, world: int, store) -> None:
    import sn_trainer.distributed  # noqa: F401  (registers "sn")

    dist.init_process_group("sn", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def fresh(timeout_s: float = 60.0):
    """A new "sn" group of every rank: each scenario breaks its own."""
    return dist.new_group(backend="sn", timeout=datetime.timedelta(seconds=timeout_s))


def caught(call) -> str | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(error).__name__}: {error}"
    return None


# --- two ranks: bad arguments, a wait given up, a timeout, a second group on the store, DDP's peer death

def at_two(rank: int, world: int, store_path: str, out_dir: str, events) -> None:
    store = dist.FileStore(store_path, world)
    init(rank, world, store)
    got = {}
    group = fresh()  # the same 8 bytes, as a dtype outside the common ones on each rank
    tensor = torch.zeros(4, dtype=torch.uint16) if rank == 0 else torch.zeros(8, dtype=torch.float8_e4m3fn)
    got["dtype"] = caught(lambda: dist.broadcast(tensor, src=0, group=group))
    group = fresh()
    got["op"] = caught(lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM,
                                               group=group))
    got.update(wait_given_up(rank, events))
    for path in ("C core", "Python path"):
        got.update(broken_after_it_passed(rank, path))
        got.update(different_collectives_meet(rank, path))
    got.update(timed_out_on_one(rank, events))
    tensor = torch.full((4,), float(rank))  # in the default group, where torch checks no root itself
    got["root"] = caught(lambda: dist.broadcast(tensor, src=5 if rank == 0 else 0))
    got["root tensor"] = tensor.tolist()
    got["root, then"] = caught(lambda: dist.all_reduce(torch.ones(2)))  # broken for every rank
    dist.destroy_process_group()
    init(rank, world, store)  # a second group on the same store
    again = torch.full((2,), float(rank + 1))
    dist.all_reduce(again)
    got["again"] = again.tolist()
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    got.update(ddp_peer_killed(rank, out_dir))
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))


def wait_given_up(rank: int, events) -> dict:
    """Rank 0 waits 2 s for an all-reduce rank 1 has not called; rank 1 calls it once rank 0 gave up."""
    group, got = fresh(), {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(3), group=group, async_op=True)
        started = time.monotonic()
        got["wait"] = caught(lambda: work.wait(timeout=datetime.timedelta(seconds=2)))
        got["wait seconds"] = time.monotonic() - started
        events["gave up"].set()
    else:
        events["gave up"].wait(60)
        tensor = torch.full((3,), 5.0)
        got["after the wait"] = caught(lambda: dist.all_reduce(tensor, group=group))
        got["after the wait tensor"] = tensor.tolist()
    return got


def on_path(path: str):
    """A fresh group on the C core or on the Python path (the choice is read as each group is made)."""
    os.environ["SN_TRAINER_NATIVE"] = "1" if path == "C core" else "0"
    group = fresh()
    os.environ.pop("SN_TRAINER_NATIVE")
    return group, group._get_backend(torch.device("cpu"))._group


def broken_after_it_passed(rank: int, path: str) -> dict:
    """Rank 0 waits in an all-reduce's barrier, stopped (SIGSTOP) by rank 1 once it has arrived; rank 1
    passes the barrier, returns, and breaks the group (a refused call) before rank 0 runs again. Rank 0
    must return from the all-reduce as rank 1 did, raise in its next call, and both go on in a new group."""
    group, shm, got = *on_path(path), {}
    tensor = torch.full((3,), float(rank + 1))
    if rank == 1:
        generation = shm.state.generation + 1
        while shm._lines[0, 0] < generation:  # rank 0 has arrived, and cannot pass without rank 1
            pass
        peer = int(shm._lines[0, 2])
        os.kill(peer, signal.SIGSTOP)
        try:
            dist.all_reduce(tensor, group=group)
            got[("refused", path)] = caught(lambda: dist.all_reduce(torch.zeros(2, dtype=torch.uint16), group=group))
        finally:
            os.kill(peer, signal.SIGCONT)
    else:
        got[("passed", path)] = caught(lambda: dist.all_reduce(tensor, group=group))
        got[("next", path)] = caught(lambda: dist.all_reduce(torch.ones(2), group=group))
    got[("sum", path)] = tensor.tolist()
    again, tensor = on_path(path)[0], torch.full((2,), float(rank))
    dist.all_reduce(tensor, group=again)
    got[("again", path)] = tensor.tolist()
    for made in (group, again):
        dist.destroy_process_group(made)
    return got


def different_collectives_meet(rank: int, path: str) -> dict:
    """Rank 1 waits in a barrier of its own (no collective) while rank 0 runs an all-reduce: the
    barriers meet, and rank 0 must see that rank 1 is at another collective (its header is not this
    collective's: none yet, or, as rank 1 has passed the barrier, its next one's), not sum whatever
    rank 1's slot holds."""
    group, shm, got = *on_path(path), {}
    tensor = torch.full((3,), 2.0)
    if rank == 0:
        got[("met", path)] = caught(lambda: dist.all_reduce(tensor, group=group))
    else:
        got[("met", path)] = caught(lambda: shm.barrier("a barrier of its own"))
    got[("met tensor", path)] = tensor.tolist()
    got[("met, then", path)] = caught(lambda: dist.all_reduce(torch.ones(1), group=group))
    dist.destroy_process_group(group)
    return got


def timed_out_on_one(rank: int, events) -> dict:
    """Rank 1's all-reduce times out (the group's 2 s); rank 0 arrives after that, with its own data."""
    group, got = fresh(timeout_s=2.0), {}
    if rank == 1:
        tensor = torch.full((2,), 11.0)
        got["timed out"] = caught(lambda: dist.all_reduce(tensor, group=group))
        events["timed out"].set()
    else:
        events["timed out"].wait(60)
        tensor = torch.full((2,), 1.0)
        got["late"] = caught(lambda: dist.all_reduce(tensor, group=group))
        got["late tensor"] = tensor.tolist()
    return got


def ddp_peer_killed(rank: int, out_dir: str) -> dict:
    """DDP over "sn"; at step 3 rank 1 kills itself (SIGKILL) in the middle of its backward pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = [0]

    def die(grad):
        if rank == 1 and step[0] == 3:
            with open(os.path.join(out_dir, "killed.txt"), "w") as file:
                file.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(die)  # the first layer's: its gradient comes last in the backward pass
    for step[0] in range(6):
        optimizer.zero_grad()
        loss = ddp(torch.randn(4, 6, dtype=torch.float64)).square().mean()
        try:
            loss.backward()
        except Exception as error:  # noqa: BLE001
            return {"ddp": f"{type(error).__name__}: {error}", "ddp raised at": time.monotonic()}
        optimizer.step()
    return {"ddp": None}


def test_every_fault_at_two_ranks_raises_on_both_and_breaks_the_group(tmp_path):
    context = multiprocessing.get_context("spawn")
    events = {name: context.Event() for name in ("gave up", "timed out")}
    codes = run_ranks(at_two, 2, tmp_path, extra=(events,))
    assert codes == [0, -signal.SIGKILL]
    zero, one = saved_results(tmp_path, 1)[0], torch.load(tmp_path / "rank1.pt")
    # A root out of range: both raise, and neither tensor took stale bytes; the group stays broken.
    assert "root 5 is not a rank of this group of 2" in zero["root"]
    assert "rank 0 broke the group" in one["root"] and "root 5" in one["root"]
    assert zero["root tensor"] == [0.0] * 4 and one["root tensor"] == [1.0] * 4
    assert all("broke the group" in got["root, then"] for got in (zero, one))
    # Dtypes outside the usual ones, the same bytes: both raise, naming both dtypes.
    for got in (zero, one):
        assert "uint16[4]" in got["dtype"] and "float8_e4m3fn[8]" in got["dtype"], got["dtype"]
    # Different ops: each rank's message names both ops, and which call is its own.
    assert "rank 0 (this one): collective #1 all_reduce SUM" in zero["op"] and "rank 1: collective #1 all_reduce MAX" in zero["op"]
    assert "rank 1 (this one): collective #1 all_reduce MAX" in one["op"]
    # Work.wait(timeout=2 s) gives up after 2 s (the group's timeout is 60 s); the late peer raises.
    assert "gave up waiting for its all_reduce after 2 s" in zero["wait"] and 2.0 <= zero["wait seconds"] < 10.0
    assert "gave up waiting" in one["after the wait"] and one["after the wait tensor"] == [5.0] * 3
    for path in ("C core", "Python path"):
        # Broken by a peer after it passed a barrier: passed here too, the next call raises, a new group works.
        assert one[("refused", path)] and "uint16" in one[("refused", path)]
        assert zero[("passed", path)] is None and zero[("sum", path)] == one[("sum", path)] == [3.0] * 3
        assert "rank 1 broke the group" in zero[("next", path)] and "uint16" in zero[("next", path)]
        assert zero[("again", path)] == one[("again", path)] == [1.0, 1.0]
        # A collective's barrier met by a peer's barrier of another kind: a mismatch, named, no sum.
        assert "the ranks called all_reduce differently (rank 0 (this one): collective #1 all_reduce SUM of " \
               "float32[3]" in zero[("met", path)], zero[("met", path)]
        assert zero[("met tensor", path)] == [2.0] * 3
        assert "rank 0 broke the group" in zero[("met, then", path)]
        assert one[("met, then", path)].startswith("CollectiveFailed: sn: ")
    # A collective that timed out on rank 1 is no collective for rank 0, arriving later with its own data.
    assert "rank 1 waited 2 s for rank(s) 0" in one["timed out"]
    assert "rank 1 broke the group" in zero["late"] and zero["late tensor"] == [1.0, 1.0]
    # A second group on the same store works.
    assert zero["again"] == one["again"] == [3.0, 3.0]
    # DDP: the survivor of a peer killed mid-backward raises (no SIGSEGV), within seconds.
    assert "rank 1 (pid" in zero["ddp"] and "ended" in zero["ddp"], zero["ddp"]
    killed = float((tmp_path / "killed.txt").read_text())
    assert 0 <= zero["ddp raised at"] - killed < 5.0


# --- three ranks: sizes that differ, a timeout the third rank meets late, a death --------------------

def at_three(rank: int, world: int, store_path: str, out_dir: str, events) -> None:
    init(rank, world, dist.FileStore(store_path, world))
    got = {}
    group = fresh()
    got["sizes"] = caught(lambda: dist.all_reduce(torch.ones(10 + rank), group=group))
    got["sizes, then"] = caught(lambda: dist.barrier(group=group))
    group = fresh(timeout_s=2.0)
    if rank < 2:
        got["timeout"] = caught(lambda: dist.all_reduce(torch.ones(3), group=group))
        events[rank].set()
    else:
        events[0].wait(60)
        events[1].wait(60)
        got["late"] = caught(lambda: dist.all_reduce(torch.ones(3), group=group))
    tensor, started = torch.ones(4000), time.monotonic()
    if rank == world - 1:
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
        for _ in range(50):
            dist.all_reduce(tensor)
        os._exit(3)
    try:
        while True:
            dist.all_reduce(tensor)
    except Exception as error:  # noqa: BLE001
        got["died"], got["seconds"] = f"{type(error).__name__}: {error}", time.monotonic() - started
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))


def test_at_three_ranks_a_mismatch_a_timeout_and_a_death_reach_every_rank(tmp_path):
    events = [multiprocessing.get_context("spawn").Event() for _ in range(2)]
    codes = run_ranks(at_three, 3, tmp_path, extra=(events,))
    assert codes == [0, 0, 3]
    ranks = saved_results(tmp_path, 3)
    for rank, got in enumerate(ranks):
        assert all(f"float32[{n}]" in got["sizes"] for n in (10, 11, 12)), got["sizes"]
        assert f"rank {rank} (this one)" in got["sizes"]
        assert "broke the group" in got["sizes, then"]
    for rank in (0, 1):
        assert "waited 2 s for rank(s) 2 in all_reduce" in ranks[rank]["timeout"]  # its own, or the first one's
        assert "rank 2 (pid " in ranks[rank]["died"] and "ended before all_reduce" in ranks[rank]["died"]
        assert ranks[rank]["seconds"] < 30.0  # the group's timeout is 60 s: the death is seen, not waited out
    assert "broke the group" in ranks[2]["late"] and "waited 2 s" in ranks[2]["late"]


# --- liveness across PID namespaces, and no segment after a kill during set-up -----------------------

RANK = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    import sn_trainer.distributed
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("sn", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    print("ready", flush=True)
    if rank == 1:
        time.sleep(600)  # until killed
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
    except RuntimeError as error:
        print(f"raised after {time.monotonic() - started:.3f} s: {error}", flush=True)
""")


@pytest.mark.quick
def test_a_rank_killed_in_another_pid_namespace_is_seen_dead_within_a_second(tmp_path):
    """Rank 1 runs as pid 1 of a PID namespace of its own (it shares this one's IPC and host name):
    killed while rank 0 waits for it, rank 0 raises within a second (the group's timeout is 60 s)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    command = [sys.executable, "-c", RANK]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    zero = subprocess.Popen([*command, "0", str(store.port)], stdout=subprocess.PIPE, text=True, env=env)
    one = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *command, "1", str(store.port)],
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert zero.stdout.readline().strip() == "ready" and one.stdout.readline().strip() == "ready"
        one.kill()  # unshare, and with it (--kill-child) rank 1, pid 1 of its namespace
        line = zero.stdout.readline()
        assert zero.wait(60) == 0
    finally:
        for process in (zero, one):
            process.kill()
            process.wait()
    assert "rank 1 (pid 1) ended" in line, line
    assert float(line.split()[2]) < 1.0, line


SETUP = textwrap.dedent("""
    import datetime, sys, torch.distributed as dist
    from sn_trainer.distributed.machines import group_on_store
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=60))
    group_on_store(store, 0, 2, datetime.timedelta(seconds=60), 1 << 20)  # rank 1 never attaches
""")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.alone  # what it asserts of /dev/shm holds only with no other test beside it
def test_rank_0_stopped_during_set_up_leaves_no_shared_memory(tmp_path, stop):
    """Rank 0 of the "sn" group's set-up has made its segment and waits for rank 1 to attach it, which
    never happens (rank 1 crashed at start-up); stopped there, as torchrun stops the survivors, it
    leaves nothing behind: no /dev/shm entry, no segment."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    before = shared_memory()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", SETUP, str(store.port)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not any(row["cpid"] == process.pid for row in sysv_segments()):  # it has made the segment
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(stop)
        assert process.wait(30) == -stop
    finally:
        process.kill()
        process.wait()
    assert shared_memory().new_since(before) == SharedMemory(set(), set())
    assert [row for row in sysv_segments() if row["cpid"] == process.pid] == []


def sysv_segments() -> list[dict]:
    with open("/proc/sysvipc/shm") as listing:
        head, *rows = [line.split() for line in listing]
    return [{name: int(value) for name, value in zip(head, row) if name in ("shmid", "cpid", "nattch")}
            for row in rows]
