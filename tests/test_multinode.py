"""Two "nodes" on this machine: two torchrun invocations meeting in a c10d rendezvous on 127.0.0.1."""
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from helpers import SmallConvNet, processes_with_marker, tiny_dataset
from multinode_job import SGD
from sn_trainer import Cluster, Trainer
from sn_trainer.node.cluster import ClusterError

pytestmark = pytest.mark.timeout(300)
JOB = Path(__file__).with_name("multinode_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tmp_path, marker, *job_args, max_restarts=0):
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "SN_TEST_MARKER": marker, "GLOO_SOCKET_IFNAME": "lo"}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                              f"--max-restarts={max_restarts}", "--monitor-interval=0.5", str(JOB),
                              "--out", str(tmp_path), *job_args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]


def assert_like_one_node(tmp_path, workers):
    two_nodes = torch.load(tmp_path / "params.pt", weights_only=True)
    torch.manual_seed(0)
    one_node = SmallConvNet()
    Trainer(workers=workers, batch_size=12, max_steps=5, seed=3, comm="shm").fit(one_node, tiny_dataset(), optimizer=SGD)
    for name, value in one_node.state_dict().items():
        torch.testing.assert_close(two_nodes[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("workers_per_node", [1, 2])
def test_two_nodes_train_like_one_node_with_all_their_workers(tmp_path, workers_per_node):
    marker = uuid.uuid4().hex
    nodes = start_nodes(tmp_path, marker, "--workers", str(workers_per_node))
    for node in nodes:
        _, stderr = node.communicate(timeout=240)
        assert node.returncode == 0, stderr[-3000:]
    assert processes_with_marker(marker) == []
    assert_like_one_node(tmp_path, 2 * workers_per_node)


def test_torchrun_restarts_both_nodes_from_the_last_checkpoint(tmp_path):
    marker = uuid.uuid4().hex
    nodes = start_nodes(tmp_path, marker, "--kill-on-node", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        max_restarts=1)
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert (tmp_path / "flag").exists()  # a worker did die, once
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    assert "resuming from" in "".join(err for _, err in outputs)
    assert processes_with_marker(marker) == []
    assert_like_one_node(tmp_path, 2)


def test_a_dead_worker_on_one_node_stops_both_nodes(tmp_path):
    marker = uuid.uuid4().hex
    started = time.monotonic()
    nodes = start_nodes(tmp_path, marker, "--steps", "100000", "--kill-on-node", "1")
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert (tmp_path / "flag").exists()  # the worker did die
    assert all(node.returncode != 0 for node in nodes), outputs
    everything = "".join(out + err for out, err in outputs)
    assert "killed by SIGKILL" in everything  # the node that lost its worker says which and how
    assert time.monotonic() - started < 120
    assert processes_with_marker(marker) == []


@pytest.mark.unit
@pytest.mark.quick
def test_torchrun_environment_is_read_and_checked():
    env = {"TORCHELASTIC_RUN_ID": "r1", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "3", "RANK": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "1",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "eth1"}
    cluster = Cluster.from_env(env)
    assert (cluster.node_rank, cluster.nodes, cluster.restart_count, cluster.interface) == (2, 3, 1, "eth1")
    assert not cluster.is_leader
    assert Cluster.from_env({}) is None
    alone = Cluster.from_env({**env, "WORLD_SIZE": "1", "RANK": "0"})  # a job shrunk to one node is still the job
    assert (alone.nodes, alone.run_id, alone.spans_nodes, alone.met()) == (1, "r1", False, alone)  # meets no one
    assert Cluster.from_env({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "RANK": "0"}) is None  # not torchrun's
    with pytest.raises(ClusterError, match="--nproc-per-node=1"):
        Cluster.from_env({**env, "LOCAL_WORLD_SIZE": "4"})


@pytest.fixture
def veth_pair():
    """Two network namespaces joined by a veth pair: two hosts on one machine, made here, removed after."""
    tag = uuid.uuid4().hex[:6]
    a, b, subnet = f"sn{tag}a", f"sn{tag}b", f"10.231.{int(tag[:2], 16)}"
    commands = [
        ["ip", "netns", "add", a], ["ip", "netns", "add", b],
        ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"],
        ["ip", "link", "set", f"v{tag}a", "netns", a], ["ip", "link", "set", f"v{tag}b", "netns", b],
    ]
    for ns, side, host in ((a, "a", 1), (b, "b", 2)):
        commands += [["ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{host}/24", "dev", f"v{tag}{side}"],
                     ["ip", "netns", "exec", ns, "ip", "link", "set", f"v{tag}{side}", "up"],
                     ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, timeout=30)
        yield {"a": (a, f"v{tag}a", f"{subnet}.1"), "b": (b, f"v{tag}b", f"{subnet}.2")}
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def tx_bytes(ns, device) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{device}/statistics/tx_bytes"],
                         check=True, capture_output=True, text=True, timeout=30)
    return int(out.stdout)


def test_two_nodes_talk_over_a_veth_pair(tmp_path, veth_pair):
    marker = uuid.uuid4().hex
    (_, _, host_a), port = veth_pair["a"], 29500 + int(marker[:3], 16)  # fresh namespaces: every port is free
    before = {side: tx_bytes(ns, dev) for side, (ns, dev, _) in veth_pair.items()}
    nodes = []
    # A static rendezvous at node a's veth address: under c10d, torchrun hands the workers the
    # rendezvous host's own host name as MASTER_ADDR, and both namespaces share this machine's.
    for node_rank, (_side, (ns, device, _)) in enumerate(veth_pair.items()):
        env = {**os.environ, "SN_TEST_MARKER": marker}
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={device}", sys.executable, "-m",
             "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node_rank}",
             f"--master-addr={host_a}", f"--master-port={port}", "--max-restarts=0", str(JOB),
             "--out", str(tmp_path), "--workers", "1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        _, stderr = node.communicate(timeout=240)
        assert node.returncode == 0, stderr[-3000:]
    assert processes_with_marker(marker) == []
    assert_like_one_node(tmp_path, 2)
    # 5 steps of SmallConvNet's gradients and more went through each end of the pair.
    sent = {side: tx_bytes(ns, dev) - before[side] for side, (ns, dev, _) in veth_pair.items()}
    assert all(v > 5 * 4 * sum(p.numel() for p in SmallConvNet().parameters()) for v in sent.values()), sent
