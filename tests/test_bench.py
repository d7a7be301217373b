"""The benchmark scripts keep working: every variant runs at a tiny size and reports a rate."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench  # noqa: E402

from sn_trainer.engine.topology import read_topology  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_case_labels_name_precision_and_layout():
    assert bench.Case("lenet", 64).label == "lenet b64"
    assert bench.Case("lenet", 64, "fp32", True).label == "lenet b64 cl"
    assert bench.Case("cifar10_quick", 100, "bf16", True).label == "cifar10_quick b100 bf16+cl"


@pytest.mark.parametrize("variant", bench.VARIANTS)
def test_every_variant_trains_and_reports_a_rate(variant, no_leaks):
    case = bench.Case("lenet", 8, "fp32", True)
    rate = bench.measure(variant, case, 2, bench.Timing(warmup=1, steps=3), read_topology())
    assert rate > 0


@pytest.mark.parametrize("case, variant", [(bench.Case("cifar10_quick_bn", 8), "sn_sync"), (bench.Case("gpt", 4), "sn"),
                                           (bench.Case("gpt", 4), "ddp")])
def test_batch_norm_and_gpt_cases_run(case, variant, no_leaks):
    assert variant in bench.variants_of(case)
    assert bench.measure(variant, case, 2, bench.Timing(warmup=1, steps=2), read_topology()) > 0


def test_the_best_launch_table_picks_each_variants_fastest_launch():
    med = {"plain": 100.0, "plain_cpu": 120.0, "ddp": 90.0, "ddp_cpu": 95.0, "ideal": 130.0, "ideal_tcmalloc": 140.0,
           "sn": 125.0, "sn_jemalloc": 132.0, "sn_1worker": 500.0, "sn_sync": 400.0}
    runtimes = bench._runtimes(med)
    assert runtimes["best_plain"] == ("plain_cpu", 120.0) and runtimes["best_ideal"] == ("ideal_tcmalloc", 140.0)
    assert runtimes["best_sn"] == ("sn_jemalloc", 132.0)  # one worker and sync_batchnorm are other rows' figures
    assert runtimes["sn_over_best_plain"] == pytest.approx(1.1)


def test_runtime_launches_are_named_and_run():
    from sn_trainer.engine.runtime import Runtime

    assert bench.runtime_of("sn") == bench.runtime_of("ideal") == Runtime("system", "gnu")
    assert bench.runtime_of("ideal_tcmalloc") == Runtime("tcmalloc", "gnu")
    assert bench.runtime_of("sn_jemalloc_intel") == Runtime("jemalloc", "intel")
    variants = bench.variants_of(bench.Case("lenet", 64, "fp32", True), runtimes=True)
    assert {"plain_cpu", "ddp_cpu", "ideal_tcmalloc_intel", "sn_tcmalloc_intel", "sn_system_intel"} <= set(variants)
    launches = {v.split("_", 1)[1] for v in variants if v.startswith("sn_") and v not in ("sn_sync", "sn_1worker")}
    for peer in ("plain", "ideal"):  # the same launches as sn_trainer's, each of them
        assert {f"{peer}_{launch}" for launch in launches} <= set(variants)
    case = bench.Case("lenet", 8, "fp32", True)  # sn_trainer with a runtime: tests/test_tune.py
    assert bench.measure("ideal_tcmalloc_intel", case, 2, bench.Timing(warmup=1, steps=2), read_topology()) > 0
    assert bench.measure("plain_tcmalloc_intel", case, 2, bench.Timing(warmup=1, steps=2), read_topology()) > 0


def test_memory_counts_a_whole_process_tree():
    import psutil

    me = psutil.Process()
    assert bench.tree_pss(me) >= bench.pss_bytes(me.pid) > 0

