"""The sweep report, on a small real multirun."""
import csv
import json
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.timeout(400)
PNGS = ("speed_vs_workers.png", "speed_vs_batch.png", "heatmap.png", "efficiency.png", "stages.png")


def run_module(module, args, cwd):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_report_of_a_two_by_two_benchmark_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_module("sn_trainer", [
        "--multirun", "dataset=synthetic", "dataset.train_size=512", "dataset.test_size=16",
        "bench.enabled=true", "bench.steps=4", "bench.warmup=1", "batch_size=16,32", "workers=1,2", "threads=1",
        "profile=true", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"report: python -m sn_trainer.report {sweep}" in proc.stdout

    summary = json.loads(next(sweep.glob("*workers=2*/summary.json")).read_text())
    assert summary["measured_steps"] == 4 and summary["test_accuracy"] is None  # bench mode: no eval
    assert len(summary["cpu_percent_per_core"]) >= 1
    job_dir = next(sweep.glob("*workers=2*"))
    for rank in (0, 1):  # profile=true: a Chrome trace per worker
        trace = json.loads((job_dir / f"trace_rank{rank}.json").read_text())
        assert trace["traceEvents"]

    report = run_module("sn_trainer.report", [str(sweep)], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "best: batch_size=" in report.stdout
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert sorted((int(r["batch_size"]), int(r["workers"])) for r in rows) == [(16, 1), (16, 2), (32, 1), (32, 2)]
    assert all(float(r["samples_per_sec"]) > 0 for r in rows)
    assert {float(r["efficiency"]) for r in rows if r["workers"] == "1"} == {1.0}  # threads=1 here
    for name in PNGS:
        with Image.open(sweep / name) as image:
            image.verify()
        with Image.open(sweep / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200
            assert len(image.convert("L").getcolors(maxcolors=1 << 16) or range(999)) > 10  # not a blank canvas


def test_report_on_a_directory_without_summaries_fails_clearly(tmp_path):
    proc = run_module("sn_trainer.report", [str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no job summaries (summary.json) under")
    missing = run_module("sn_trainer.report", [str(tmp_path / "nope")], cwd=tmp_path)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def test_skipped_jobs_are_recorded_and_left_out(tmp_path):
    out = tmp_path / "run"
    proc = run_module("sn_trainer", ["dataset=synthetic", "bench.enabled=true", "bench.skip_oversubscribed=true",
                                     "workers=64", "threads=4", "batch_size=256", f"hydra.run.dir={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exceeds the" in json.loads((out / "summary.json").read_text())["skipped"]
    assert run_module("sn_trainer.report", [str(tmp_path)], cwd=tmp_path).returncode == 2


@pytest.mark.unit
@pytest.mark.quick
def test_speed_axes_start_at_zero_and_a_shared_machine_is_flagged():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sn_trainer.report import sweep

    rows = [{"job": f"j{w}", "model": "lenet", "batch_size": 64, "workers": w, "threads": 1, "per_worker_batch": 64 / w,
             "samples_per_sec": 5000 + 100 * w, "efficiency": None, "other_cpu_percent": other}
            for w, other in ((1, 0.4), (2, 31.0))]
    for draw in (sweep._speed_vs_workers, sweep._speed_vs_batch):
        fig, ax = plt.subplots()
        draw(ax, rows)
        assert ax.get_ylim()[0] == 0, draw.__name__
        plt.close(fig)
    text = sweep.table(rows)
    assert "warning: in 1 of 2 jobs other processes used more than 5% of the machine's CPU (up to 31%, job j2)" in text
