"""``python -m sn_trainer.launch``: torchrun's agent and flags, each rank pinned to its own cores.

A plain DDP script (the shape of pytorch/examples' DDP tutorial) trains under the launcher to
the weights of one process over the global batch, over gloo and, unchanged, over "sn" with
``--cpu-backend=sn``; each rank runs where the launcher said; the auto count follows the usable
cores; torchrun's own flags still work; a rank ends as Python ends, without gloo's threads racing
its teardown; a crash leaves nothing.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from helpers import openmp_registrations
from test_topology import make_sys

import sn_trainer
from sn_trainer.node.runtime import Runtime
from sn_trainer.node.topology import read_topology
from sn_trainer.errors import ConfigError
from sn_trainer.launch.cpu_backend import on_sn
from sn_trainer.launch.ranks import resolve

TREE = str(Path(sn_trainer.__file__).parent.parent)
LAUNCH_TIMEOUT = 180  # seconds; a launch here takes a few, far more on a loaded machine

# The DDP tutorial's shape: the group from torchrun's environment (the backend named, or torch's
# default), DDP(model), SGD on this rank's part of a fixed float64 batch; rank 0 saves the weights.
# Each rank says where it ran, and the classes of its group and of a group it made over gloo.
DDP_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def made_as(group):
    return type(group._get_backend(torch.device("cpu")) if type(group) is dist.ProcessGroup else group).__name__


def main(out, backend):
    dist.init_process_group(None if backend == "default" else backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    per_rank = 12 // world
    xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    for _ in range(5):
        optimizer.zero_grad()
        F.cross_entropy(ddp(xs), ys).backward()
        optimizer.step()
    where = {"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
             "omp": os.environ.get("OMP_NUM_THREADS"),
             "groups": [made_as(ddp.process_group), made_as(dist.new_group(backend="gloo"))]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(where, f)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out, "weights.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""


def launch(args, cwd, timeout=LAUNCH_TIMEOUT):
    """Run the launcher in its own session; on a hang, kill the session (agent and ranks) and fail."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([TREE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, "-m", "sn_trainer.launch", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"sn_trainer.launch {' '.join(args)} did not finish in {timeout} s")
    return proc.returncode, out, err


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def plain_loop():
    """One process, the whole batch: the same model and steps, written out again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def expected_placement(nproc: int) -> tuple[int, list[list[int]]]:
    """The usable cores shared out: each rank its own consecutive physical cores, one CPU of each."""
    topology = read_topology()
    threads = max(1, topology.usable_cores // nproc)
    return threads, [[core.cpus[0] for core in topology.cores[r * threads:(r + 1) * threads]] for r in range(nproc)]


def assert_trains_as_one_process(tmp_path, backend, flags=()):
    script = write(tmp_path, "ddp.py", DDP_SCRIPT)
    rc, _, err = launch(["--nproc-per-node=2", *flags, str(script), str(tmp_path), backend], tmp_path)
    assert rc == 0, err
    weights, reference = torch.load(tmp_path / "weights.pt"), plain_loop()
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-12)
    return err


def test_a_ddp_script_over_gloo_trains_as_one_process_each_rank_on_its_own_cores(tmp_path):
    err = assert_trains_as_one_process(tmp_path, "gloo")
    threads, cpus = expected_placement(2)
    for rank in range(2):
        where = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert where == {"affinity": cpus[rank], "threads": threads, "omp": str(threads),
                         "groups": ["ProcessGroupGloo", "ProcessGroupGloo"]}
        assert f"local rank {rank} -> cpus {','.join(map(str, cpus[rank]))}, {threads} intra-op thread" in err
    assert "--cpu-backend" not in err  # without the flag, nothing is redirected or said


def test_an_unchanged_script_on_torchs_default_backend_trains_over_sn_with_cpu_backend_sn(tmp_path):
    """``init_process_group()`` (gloo on a CPU), and ``new_group(backend="gloo")`` after it, made on "sn"."""
    err = assert_trains_as_one_process(tmp_path, "default", ["--cpu-backend=sn"])
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["groups"] == ["SnBackend"] * 2
    assert err.count("(--cpu-backend=sn)") == 1, err
    assert ("the process group asked for torch's default (gloo on CPU) is made on \"sn\" (--cpu-backend=sn)"
            in err)


@pytest.mark.unit
@pytest.mark.parametrize("asked, made", [
    ("gloo", "sn"), ("undefined", "sn"),  # named, or torch's default on a machine without an accelerator
    ("cpu:gloo,cuda:nccl", "cpu:sn,cuda:nccl"),  # only the CPU part: what the program asked for CUDA stays
    ("nccl", "nccl"), ("mpi", "mpi"), ("cpu:sn", "cpu:sn"),  # no gloo on CPU: as asked
])
def test_cpu_backend_sn_replaces_gloo_on_cpu_and_nothing_else(asked, made):
    import sn_trainer.distributed  # noqa: F401  ("sn" named: torch checks that it is registered)

    assert on_sn(asked) == made


@pytest.mark.unit
@pytest.mark.quick
def test_auto_is_the_usable_physical_cores_over_the_threads_in_numa_order(tmp_path):
    topology = read_topology(make_sys(tmp_path, sockets=2, cores_per_socket=4, smt=True), proc_root=tmp_path / "no")
    runtime = Runtime("system", "gnu")
    one = resolve("auto", None, True, runtime, topology, {})
    assert (one.nproc, one.threads) == (8, 1)
    assert one.lines()[0] == ("sn_trainer.launch: --nproc-per-node=auto: 8 processes (8 usable physical cores / 1 "
                              "intra-op threads each)")
    assert one.cpus == ((0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,))  # one hyper-thread of each core
    two = resolve("auto", 2, True, runtime, topology, {})
    assert (two.nproc, two.cpus) == (4, ((0, 1), (2, 3), (4, 5), (6, 7)))  # a rank's cores on one socket
    assert resolve("auto", None, True, runtime, topology, {"OMP_NUM_THREADS": "4"}).nproc == 2
    shared_out = resolve("2", None, True, runtime, topology, {})
    assert (shared_out.threads, shared_out.cpus) == (4, ((0, 1, 2, 3), (4, 5, 6, 7)))


@pytest.mark.unit
def test_auto_follows_a_containers_cpu_quota(tmp_path):
    root = make_sys(tmp_path, sockets=1, cores_per_socket=8, smt=False)
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/box\n")
    (root / "fs" / "cgroup" / "box").mkdir(parents=True)
    (root / "fs" / "cgroup" / "box" / "cpu.max").write_text("300000 100000\n")
    plan = resolve("auto", None, True, Runtime("system", "gnu"), read_topology(root, proc_root=tmp_path / "proc"), {})
    assert (plan.nproc, plan.cpus) == (3, ((0,), (1,), (2,)))


@pytest.mark.unit
def test_more_processes_than_cores_run_unpinned_said_in_one_line(tmp_path):
    topology = read_topology(make_sys(tmp_path, sockets=1, cores_per_socket=2, smt=False), proc_root=tmp_path / "no")
    plan = resolve("3", None, True, Runtime("system", "gnu"), topology, {})
    assert plan.cpus is None and plan.threads == 1
    assert plan.lines()[0].startswith("sn_trainer.launch: warning: 3 processes x 1 threads need 3 physical cores")


@pytest.mark.unit
@pytest.mark.parametrize("threads, nproc, environment, says", [
    (0, "2", {}, "--threads-per-proc=0: give at least 1"),
    (None, "lots", {}, "--nproc-per-node=lots: give a number of processes, or auto"),
    (None, "auto", {"OMP_NUM_THREADS": "many"}, "OMP_NUM_THREADS='many' is not a whole number"),
])
def test_values_that_cannot_be_launched_are_refused_in_one_line(tmp_path, threads, nproc, environment, says):
    topology = read_topology(make_sys(tmp_path, sockets=1, cores_per_socket=2, smt=False), proc_root=tmp_path / "no")
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        resolve(nproc, threads, True, Runtime("system", "gnu"), topology, environment)


@pytest.mark.parametrize("flags, says", [
    (["--threads-per-proc=0"], "error: --threads-per-proc=0: give at least 1 thread per process"),
    (["--allocator=hoard"], "error: argument --allocator: invalid choice: 'hoard'"),
    (["--virtual-local-rank"], "error: --virtual-local-rank sets every rank's LOCAL_RANK to 0"),
    (["--cpu-backend=mpi"], "error: argument --cpu-backend/--cpu_backend: invalid choice: 'mpi' (choose from 'sn')"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, flags, says):
    rc, out, err = launch([*flags, "--nproc-per-node=2", "never_run.py"], tmp_path)
    assert rc == 2 and err.startswith(says) and len(err.strip().splitlines()) == 1, err


@pytest.mark.unit
def test_everything_after_the_script_is_the_scripts_and_launcher_flags_are_never_abbreviated(capsys):
    """Parsing only: no process starts. torchrun's parser takes abbreviations (argparse's default),
    so a script's --n was refused as ambiguous and --no-p could become --no-pin; the launcher's
    takes none: after the script every argument is the script's, before it a launcher flag is
    spelled out or refused in one line."""
    from sn_trainer.launch.__main__ import parser

    args = parser().parse_args(["--nproc-per-node=2", "train.py", "--n", "3", "--no-pin", "--nproc=4"])
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--n", "3", "--no-pin", "--nproc=4"]
    assert args.pin is True and args.nproc_per_node == "2"
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["--nproc=2", "train.py"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: unrecognized arguments: --nproc=2")
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("how", ["module", "no-python", "run-path"])  # a script: the tests above
def test_every_way_torchrun_runs_a_program_is_pinned(tmp_path, how):
    write(tmp_path, "probe.py", """
        import json, os, pickle, sys


        class Defined:  # pickled by reference to __main__, as a script's own classes are
            pass


        with open(os.path.join(sys.argv[1], "probe.json"), "w") as f:
            json.dump({"affinity": sorted(os.sched_getaffinity(0)), "omp": os.environ["OMP_NUM_THREADS"],
                       "argv": sys.argv[1:], "pickles": type(pickle.loads(pickle.dumps(Defined()))) is Defined}, f)
    """)
    program = {"module": ["-m", "probe"], "run-path": ["--run-path", "probe.py"],
               "no-python": ["--no-python", sys.executable, "probe.py"]}[how]
    rc, _, err = launch(["--nproc-per-node=1", *program, str(tmp_path), "--flag"], tmp_path)
    assert rc == 0, err
    threads, cpus = expected_placement(1)
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe == {"affinity": cpus[0], "omp": str(threads), "argv": [str(tmp_path), "--flag"], "pickles": True}


@pytest.mark.alone  # what it asserts of /dev/shm holds only with no other test beside it
def test_the_allocator_and_openmp_asked_for_are_loaded_in_each_rank(tmp_path):
    write(tmp_path, "maps.py", """
        import os, sys
        with open(sys.argv[1] + "/maps.txt", "w") as f:
            f.write(open("/proc/self/maps").read())
        with open(sys.argv[1] + "/registered.txt", "w") as f:  # Intel's OpenMP registers the rank while it runs
            f.write(str(any(n.startswith(f"__KMP_REGISTERED_LIB_{os.getpid()}_") for n in os.listdir("/dev/shm"))))
    """)
    before = openmp_registrations()
    rc, _, err = launch(["--nproc-per-node=1", "--allocator=jemalloc", "--openmp=intel", "maps.py", str(tmp_path)],
                        tmp_path)
    assert rc == 0, err
    maps = (tmp_path / "maps.txt").read_text()
    assert "libjemalloc" in maps and "libiomp5" in maps
    assert "allocator=jemalloc openmp=intel" in err
    assert (tmp_path / "registered.txt").read_text() == "True"
    assert openmp_registrations() - before == set()  # and nothing of the rank's is left behind


def test_the_plan_reaches_the_ranks_through_their_environment(tmp_path):
    topology = read_topology(make_sys(tmp_path, sockets=1, cores_per_socket=4, smt=False), proc_root=tmp_path / "no")
    plan = resolve("2", None, True, Runtime("jemalloc", "gnu"), topology, {})
    variables = plan.environment("libmine.so")
    assert variables["SN_LAUNCH_CPUS"] == "0,1;2,3" and variables["OMP_NUM_THREADS"] == "2"
    assert variables["LD_PRELOAD"].endswith(":libmine.so") and "jemalloc" in variables["LD_PRELOAD"]
    unpinned = resolve("2", None, False, Runtime("system", "gnu"), topology, {})
    assert unpinned.cpus is None and "SN_LAUNCH_CPUS" not in unpinned.environment(None)
    assert "LD_PRELOAD" not in unpinned.environment(None) and "SN_LAUNCH_CPU_BACKEND" not in variables
    on_sn_plan = resolve("2", None, True, Runtime("system", "gnu"), topology, {}, cpu_backend="sn")
    assert on_sn_plan.environment(None)["SN_LAUNCH_CPU_BACKEND"] == "sn"


def test_torchruns_restarts_pass_through(tmp_path):
    """--max-restarts: a script that fails once then succeeds ends well, in the agent's second round."""
    script = write(tmp_path, "flaky.py", """
        import os, sys
        restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
        if restart == "0" and rank == "0":
            sys.exit(7)
        with open(os.path.join(sys.argv[1], f"done{rank}"), "w") as f:
            f.write(restart)
    """)
    rc, _, err = launch(["--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1", str(script),
                         str(tmp_path)], tmp_path)
    assert rc == 0, err
    assert [(tmp_path / f"done{rank}").read_text() for rank in range(2)] == ["1", "1"]


