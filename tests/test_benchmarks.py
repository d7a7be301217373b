"""The benchmarks keep working: benchmarks/run.py lists every one and runs each at a tiny size to its
results files, which name the command and no path of this machine; and what the benchmarks compute
beside measuring (case labels, launches, the best-launch table, a busy machine's warning) holds."""
import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench  # noqa: E402
import ddp_bench  # noqa: E402
import harness  # noqa: E402
from helpers import SharedMemory, live_children, shared_memory  # noqa: E402


def _runner():
    """benchmarks/run.py, imported under a name of its own (``run`` says nothing in sys.modules)."""
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCHMARKS / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


runner = _runner()
NAMES = [b.name for b in runner.benchmarks()]


@pytest.mark.quick
def test_the_entry_point_lists_every_benchmark_with_what_it_measures_and_writes():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "run.py")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert sorted(NAMES) == sorted(set(scripts) - {"harness", "run"})
    listed = [line for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert [line.split(":", 1)[0] for line in listed] == NAMES
    assert all(len(line.split(": ", 1)[1]) > 20 for line in listed)  # what it measures, in a sentence
    writes = [line.strip() for line in proc.stdout.splitlines() if line.startswith(" ")]
    assert len(writes) == len(NAMES) and all(w.startswith("writes ") for w in writes)
    assert "writes results/<machine>/bench.md and .json" in writes


def test_an_unknown_name_is_refused_with_the_list():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), "bench", "benhc"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown benchmark benhc" in proc.stderr and "bench: Side by side" in proc.stderr


# Each tiny run is mostly processes starting and waiting for each other: two at a time end the lot sooner
# than one after another, even on 2 cores; what they print is not measured.
TINY_AT_ONCE = 2


@dataclass
class TinyRun:
    out_dir: Path
    code: int
    output: str


def _run_tiny(name: str, out_dir: Path) -> TinyRun:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), name, "--tiny", "--out-dir", str(out_dir),
                           "--timeout", "240"], capture_output=True, text=True, timeout=280)
    return TinyRun(out_dir, proc.returncode, proc.stdout + proc.stderr)


@dataclass
class TinyRuns:
    by_name: dict[str, TinyRun]
    children_left: list  # the processes the lot left running (none, when all is well)
    # What appeared in shared memory while they ran: theirs, or another test's that ran beside them (-n).
    appeared: SharedMemory


