"""Tuning: the cost model's maths on synthetic timings, the search, the cache, and workers=auto reusing it."""
import copy
import functools
import json
import os
import platform

import pytest
import torch

from helpers import SmallConvNet, tiny_dataset
import sn_trainer
from sn_trainer import ConfigError, Trainer, tuner as tune
from sn_trainer.node.runtime import Runtime, available_allocators, available_openmps

pytestmark = pytest.mark.timeout(300)


@pytest.mark.unit
def test_a_line_through_timings_recovers_fixed_and_per_sample_costs():
    alpha, beta = tune.fit_line([(16, 0.002 + 16 * 1e-4), (64, 0.002 + 64 * 1e-4), (128, 0.002 + 128 * 1e-4)])
    assert alpha == pytest.approx(0.002) and beta == pytest.approx(1e-4)
    assert tune.fit_line([(10, 0.5)]) == (0.0, 0.05)


@pytest.mark.unit
def test_the_model_shows_the_knee_of_the_papers_figures():
    # 2 ms a step that no batch shrinks, 0.1 ms a sample, 1 ms to synchronise 2 workers.
    cal = tune.Calibration({1: (0.002, 1e-4)}, sync_two=0.001, sync_per_doubling=0.0005)
    machine, batch = tune.Machine(cores=64), 128
    rates = {w: tune.predict(cal, machine, batch, w, 1) for w in (1, 2, 4, 8, 16, 32, 64)}
    assert rates[1] == pytest.approx(128 / (0.002 + 0.0128))
    assert rates[2] == pytest.approx(128 / (0.002 + 0.0064 + 0.001))
    assert rates[8] == pytest.approx(128 / (0.002 + 0.0016 + 0.001 + 0.0005 * 2))
    knee = max(rates, key=rates.get)
    assert 4 <= knee <= 16  # too few samples per worker beyond it: the fixed cost and the sync dominate
    assert rates[64] < rates[knee]


@pytest.mark.unit
def test_shared_cores_and_memory_bandwidth_slow_predictions_down():
    cal = tune.Calibration({1: (0.0, 1e-3)}, 0.0, 0.0, bytes_per_sample=1e6)
    assert tune.predict(cal, tune.Machine(cores=2), 64, 4, 1) == pytest.approx(tune.predict(
        cal, tune.Machine(cores=4), 64, 4, 1) / 2)  # 4 workers on 2 cores: half as fast
    fast = tune.predict(cal, tune.Machine(cores=8, bandwidth_gbs=100), 64, 8, 1)
    starved = tune.predict(cal, tune.Machine(cores=8, bandwidth_gbs=2), 64, 8, 1)
    assert fast == pytest.approx(64 / 8e-3) and starved == pytest.approx(2e9 / 1e6)  # bandwidth-bound


@pytest.mark.unit
def test_threads_not_measured_split_the_per_sample_work_of_the_nearest_below():
    cal = tune.Calibration({1: (0.001, 1e-4), 2: (0.001, 6e-5)}, 0.0, 0.0)
    assert tune.compute_seconds(cal, 4, 100) == pytest.approx(0.001 + 6e-5 * 2 / 4 * 100)


@pytest.mark.unit
def test_the_search_verifies_the_best_predictions_and_the_runtimes():
    calls = []

    def measure(workers, threads, batch, runtime):  # a machine where 2 workers pay off, tcmalloc and Intel's OpenMP do
        calls.append((workers, threads, batch, runtime))
        seconds = 0.001 + 1e-4 * batch / workers / threads ** 0.5 + (0.0005 if workers > 1 else 0.0)
        seconds /= 1.2 if runtime.allocator == "tcmalloc" else 1.0
        seconds /= 1.1 if runtime.openmp == "intel" else 1.0
        return batch / seconds, seconds

    cal, rows, runtimes = tune.search(measure, cores=2, batch=128, allocators=["system", "jemalloc", "tcmalloc"],
                                      openmps=["gnu", "intel"])
    assert cal.compute[1] == pytest.approx((0.001, 1e-4))
    assert {(r["workers"], r["threads"]) for r in rows} == {(1, 1), (2, 1), (1, 2)}
    best = max((r for r in rows if r["measured"]), key=lambda r: r["measured"])
    assert (best["workers"], best["threads"]) == (2, 1)
    assert runtimes[Runtime("tcmalloc", "gnu")] > runtimes[Runtime("jemalloc", "gnu")] \
        == pytest.approx(runtimes[Runtime("system", "gnu")])
    # Intel's OpenMP is tried at the winner with the fastest allocator, and wins there.
    assert calls[-2] == (2, 1, 128, Runtime("tcmalloc", "intel"))
    assert max(runtimes, key=runtimes.get) == Runtime("tcmalloc", "intel")
    assert set(runtimes) == {Runtime("system", "gnu"), Runtime("jemalloc", "gnu"), Runtime("tcmalloc", "gnu"),
                             Runtime("tcmalloc", "intel")}
    # tcmalloc with Intel's OpenMP then runs at the runner-up too (1 x 2 here), which stays slower.
    assert calls[-1] == (1, 2, 128, Runtime("tcmalloc", "intel"))
    assert tune.winner(rows, runtimes)[:3] == (2, 1, Runtime("tcmalloc", "intel"))
    assert len(calls) <= 9  # calibration reuses its runs: no candidate is measured twice


