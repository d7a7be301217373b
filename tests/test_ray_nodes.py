"""Ray Train on the "sn" backend across two nodes: a ``ray.cluster_utils.Cluster`` of two nodes of 2 CPUs on
this machine, one cluster for the module. The second node's Ray (its raylet, and the workers it starts)
runs in a UTS namespace of its own under another host name, and at another loopback address, so that it
is another machine to the "sn" backend and another node to Ray (whose local ranks go by node address).

One worker per node: ``SNConfig`` trains to the bits of ``TorchConfig(backend="gloo")`` (both add two
numbers between the machines). Two workers per node: within 1e-12 in float64, as the two backends add
four ranks' gradients in different orders ("sn": each machine's pair in shared memory, then the machines
over gloo); each node's workers pinned to cores of their own, and each node says so once.

sn_trainer's own Trainer, one Ray worker per node (``SNNodesConfig``): trains like one node with all the
workers (the multi-node contract, as tests/test_multinode.py holds torchrun's nodes to it), and a node
lost mid-run (its Ray worker SIGKILLed, its Trainer's workers with it) is restarted by Ray Train's
FailureConfig, every node resuming from the run's last checkpoint.
"""
from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import pytest
import torch

import ray_jobs
from helpers import SmallConvNet, tiny_dataset

OTHER_HOST = "sn-ray-b"


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        for name, value in ray_jobs.QUICK.items():
            patch.setenv(name, value)  # read by the processes the cluster starts
        # the workers import the tests' modules (and the Trainer's workers the model's class) by name
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH"))
                                                   if p))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        try:
            with ray_jobs.another_machine(OTHER_HOST):
                cluster.add_node(num_cpus=2, node_ip_address="127.0.0.2")
            # the other host's name resolves nowhere: gloo binds to the loopback interface, in every run
            ray.init(address=cluster.address, log_to_driver=False,
                     runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
            yield ray
        finally:
            ray.shutdown()
            cluster.shutdown()


def assert_ran_on_sn_across_two_machines(sn: list[dict]) -> None:
    assert {s["host"] for s in sn} == {socket.gethostname(), OTHER_HOST}
    for found in sn:
        assert (found["backend"], found["backend_class"], found["machines"]) == ("sn", "SnBackend", 2)
        assert (found["affinity"], found["threads"]) == (list(found["placement"].cpus), found["placement"].threads)


@pytest.mark.quick
@pytest.mark.timeout(240)
def test_one_worker_on_each_of_two_nodes_trains_to_the_bits_of_gloo(two_nodes, tmp_path):
    from ray.train.torch import TorchConfig

    from sn_trainer.integrations.ray import SNConfig

    ray_jobs.train("gloo", TorchConfig(backend="gloo"), tmp_path, workers=2, placement_strategy="SPREAD")
    ray_jobs.train("sn", SNConfig(), tmp_path, workers=2, placement_strategy="SPREAD")
    gloo, sn = ray_jobs.saved(tmp_path, "gloo", 2), ray_jobs.saved(tmp_path, "sn", 2)
    assert_ran_on_sn_across_two_machines(sn)
    for rank in range(2):
        for name, value in gloo[rank]["state"].items():
            assert torch.equal(sn[rank]["state"][name], value), name
        placed = sn[rank]["placement"]
        assert (placed.local_rank, placed.local_world_size) == (0, 1) and placed.line  # each node says it once


@pytest.mark.timeout(240)
def test_two_workers_on_each_of_two_nodes_train_as_on_gloo_each_node_pinned(two_nodes, tmp_path):
    from ray.train.torch import TorchConfig

    from sn_trainer.integrations.ray import SNConfig

    ray_jobs.train("gloo", TorchConfig(backend="gloo"), tmp_path, workers=4, dtype="float64")
    ray_jobs.train("sn", SNConfig(), tmp_path, workers=4, dtype="float64")
    gloo, sn = ray_jobs.saved(tmp_path, "gloo", 4), ray_jobs.saved(tmp_path, "sn", 4)
    assert_ran_on_sn_across_two_machines(sn)
    for rank in range(4):
        for name, value in gloo[rank]["state"].items():
            torch.testing.assert_close(sn[rank]["state"][name], value, rtol=0, atol=1e-12)
    for host in {s["host"] for s in sn}:
        placed = [s["placement"] for s in sn if s["host"] == host]
        assert sorted(p.local_rank for p in placed) == [0, 1] and {p.local_world_size for p in placed} == {2}
        assert len({cpu for p in placed for cpu in p.cpus}) == 2  # cores of their own within the node
        assert [p.line is not None for p in sorted(placed, key=lambda p: p.local_rank)] == [True, False]
        assert host in next(p.line for p in placed if p.line)


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)


@pytest.fixture(scope="module")
def one_node_weights():
    """What one node with both nodes' workers trains (tests/ray_jobs.py's per_node, on one node, no Ray)."""
    from sn_trainer import Trainer

    torch.manual_seed(0)
    model = SmallConvNet()
    Trainer(workers=2, threads=1, batch_size=12, max_steps=5, seed=3, comm="shm").fit(model, tiny_dataset(),
                                                                                      optimizer=SGD)
    return model.state_dict()


def run_nodes(tmp_path: Path, **config) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from sn_trainer.integrations.ray import SNNodesConfig

    TorchTrainer(ray_jobs.per_node, train_loop_config={"out": str(tmp_path), "workers": 1,
                                                       "checkpoint_dir": str(tmp_path / "checkpoints"), **config},
                 torch_config=SNNodesConfig(),
                 scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD",
                                              resources_per_worker={"CPU": 2}),
                 run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="nodes",
                                      failure_config=FailureConfig(max_failures=1))).fit()
    return torch.load(tmp_path / "params.pt", weights_only=False)


def assert_like_one_node(found: dict, one_node: dict) -> None:
    for name, value in one_node.items():
        torch.testing.assert_close(found["state"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_the_trainer_on_one_ray_worker_per_node_trains_like_one_node_with_all_the_workers(two_nodes, tmp_path,
                                                                                           one_node_weights):
    found = run_nodes(tmp_path)
    assert (found["nodes"], found["restart_count"], found["first_step"]) == (2, 0, 1)
    assert_like_one_node(found, one_node_weights)


@pytest.mark.timeout(240)
def test_a_node_lost_mid_run_is_restarted_by_ray_and_resumes_from_the_last_checkpoint(two_nodes, tmp_path,
                                                                                       one_node_weights):
    found = run_nodes(tmp_path, lose_node=1)
    assert (tmp_path / "flag").exists()  # node 1 was lost after step 3, once
    assert (found["nodes"], found["restart_count"], found["first_step"]) == (2, 1, 4)  # resumed after step 3
    assert_like_one_node(found, one_node_weights)
