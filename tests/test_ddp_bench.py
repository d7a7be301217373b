"""benchmarks/ddp_bench.py's own logic: the commands it launches and the table it writes (the
measurements themselves are the script's run, not a test's)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ddp_bench  # noqa: E402


def test_each_variant_launches_the_same_script_its_own_way():
    case = ddp_bench.parse_case("lenet b64 cl")
    assert case == {"label": "lenet b64 cl", "model": "lenet", "batch": 64, "channels_last": True}
    commands = {v: ddp_bench.launcher_command(v, case, 2, 5, 1, "out.json") for v in ddp_bench.VARIANTS
                if v != "trainer"}
    assert {v: c[2] for v, c in commands.items()} == {"torchrun_gloo": "torch.distributed.run",
                                                      "launch_gloo": "sn_trainer.launch",
                                                      "launch_sn": "sn_trainer.launch",
                                                      "launch_sn_unpinned": "sn_trainer.launch"}
    assert all(str(ddp_bench.TRAIN) in c and "--channels-last" in c for c in commands.values())
    assert {c[c.index("--backend") + 1] for c in commands.values()} == {"gloo"}  # the script as it is, every time
    assert [v for v, c in commands.items() if "--cpu-backend=sn" in c] == ["launch_sn", "launch_sn_unpinned"]
    assert all(c.index("--cpu-backend=sn") < c.index(str(ddp_bench.TRAIN)) for c in commands.values() if
               "--cpu-backend=sn" in c)  # the launcher's flag, not the script's
    assert [v for v, c in commands.items() if "--no-pin" in c] == ["launch_sn_unpinned"]


def test_a_busy_machine_is_said_in_the_table():
    machine = {"cpu_model": "X", "physical_cores": 2, "isa": ["avx2"], "memory_gib": 1.0, "torch": "2"}
    rows = {"lenet b64": {v: [100.0, 120.0] for v in ddp_bench.VARIANTS}}
    report = {"machine": machine, "nproc": 2, "rounds": 2, "steps": 5, "warmup": 1, "command": "c", "rows": rows,
              "placement": {}, "load": {"wall_seconds": 10, "machine_cpu_seconds": 20, "others_cpu_seconds": 10,
                                        "others_share": 0.5},
              "aborted_at_exit": {v: 0 for v in ddp_bench.VARIANTS if v != "trainer"} | {"launch_gloo": 1}}
    text = ddp_bench.markdown(report)
    assert "other processes used 10 CPU s of the 20" in text and "cannot judge one variant against another" in text
    assert "| lenet b64 | 110 [100-120] |" in text
    assert "sn_trainer.launch + gloo 1 of 2" in text and "torchrun + gloo 0 of 2" in text  # an abort at exit is counted, not hidden