@pytest.mark.unit
def test_a_runtime_that_favours_the_runner_up_moves_the_choice_there():
    def measure(workers, threads, batch, runtime):  # Intel's OpenMP: a little faster at 2 x 1, twice at 1 x 2
        seconds = 0.001 + 1e-4 * batch / workers / threads ** 0.5 + (0.0005 if workers > 1 else 0.0)
        seconds /= (2.0 if threads > 1 else 1.05) if runtime.openmp == "intel" else 1.0
        return batch / seconds, seconds

    cal, rows, runtimes = tune.search(measure, cores=2, batch=128, allocators=["system"], openmps=["gnu", "intel"])
    best = max((r for r in rows if r["measured"]), key=lambda r: r["measured"])
    assert (best["workers"], best["threads"]) == (2, 1)  # with torch's own OpenMP
    assert tune.winner(rows, runtimes)[:3] == (1, 2, Runtime("system", "intel"))


@pytest.mark.unit
def test_the_cache_is_keyed_and_ignores_stale_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = SmallConvNet()
    key = tune.cache_key(model, 64, 1, "fp32")
    assert key != tune.cache_key(model, 128, 1, "fp32") != tune.cache_key(SmallConvNet(classes=4), 64, 1, "fp32")
    assert key != tune.cache_key(model, 64, 1, "bf16")
    result = tune.TuneResult(2, 1, Runtime("system", "gnu"), 1000.0, [], tune.Calibration({1: (0.0, 1e-3)}, 0.0, 0.0), 1.0)
    path = tune.store(key, result)
    assert path == tmp_path / "sn_trainer" / "tune.json"
    assert tune.load(key)["workers"] == 2
    cache = json.loads(path.read_text())
    cache[key]["versions"]["torch"] = "0.0.1"  # measured with other software: not carried over
    path.write_text(json.dumps(cache))
    assert tune.load(key) is None
    cache[key]["versions"] = {**tune.versions(), "format": 1}  # measured before the OpenMP runtime was tuned
    path.write_text(json.dumps(cache))
    assert tune.load(key) is None
    assert tune.load("no such key") is None


@pytest.mark.quick
def test_tune_measures_caches_and_workers_auto_uses_it(tmp_path, monkeypatch, caplog):
    import functools
    import logging

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.manual_seed(0)
    model, sgd = SmallConvNet(), functools.partial(torch.optim.SGD, lr=0.01)
    result = Trainer(batch_size=16).tune(model, tiny_dataset(n=160), optimizer=sgd, steps=3, warmup=1, window_s=0.0,
                                         allocators=["system"], openmps=["gnu"])
    assert any(r["measured"] for r in result.rows) and result.samples_per_sec > 0
    assert (result.workers, result.threads) in {(r["workers"], r["threads"]) for r in result.rows}
    assert "best: workers=" in result.table()
    fitted = Trainer(batch_size=16, max_steps=2).fit(model, tiny_dataset(n=160), optimizer=sgd)
    assert (fitted.workers, fitted.threads) == (result.workers, result.threads)
    assert "workers=auto: the tuned setting measured" in caplog.text


def test_the_runtime_is_preloaded_in_the_workers_and_trains_the_same(tmp_path):
    openmp = "intel" if platform.machine() == "x86_64" else "gnu"  # Intel's OpenMP: a wheel for x86-64 only
    allocator = [a for a in available_allocators() if a != "system"]
    if not allocator or openmp not in available_openmps():
        pytest.fail("jemalloc, tcmalloc or libiomp5 missing here: scripts/setup.sh installs them")
    torch.manual_seed(0)
    model = SmallConvNet()
    reference = copy.deepcopy(model)
    probe = AllocatorProbe(model, str(tmp_path))
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    result = Trainer(workers=2, threads=1, batch_size=8, max_steps=3, allocator=allocator[0], openmp=openmp).fit(
        probe, tiny_dataset(), optimizer=sgd)
    maps = [p.read_text() for p in tmp_path.glob("*.maps")]
    assert len(maps) == 2 and all(("jemalloc" if allocator[0] == "jemalloc" else "tcmalloc") in m for m in maps)
    assert all(("libiomp5" in m) == (openmp == "intel") for m in maps)
    assert (result.plan["allocator"], result.plan["openmp"]) == (allocator[0], openmp)
    # The runtime changes where memory comes from and who runs the threads, not the arithmetic.
    Trainer(workers=2, threads=1, batch_size=8, max_steps=3).fit(reference, tiny_dataset(), optimizer=sgd)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.unit