# The smallest DDP run over gloo whose last collective is made in a backward pass: its Work holds a
# Python object (torch stashes the caller's context in the thread's state) until gloo's thread lets it go.
TINY_GLOO_DDP = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
model(torch.ones(1, 2)).sum().backward()
dist.destroy_process_group()
"""


STARTS = 8  # at one abort in four starts before, 8 clean ones had a 1 in 10 chance; 50 in benchmarks/launch_starts.py


@pytest.mark.timeout(600)
def test_repeated_starts_of_a_gloo_ddp_script_end_without_an_abort(tmp_path):
    """Each rank pinned to one core ended, before, inside Python's teardown while gloo's thread still had
    to release the backward's last Work: std::terminate, SIGABRT, in about one start of four. (The exit
    path that avoids it is checked step by step in the test after this one.)"""
    script = write(tmp_path, "tiny.py", TINY_GLOO_DDP)
    for start in range(STARTS):
        rc, _, err = launch(["--nproc-per-node=2", "--monitor-interval=0.05", str(script)], tmp_path)
        assert rc == 0, f"start {start + 1} of {STARTS} failed:\n{err[-3000:]}"


def test_a_rank_ends_as_python_ends_its_threads_joined_exit_handlers_run_output_flushed(tmp_path):
    """The child ends each rank without the interpreter's teardown, and misses nothing Python's exit does:
    non-daemon threads joined, atexit handlers run, the program's buffered output flushed, the status
    that ``sys.exit`` gave."""
    write(tmp_path, "ends.py", """
        import atexit, os, sys, threading

        out = sys.argv[1]


        def after_the_main_thread():
            threading.main_thread().join()  # returns once Python's exit has begun: it then waits for this thread
            with open(os.path.join(out, "thread"), "w") as f:
                f.write("joined")


        threading.Thread(target=after_the_main_thread).start()
        atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))
        sys.stdout = open(1, "w", buffering=1 << 16, closefd=False)  # buffered, whatever torchrun's -u did
        print("printed by Python, in its buffer", end="")
        sys.exit(3)
    """)
    rc, out, err = launch(["--nproc-per-node=1", "ends.py", str(tmp_path)], tmp_path)
    assert rc != 0 and "exitcode  : 3" in err, err
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "atexit").read_text() == "ran"
    assert "printed by Python, in its buffer" in out


@pytest.mark.alone  # what it asserts of /dev/shm holds only with no other test beside it
def test_a_crashing_rank_leaves_no_process_behind(tmp_path):
    """Rank 1 dies; rank 0 (and a process it started) would wait forever: the agent ends them all.
    With Intel's OpenMP in them, what it registered for each goes too."""
    script = write(tmp_path, "crash.py", """
        import os, subprocess, sys, threading
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        pids = [os.getpid()]
        if rank == 0:
            pids.append(subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"]).pid)
        with open(os.path.join(sys.argv[1], f"pids{rank}"), "w") as f:
            f.write(" ".join(map(str, pids)))
        dist.barrier()  # every rank has written its pids
        if rank == 1:
            os._exit(3)
        threading.Event().wait()
    """)
    before = openmp_registrations()
    rc, _, err = launch(["--nproc-per-node=2", "--monitor-interval=0.1", "--openmp=intel", str(script),
                         str(tmp_path)], tmp_path)
    assert rc != 0 and "crash.py FAILED" in err, err
    pids = [int(p) for rank in range(2) for p in (tmp_path / f"pids{rank}").read_text().split()]
    assert len(pids) == 3
    assert [pid for pid in pids if alive(pid)] == []
    assert openmp_registrations() - before == set()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


KILLED_RANK = """
import datetime, os, signal, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
total = torch.ones(1000)
for step in range(200):
    if dist.get_rank() == 1 and step == 50:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(total)
    total /= 3
"""


def test_torchruns_failure_summary_names_the_rank_that_died_under_cpu_backend_sn(tmp_path):
    """The survivors see rank 1's death within milliseconds; the agent, which names the first rank it finds
    ended, must still find rank 1 first (here it looks once a second: the survivors have long raised)."""
    script = write(tmp_path, "killed.py", KILLED_RANK)
    code, out, err = launch(["--nproc-per-node=3", "--no-pin", "--monitor-interval=1", "--cpu-backend=sn", str(script)], tmp_path)
    assert code == 1
    root_cause = err.split("Root Cause", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "SIGKILL" in root_cause, err[-3000:]
