"""The doctor: each symptom built for real at a tiny size, and the finding it ranks first; the
machine checks on fabricated sysfs/procfs trees; bad input in one line."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import sn_trainer
from sn_trainer import Trainer
from sn_trainer.doctor.__main__ import main
from sn_trainer.doctor.machine import machine_findings
from sn_trainer.models import build_model

pytestmark = pytest.mark.timeout(120)


def images(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


class SlowReads(Dataset):
    """Images whose every read sleeps: a data-bound run."""

    def __init__(self, n: int, seconds: float):
        self.data, self.seconds = images(n), seconds

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.data[index]


def lenet_fit(train_set, **settings):
    torch.manual_seed(0)
    return Trainer(workers=2, pin=True, **settings).fit(build_model("lenet", (1, 28, 28), 10), train_set)


def test_a_dataset_that_sleeps_is_data_bound():
    result = lenet_fit(SlowReads(256, 0.003), batch_size=32, max_steps=8, measure_after=2)
    found = sn_trainer.diagnose(result)
    assert found.top.check == "data" and not found.top.ok, found.report()
    assert "__getitem__" in found.top.fix and found.top.seconds > 0


@pytest.mark.quick
def test_two_samples_per_worker_on_lenet_is_below_the_knee():
    result = lenet_fit(images(256), batch_size=4, max_steps=40, measure_after=5)
    found = sn_trainer.diagnose(result)
    assert found.top.check == "per-worker batch", found.report()
    assert "2 samples per worker" in found.top.evidence and "workers=1" in found.top.fix
    assert "batch_size=32" in found.top.fix


@pytest.mark.alone  # what another test beside it runs would count as other processes' CPU too
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a second core to pin the spinner to")
def test_a_process_spinning_on_a_workers_core_is_a_busy_machine():
    core = sorted(os.sched_getaffinity(0))[1]  # worker 1's CPU (workers take the allowed cores in order)
    spinner = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        result = lenet_fit(images(1024), batch_size=64, max_steps=30, measure_after=5)
    finally:
        spinner.kill()
        spinner.wait()
    found = sn_trainer.diagnose(result)
    busy = found.condition  # said before the run's own findings: the machine the figures come from
    assert not busy.ok and busy.check == "other processes' CPU", found.report()
    assert "for its CPU while another process ran" in busy.evidence, found.report()
    # The spinner takes one of the two cores' time: pinned, worker 1 waits for it about half the time it
    # could run; unpinned (pin=auto, where the machine is busy as the run starts), the OS spreads the wait
    # over both workers. Together they wait at least a quarter of the measured time.
    assert sum(result.run_queue_seconds) >= 0.25 * result.train_seconds, found.report()
    assert busy.seconds >= max(result.run_queue_seconds)


# --- the machine, on fabricated trees -----------------------------------------------------------

def fabricate(root, governor="powersave", swap_free_kib=1024, smt=True):
    """sysfs and procfs of a 2-core, 4-CPU machine (CPUs 0 and 2, 1 and 3 siblings when ``smt``)."""
    sys_root, proc_root = root / "sys", root / "proc"
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text("0-3\n")
    for cpu in range(4):
        (cpu_dir / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (cpu_dir / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{cpu % 2 if smt else cpu}\n")
        (cpu_dir / f"cpu{cpu}" / "topology" / "physical_package_id").write_text("0\n")
        if governor:
            (cpu_dir / f"cpu{cpu}" / "cpufreq").mkdir()
            (cpu_dir / f"cpu{cpu}" / "cpufreq" / "scaling_governor").write_text(f"{governor}\n")
    (sys_root / "kernel" / "mm" / "transparent_hugepage").mkdir(parents=True)
    (sys_root / "kernel" / "mm" / "transparent_hugepage" / "enabled").write_text("always madvise [never]\n")
    (proc_root / "sys" / "vm").mkdir(parents=True)
    (proc_root / "sys" / "vm" / "swappiness").write_text("60\n")
    (proc_root / "meminfo").write_text(f"MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\nSwapTotal: 2097152 kB\n"
                                       f"SwapFree: {swap_free_kib} kB\n")
    (proc_root / "stat").write_text("cpu 100 0 50 1000 10 0 0 0 0 0\n")
    return sys_root, proc_root


def by_check(findings):
    return {f.check: f for f in findings}


@pytest.mark.unit
def test_the_machine_checks_read_a_fabricated_tree(tmp_path):
    found = by_check(machine_findings(*fabricate(tmp_path), sample_seconds=0.01, kernels=False))
    assert "SMT" in found["cores"].evidence and "workers x threads at most 2" in found["cores"].fix
    assert "powersave on CPUs 0-3" in found["frequency governor"].evidence
    assert "performance" in found["frequency governor"].fix
    assert "2.00 GiB of 2.00 GiB swap in use" in found["swap"].evidence and not found["swap"].ok
    assert not found["vm.swappiness"].ok and "vm.swappiness=10" in found["vm.swappiness"].fix
    assert not found["transparent huge pages"].ok
    assert found["memory"].ok and found["NUMA"].ok and found["CPU quota"].ok


@pytest.mark.unit
def test_a_tree_without_cpufreq_or_swap_files_says_not_visible(tmp_path):
    sys_root, proc_root = fabricate(tmp_path, governor=None, smt=False)
    (proc_root / "meminfo").unlink()
    (proc_root / "stat").unlink()
    found = by_check(machine_findings(sys_root, proc_root, sample_seconds=0.01, kernels=False))
    assert found["cores"].ok and "no SMT" in found["cores"].evidence
    for check in ("frequency governor", "swap", "memory", "other processes' CPU"):
        assert not found[check].visible and found[check].ok, check
        assert "not visible" in found[check].line()


def test_the_command_line_checks_a_fabricated_machine(tmp_path, capsys):
    sys_root, proc_root = fabricate(tmp_path)
    assert main(["--sys-root", str(sys_root), "--proc-root", str(proc_root), "--sample", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "frequency governor: powersave" in out and "torch kernels: ATen kernels" in out


# --- run folders ----------------------------------------------------------------------------------

def summary(**changes):
    base = {"model": "lenet", "samples_per_sec": 3000.0, "per_worker_batch": 32.0, "workers": 2, "threads": 1,
            "batch_size": 64, "steps": 100, "measured_steps": 100, "train_seconds": 2.0,
            "stage_seconds": {"data": 0.02, "forward": 0.5, "backward": 1.0, "reduce": 0.3, "update": 0.1,
                              "wait": 0.02},
            "stage_seconds_per_worker": [{"data": 0.02, "forward": 0.5, "backward": 1.0, "reduce": 0.3,
                                          "update": 0.1, "wait": 0.02}] * 2,
            "other_cpu_percent": 1.0, "peak_memory_bytes": 2**29, "final_loss": 0.5,
            "machine": {"memory_gib": 16, "physical_cores": 2},
            "config": {"dataset": {"name": "synthetic"}, "optim": {"scale_lr": False, "reference_batch": 256}},
            "plan": {"prefetch": True, "accumulate": 1, "compile": False, "pinning": [[0], [1]]}}
    base.update(changes)
    return base


def write_run(folder, losses=None, **changes):
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary(**changes)))
    if losses:
        (folder / "metrics.csv").write_text("step,loss\n" + "".join(f"{i},{x}\n" for i, x in enumerate(losses)))
    return folder


@pytest.mark.unit
def test_a_folder_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("nothing here")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no summary.json" in err[0]
    assert main([str(tmp_path / "notes.txt")]) == 2
    (tmp_path / "summary.json").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    assert "not readable JSON" in capsys.readouterr().err


@pytest.mark.unit
def test_an_older_summary_says_what_it_lacks_and_reads_the_rest(tmp_path, capsys):
    old = summary()
    old["phase_seconds"] = old.pop("stage_seconds")  # its name before sn_trainer 0.3
    for key in ("stage_seconds_per_worker", "other_cpu_percent", "peak_memory_bytes"):
        del old[key]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps(old))
    assert main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "data: the data stage takes" in out
    assert "memory headroom: not visible (not recorded in this summary" in out
    assert "other processes' CPU: not visible" in out
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "summary.json").write_text(json.dumps({"samples_per_sec": 10.0}))
    assert main([str(tmp_path / "bare")]) == 0
    assert "data: not visible" in capsys.readouterr().out


@pytest.mark.unit
def test_a_sweeps_fastest_job_is_the_knee_of_the_others(tmp_path, capsys):
    write_run(tmp_path / "0_workers=2")
    write_run(tmp_path / "1_workers=4", workers=4, per_worker_batch=16.0, samples_per_sec=2000.0)
    assert main([str(tmp_path), "--no-data"]) == 0
    out = capsys.readouterr().out
    assert "1. per-worker batch: 16 samples per worker; the sweep's fastest measured ran 32 per worker" in out
    assert "workers=2" in out


@pytest.mark.unit
def test_a_loss_that_diverged_after_a_larger_batch_names_scale_lr(tmp_path, capsys):
    write_run(tmp_path / "run", losses=[2.3, 2.1, 5.0, float("nan")], batch_size=512, per_worker_batch=256.0)
    assert main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "1. loss: " in out and "optim.reference_batch=256" in out and "optim.scale_lr=true" in out


@pytest.mark.unit
def test_a_folder_run_times_its_files_against_the_compute(tmp_path, capsys):
    from PIL import Image

    for i in range(12):
        (tmp_path / "images" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray((torch.rand(16, 16, 3) * 255).to(torch.uint8).numpy()).save(
            tmp_path / "images" / f"c{i % 2}" / f"{i}.jpg")
    dataset = {"name": "folder", "root": str(tmp_path / "images"), "image_size": 16, "augment": True,
               "preload": False}
    write_run(tmp_path / "run", config={"dataset": dataset, "optim": {}})
    assert main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "disk read: " in out and "over 12 files" in out and "decode + augmentation: " in out
    assert "what bounds the data: per sample in a worker: the disk " in out and "the model's compute 0.5 ms" in out


@pytest.mark.unit
def test_memory_without_the_articles_headroom_names_a_smaller_batch(tmp_path, capsys):
    write_run(tmp_path / "run", peak_memory_bytes=14 * 2**30)  # of 16 GiB
    assert main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "1. memory headroom: peak 14.00 GiB of 16 GiB: 12% left" in out and "batch_size=51 or smaller" in out


@pytest.mark.unit
def test_compile_left_off_where_tune_measured_it_faster():
    from sn_trainer.doctor import diagnose_facts
    from sn_trainer.doctor.run import RunFacts

    found = diagnose_facts(RunFacts(summary(compile_rates={"eager": 1000.0, "compiled": 1250.0}), cli=True), "x")
    assert found.top.check == "compile" and found.top.fix.startswith("compile=true")
    assert found.top.seconds == pytest.approx(2.0 * (1 - 1000 / 1250))