def test_a_runtime_that_is_not_installed_is_refused_up_front(monkeypatch):
    from sn_trainer.node import runtime

    monkeypatch.setattr(runtime, "_intel_openmp", lambda: None)
    with pytest.raises(ConfigError, match="openmp=intel: libiomp5 is not installed; install it"):
        Trainer(workers=1, openmp="intel")
    with pytest.raises(ConfigError, match="no runtime allocator=system openmp=intl: .* the OpenMP runtimes gnu, intel"):
        sn_trainer.warm_up(openmp="intl")


class AllocatorProbe(torch.nn.Module):
    """Writes down, from each worker, which shared libraries it has mapped."""

    def __init__(self, inner, out_dir):
        import os

        super().__init__()
        self.inner, self.out_dir, self.done, self.launcher = inner, out_dir, False, os.getpid()

    def forward(self, x):
        import os

        if not self.done and os.getpid() != self.launcher:  # the workers, not the launcher's preflight
            self.done = True
            with open(os.path.join(self.out_dir, f"{os.getpid()}.maps"), "w") as f:
                f.write(open("/proc/self/maps").read())
        return self.inner(x)


# A step's memory as a conv net's forward pass holds it (MiB): blocks glibc, as it ships, gives back to
# the kernel when they are freed and faults in again page by page when they are allocated the next time.
STEP_BLOCKS_MIB = (13, 13, 3, 3, 1, 1, 0.5)


def faults_of_a_step(rounds: int = 3) -> int:
    """Pages the kernel faulted in for the last of ``rounds`` allocations of STEP_BLOCKS_MIB, each
    written and freed, through the C library's malloc."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    sizes = [int(mib * 2**20) for mib in STEP_BLOCKS_MIB]
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for size in sizes]
        for block, size in zip(blocks, sizes):
            ctypes.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


class HeapProbe(torch.nn.Module):
    """Writes down, from each worker, what a step's allocations cost it in page faults."""

    def __init__(self, inner, out_dir):
        super().__init__()
        self.inner, self.out_dir, self.launcher = inner, out_dir, os.getpid()

    def forward(self, x):
        from sn_trainer.recipe import position

        # The workers' steps after their first, not the rehearsal's (a warm process of glibc's own, at step 0).
        if os.getpid() != self.launcher and position.current().step:
            with open(os.path.join(self.out_dir, f"{os.getpid()}.faults"), "w") as f:
                f.write(str(faults_of_a_step()))
        return self.inner(x)


def test_a_worker_keeps_freed_memory_for_the_next_step_where_glibc_would_give_it_back(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    shipped = subprocess.run([sys.executable, "-c", "import test_tune; print(test_tune.faults_of_a_step())"],
                             cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=60)
    assert shipped.returncode == 0, shipped.stderr
    assert int(shipped.stdout) > 2000  # glibc as it ships: every step faults its blocks in again
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    Trainer(workers=2, threads=1, batch_size=8, max_steps=3).fit(HeapProbe(SmallConvNet(), str(tmp_path)),
                                                                 tiny_dataset(), optimizer=sgd)
    faults = [int(p.read_text()) for p in tmp_path.glob("*.faults")]
    assert len(faults) == 2 and max(faults) < 100, faults


@pytest.mark.unit
def test_malloc_is_left_as_it_is_under_another_allocator_or_the_users_own_malloc_settings(monkeypatch):
    from sn_trainer.node.runtime import keep_freed_memory

    assert not keep_freed_memory("jemalloc") and not keep_freed_memory("tcmalloc")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not keep_freed_memory("system")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert not keep_freed_memory("system")


def test_the_tuners_command_predicts_another_machine_from_the_cached_calibration(tmp_path, monkeypatch):
    import subprocess
    import sys

    from sn_trainer.models import build_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cal = tune.Calibration({1: (0.002, 1e-4)}, sync_two=0.001, sync_per_doubling=0.0005)
    tune.store(tune.cache_key(build_model("lenet", (1, 28, 28), 10), 128, 1, "fp32"),
               tune.TuneResult(1, 1, Runtime("system", "gnu"), 1000.0, [], cal, 1.0))
    proc = subprocess.run([sys.executable, "-m", "sn_trainer.tuner", "--predict", "cores=8", "--model", "lenet",
                           "--batch", "128"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "on 8 cores" in proc.stdout and "calibrated" in proc.stdout and "knee:" in proc.stdout
    rows = {int(line.split()[0]): float(line.split()[2]) for line in proc.stdout.splitlines()
            if line.strip() and line.split()[0].isdigit()}
    assert rows == {w: pytest.approx(tune.predict(cal, tune.Machine(8), 128, w, 1), abs=0.5) for w in (1, 2, 4, 8)}
    moved = subprocess.run([sys.executable, "-m", "sn_trainer.report", "--predict", "cores=8"], capture_output=True,
                           text=True, timeout=60)
    assert moved.returncode == 2 and "python -m sn_trainer.tuner --predict cores=8" in moved.stderr
