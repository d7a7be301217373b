"""Ray Train on the "sn" backend (sn_trainer.integrations.ray), on one node: ``ray.init`` with 2 CPUs, one
cluster for the module. A Ray Train DDP script as its users write it trains over ``SNConfig`` to the bits
it trains to over ``TorchConfig(backend="gloo")``, each worker on group "sn", pinned to a physical core of
its own with its threads; a refusal reaches the driver in its one line. The decisions themselves
(whole CPUs, local ranks per machine, cores and threads) are unit tests. Two nodes: test_ray_nodes.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ray_jobs
from sn_trainer.errors import ConfigError
from sn_trainer.integrations import ray_placement
from sn_trainer.node.topology import PhysicalCore, Topology, read_topology


@pytest.fixture(scope="module")
def ray_node():
    """A local Ray cluster of one node with 2 CPUs (no dashboard), for the whole module."""
    import ray

    with pytest.MonkeyPatch.context() as patch:
        for name, value in ray_jobs.QUICK.items():
            patch.setenv(name, value)  # read by the processes ray.init starts
        # the workers import the tests' modules by name
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH"))
                                                   if p))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.mark.quick
@pytest.mark.timeout(240)
def test_a_ray_train_ddp_script_trains_on_sn_to_the_bits_of_gloo_each_worker_pinned(ray_node, tmp_path):
    from ray.train.torch import TorchConfig

    from sn_trainer.integrations.ray import SNConfig

    ray_jobs.train("gloo", TorchConfig(backend="gloo"), tmp_path, workers=2)
    ray_jobs.train("sn", SNConfig(), tmp_path, workers=2)
    gloo, sn = ray_jobs.saved(tmp_path, "gloo", 2), ray_jobs.saved(tmp_path, "sn", 2)
    cores = read_topology().cores
    for rank in range(2):
        assert (gloo[rank]["backend"], sn[rank]["backend"], sn[rank]["backend_class"]) == ("gloo", "sn", "SnBackend")
        assert sn[rank]["machines"] == 1  # the group sums in this machine's shared memory alone
        for name, value in gloo[rank]["state"].items():
            assert torch.equal(sn[rank]["state"][name], value), name
        placed = sn[rank]["placement"]
        assert (placed.local_rank, placed.local_world_size, placed.threads) == (rank, 2, 1)
        assert placed.cpus == (cores[rank].cpus[0],)  # a physical core each, in the launcher's order
        assert (sn[rank]["affinity"], sn[rank]["threads"]) == (list(placed.cpus), 1)  # where the loop ran
        assert gloo[rank]["placement"] is None
    assert [bool(s["placement"].line) for s in sn] == [True, False]  # said once for the node
    assert 'process group "sn"' in sn[0]["placement"].line and "pinned to cpus" in sn[0]["placement"].line


@pytest.mark.timeout(240)
def test_a_fractional_cpu_allotment_reaches_the_driver_in_its_one_line(ray_node, tmp_path):
    from ray.train import ControllerError

    from sn_trainer.integrations.ray import SNConfig

    with pytest.raises(ControllerError) as refused:
        ray_jobs.train("half", SNConfig(), tmp_path, workers=2, resources_per_worker={"CPU": 0.5})
    assert str(refused.value).splitlines()[-1] == (
        "SNConfig pins each worker to whole physical cores, and resources_per_worker={'CPU': 0.5} is a part of one: "
        "give each worker a whole number of CPUs, e.g. ScalingConfig(resources_per_worker={'CPU': 1})")
    assert not os.path.exists(tmp_path / "half-rank0.pt")


# --- the decisions, without Ray ------------------------------------------------------------------

def topology(cores: int, smt: int = 1) -> Topology:
    return Topology(tuple(PhysicalCore(0, core, 0, tuple(core + cores * t for t in range(smt))) for core in range(cores)))


@pytest.mark.unit
@pytest.mark.parametrize("resources, line", [
    ({"CPU": 1, "GPU": 1}, "SNConfig trains on CPUs: ScalingConfig(use_gpu=True) gives each worker a GPU; use "
                           "ScalingConfig(use_gpu=False) with SNConfig, or Ray's own TorchConfig() for GPU training"),
    ({"CPU": 0.5}, "SNConfig pins each worker to whole physical cores, and resources_per_worker={'CPU': 0.5} is a "
                   "part of one: give each worker a whole number of CPUs, e.g. ScalingConfig(resources_per_worker="
                   "{'CPU': 1})"),
    ({"CPU": 2.5}, "SNConfig pins each worker to whole physical cores, and resources_per_worker={'CPU': 2.5} is not "
                   "a whole number: give each worker a whole number of CPUs, e.g. ScalingConfig(resources_per_worker="
                   "{'CPU': 2})"),
])
def test_a_gpu_or_a_part_of_a_cpu_is_refused_in_one_line(resources, line):
    with pytest.raises(ConfigError) as refused:
        ray_placement.whole_cpus(resources)
    assert str(refused.value) == line


@pytest.mark.unit
def test_a_whole_allotment_is_the_workers_threads():
    assert [ray_placement.whole_cpus(r) for r in ({}, {"CPU": 1}, {"CPU": 4.0}, {"CPU": 2, "GPU": 0})] == [1, 1, 4, 2]


@pytest.mark.unit
def test_workers_are_numbered_per_machine_in_world_rank_order():
    machines = [("a", "node-a", 2), ("b", "node-b", 4), ("a", "node-a", 2), ("b", "node-b", 4), ("b", "node-b", 4)]
    assert ray_placement.local_ranks(machines) == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


@pytest.mark.unit
def test_more_workers_on_a_node_than_physical_cores_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        ray_placement.local_ranks([("a", "node-a", 2), ("b", "node-b", 2)] + [("a", "node-a", 2)] * 2)
    assert str(refused.value) == (
        "3 Ray workers run on node-a, which has 2 physical cores: SNConfig gives each worker cores of its own; start "
        "that node's Ray with at most --num-cpus=2, or ask for more CPUs per worker (ScalingConfig("
        "resources_per_worker={'CPU': k}))")


@pytest.mark.unit
@pytest.mark.parametrize("cores, smt, workers, allotment, expected", [
    (2, 1, 2, 1, [((0,), 1), ((1,), 1)]),
    (4, 1, 2, 2, [((0, 1), 2), ((2, 3), 2)]),
    (4, 2, 2, 4, [((0, 1), 2), ((2, 3), 2)]),  # Ray counts logical CPUs: 4 each, the physical cores hold 2
    (4, 1, 3, 1, [((0,), 1), ((1,), 1), ((2,), 1)]),
])
def test_each_local_rank_gets_physical_cores_of_its_own_and_threads_to_match(cores, smt, workers, allotment,
                                                                             expected):
    machine = topology(cores, smt)
    assert [ray_placement.plan(machine, rank, workers, allotment) for rank in range(workers)] == expected


@pytest.mark.unit
def test_two_ray_workers_on_one_machine_are_refused_for_the_trainer_in_one_line():
    from sn_trainer.integrations import ray_nodes

    ray_nodes.one_per_machine([("a", "node-a", 2), ("b", "node-b", 2)])
    with pytest.raises(ConfigError) as refused:
        ray_nodes.one_per_machine([("a", "node-a", 2), ("b", "node-b", 2), ("a", "node-a", 2)])
    assert str(refused.value) == (
        "2 Ray workers run on node-a: SNNodesConfig runs one per node, whose Trainer starts that node's workers itself; "
        "use ScalingConfig(num_workers=<nodes>, placement_strategy='STRICT_SPREAD', resources_per_worker={'CPU': 2})")


@pytest.mark.unit
def test_node_cluster_outside_a_ray_run_says_how_to_get_one():
    from sn_trainer.integrations import ray_nodes

    with pytest.raises(ConfigError, match=r"torch_config=SNNodesConfig\(\)"):
        ray_nodes.node_cluster()