@pytest.fixture(scope="module")
def tiny_runs(request, tmp_path_factory) -> TinyRuns:
    """The benchmarks this session's tests name (all, when none is picked) run at their tiny size,
    TINY_AT_ONCE at a time, each to a folder of its own."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_every_benchmark_runs_at_a_tiny_size_to_its_results"] or NAMES
    folders = [tmp_path_factory.mktemp(name) for name in names]
    before = shared_memory()
    with ThreadPoolExecutor(TINY_AT_ONCE) as pool:
        by_name = dict(zip(names, pool.map(_run_tiny, names, folders)))
    return TinyRuns(by_name, live_children(), shared_memory().new_since(before))


@pytest.mark.timeout(900)  # the first test to ask waits for them all
@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_runs_at_a_tiny_size_to_its_results(name, tiny_runs):
    run = tiny_runs.by_name[name]
    assert run.code == 0, run.output[-3000:]
    result = {b.name: b for b in runner.benchmarks()}[name].result
    if result is None:  # the house prints what it counts
        assert "Trainer class:" in run.output and "files an extension touches:" in run.output
        return
    table = run.out_dir.joinpath(f"{result}.md").read_text()
    assert f"`python benchmarks/{name}.py --tiny`" in table  # how to make it again, --out left out
    assert str(run.out_dir) not in table and "|---" in table
    if name != "launch_starts":  # which appends tables to its .md only
        figures = json.loads(run.out_dir.joinpath(f"{result}.json").read_text())
        assert figures["machine"]["physical_cores"] >= 1


@pytest.mark.alone  # with no test beside it, what appeared beside the tiny runs and is still there is theirs
def test_the_tiny_runs_leave_no_process_or_shared_memory_behind(tiny_runs):
    assert tiny_runs.children_left == []
    assert tiny_runs.appeared.still_in(shared_memory()) == SharedMemory(set(), set())


def test_a_benchmark_over_its_time_is_stopped_with_its_processes(tmp_path, monkeypatch, no_leaks):
    # A benchmark whose process and its child wait for a signal that never comes.
    (tmp_path / "stuck.py").write_text("import os, signal\nos.fork()\nsignal.pause()\n")
    monkeypatch.setattr(runner, "HERE", tmp_path)
    stuck = runner.Benchmark("stuck", "waits", None, "nothing")
    assert runner.run_one(stuck, [], None, timeout=3) == "still running after 3 s, stopped"


@pytest.mark.unit
def test_the_command_a_result_names_leaves_out_paths(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "ab_checkouts.py"), "/home/someone/base", "--rounds", "3",
                                      "--out", "/home/someone/results/x", "--cases=lenet b128"])
    shown = harness.command({"/home/someone/base": "<base checkout>"})
    assert shown == "python benchmarks/ab_checkouts.py '<base checkout>' --rounds 3 '--cases=lenet b128'"


@pytest.mark.unit
def test_case_labels_name_precision_and_layout():
    assert bench.Case("lenet", 64).label == "lenet b64"
    assert bench.Case("lenet", 64, "fp32", True).label == "lenet b64 cl"
    assert bench.Case("cifar10_quick", 100, "bf16", True).label == "cifar10_quick b100 bf16+cl"


@pytest.mark.unit
def test_the_best_launch_table_picks_each_variants_fastest_launch():
    med = {"plain": 100.0, "plain_cpu": 120.0, "ddp": 90.0, "ddp_cpu": 95.0, "ideal": 130.0, "ideal_tcmalloc": 140.0,
           "ideal_lockstep": 150.0, "ideal_shared": 160.0, "sn": 125.0, "sn_jemalloc": 132.0, "sn_1worker": 500.0,
           "sn_sync": 400.0, "sn_inline": 450.0}
    runtimes = bench._runtimes(med)
    # The ideal in lockstep and over shared memory are other ceilings, not launches of the ideal.
    assert runtimes["best_plain"] == ("plain_cpu", 120.0) and runtimes["best_ideal"] == ("ideal_tcmalloc", 140.0)
    assert runtimes["best_sn"] == ("sn_jemalloc", 132.0)  # one worker, sync_batchnorm, inline: other figures
    assert runtimes["sn_over_best_plain"] == pytest.approx(1.1)


@pytest.mark.unit
def test_runtime_launches_are_named_alike_for_every_variant():
    from sn_trainer.node.runtime import Runtime

    assert bench.runtime_of("sn") == bench.runtime_of("ideal") == bench.runtime_of("ideal_lockstep") == \
        bench.runtime_of("ideal_shared") == Runtime("system", "gnu")
    assert bench.runtime_of("ideal_tcmalloc") == Runtime("tcmalloc", "gnu")
    assert bench.runtime_of("sn_jemalloc_intel") == Runtime("jemalloc", "intel")
    variants = bench.variants_of(bench.Case("lenet", 64, "fp32", True), runtimes=True)
    assert {"plain_cpu", "ddp_cpu", "ideal_tcmalloc_intel", "sn_tcmalloc_intel", "sn_system_intel"} <= set(variants)
    launches = {v.split("_", 1)[1] for v in variants if v.startswith("sn_") and v not in bench.OTHER_FIGURES}
    for peer in ("plain", "ideal"):  # the same launches as sn_trainer's, each of them
        assert {f"{peer}_{launch}" for launch in launches} <= set(variants)
    tiny = bench.variants_of(bench.Case("lenet", 8, "fp32", True), runtimes=True, launches=("tcmalloc_intel",))
    assert set(tiny) - set(bench.VARIANTS) == {"plain_cpu", "ddp_cpu", "plain_tcmalloc_intel", "ideal_tcmalloc_intel",
                                              "sn_tcmalloc_intel", "sn_1worker", "sn_inline"}
    assert "sn_sync" in bench.variants_of(bench.Case("cifar10_quick_bn", 100))  # the cost of sync_batchnorm: its row


@pytest.mark.unit
def test_memory_counts_a_whole_process_tree(monkeypatch):
    """Every descendant counted once, a process that just ended as 0. (Not against this process's
    own PSS read twice: it moves between two reads whenever another process maps the same libraries.)"""
    import types

    import psutil

    assert bench.pss_bytes(psutil.Process().pid) > 0
    pss = {1: 100, 2: 20, 3: 3}  # 4: ended between the listing and its read
    monkeypatch.setattr(bench, "pss_bytes", lambda pid: pss.get(pid, 0))
    root = types.SimpleNamespace(pid=1, children=lambda recursive: [types.SimpleNamespace(pid=p) for p in (2, 3, 4)]
                                 if recursive else [types.SimpleNamespace(pid=2)])
    assert bench.tree_pss(root) == 123


@pytest.mark.unit
def test_each_ddp_variant_launches_the_same_script_its_own_way():
    case = ddp_bench.parse_case("lenet b64 cl")
    assert case == {"label": "lenet b64 cl", "model": "lenet", "batch": 64, "channels_last": True}
    commands = {v: ddp_bench.launcher_command(v, case, 2, 5, 1, "out.json") for v in ddp_bench.VARIANTS
                if v != "trainer"}
    assert {v: c[2] for v, c in commands.items()} == {"torchrun_gloo": "torch.distributed.run",
                                                      "launch_gloo": "sn_trainer.launch",
                                                      "launch_sn": "sn_trainer.launch",
                                                      "launch_sn_unpinned": "sn_trainer.launch"}
    assert all(str(ddp_bench.TRAIN) in c and "--channels-last" in c for c in commands.values())
    assert ddp_bench.TRAIN == ROOT / "examples" / "ddp_train.py"
    assert {c[c.index("--backend") + 1] for c in commands.values()} == {"gloo"}  # the script as it is, every time
    assert [v for v, c in commands.items() if "--cpu-backend=sn" in c] == ["launch_sn", "launch_sn_unpinned"]
    assert all(c.index("--cpu-backend=sn") < c.index(str(ddp_bench.TRAIN)) for c in commands.values() if
               "--cpu-backend=sn" in c)  # the launcher's flag, not the script's
    assert [v for v, c in commands.items() if "--no-pin" in c] == ["launch_sn_unpinned"]


@pytest.mark.unit
def test_a_busy_machine_is_said_in_the_ddp_table():
    machine = {"cpu_model": "X", "physical_cores": 2, "isa": ["avx2"], "memory_gib": 1.0, "torch": "2"}
    rows = {"lenet b64": {v: [100.0, 120.0] for v in ddp_bench.VARIANTS}}
    report = {"machine": machine, "nproc": 2, "rounds": 2, "steps": 5, "warmup": 1, "command": "c", "rows": rows,
              "placement": {}, "load": {"wall_seconds": 10, "machine_cpu_seconds": 20, "others_cpu_seconds": 10,
                                        "others_share": 0.5},
              "aborted_at_exit": {v: 0 for v in ddp_bench.VARIANTS if v != "trainer"} | {"launch_gloo": 1}}
    text = ddp_bench.markdown(report)
    assert text.splitlines()[2].startswith("Machine: X, 2 physical cores (avx2), 1.0 GiB, torch 2. `c`:")
    assert "other processes used 10 CPU s of the 20" in text and "cannot judge one variant against another" in text
    assert "| lenet b64 | 110 [100-120] |" in text
    assert "sn_trainer.launch + gloo 1 of 2" in text and "torchrun + gloo 0 of 2" in text  # an abort at exit is counted, not hidden
