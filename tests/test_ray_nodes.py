"""Ray Train on the "sn" backend across two nodes: a ``ray.cluster_utils.Cluster`` of two nodes of 2 CPUs on
this machine, one cluster for the module. The second node's Ray (its raylet, and the workers it starts)
runs in a UTS namespace of its own under another host name, and at another loopback address, so that it
is another machine to the "sn" backend and another node to Ray (whose local ranks go by node address).

One worker per node: ``SNConfig`` trains to the bits of ``TorchConfig(backend="gloo")`` (both add two
numbers between the machines). Two workers per node: within 1e-12 in float64, as the two backends add
four ranks' gradients in different orders ("sn": each machine's pair in shared memory, then the machines
over gloo); each node's workers pinned to cores of their own, and each node says so once.
"""
from __future__ import annotations

import socket

import pytest
import torch

import ray_jobs

OTHER_HOST = "sn-ray-b"


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    import ray.cloudpickle
    from ray.cluster_utils import Cluster

    ray.cloudpickle.register_pickle_by_value(ray_jobs)  # the workers cannot import the tests' modules
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ray_jobs.QUICK.items():
            patch.setenv(name, value)  # read by the processes the cluster starts
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
