"""compress=powersgd between nodes: the factors' bookkeeping in one process, then two "nodes" as
two torchruns (in network namespaces joined by a veth pair, where the bytes on the wire count)."""
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import processes_with_marker, tiny_dataset
from test_multinode import free_port, tx_bytes, veth_pair  # noqa: F401 - veth_pair is a fixture used here
from sn_trainer import Trainer, TrainerConfig
from sn_trainer.engine.collectives.compression import PowerSGD, describe, shard_compression
from sn_trainer.recipe.flat_layout import FlatLayout
from sn_trainer.errors import ConfigError
from sn_trainer.fit.resolve import _say_compression

JOB = Path(__file__).with_name("compress_job.py")


class _Work:
    def wait(self):
        return True


class ThreadNodes:
    """The cross-node group of ``nodes`` threads, each a node: collectives by order, a barrier each."""

    def __init__(self, nodes: int):
        self.nodes, self.barrier, self.slots = nodes, threading.Barrier(nodes, timeout=30), [None] * nodes

    def member(self, node: int):
        group = self

        class Member:
            def allreduce(self, tensors):
                (tensor,) = tensors
                group.slots[node] = tensor.clone()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())
                group.barrier.wait()
                tensor.copy_(total)
                return _Work()

            def allgather(self, outputs, inputs):
                group.slots[node] = inputs[0].clone()
                group.barrier.wait()
                for out, value in zip(outputs[0], list(group.slots)):
                    out.copy_(value)
                group.barrier.wait()
                return _Work()

        return Member()


def in_threads(nodes: int, work) -> list:
    group, results = ThreadNodes(nodes), [None] * nodes

    def run(node):
        results[node] = work(node, group.member(node))

    threads = [threading.Thread(target=run, args=(node,)) for node in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(r is not None for r in results)
    return results


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 2)).double()


@pytest.mark.unit
@pytest.mark.quick
def test_the_nodes_errors_add_up_to_what_the_factors_left_out_and_every_node_gets_the_same_bits():
    layout = FlatLayout(mlp(), 1)
    plan = shard_compression(layout, 0, 2)
    assert [m.name for m in plan.matrices] == ["0.weight"] and plan.too_small == ("2.weight",)
    gradients = [torch.randn(layout.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
                 for n in range(3)]
    exact = sum(gradients)

    def node(n, group):
        compressor = PowerSGD(plan, 2, after=0, seed=5)
        summed = compressor.reduce(gradients[n].clone(), group)
        return summed, compressor.state.error_dict[0]

    results = in_threads(3, node)
    assert all(torch.equal(results[0][0], r[0]) for r in results)
    summed, m = results[0][0], plan.matrices[0]
    errors = sum(r[1] for r in results).reshape(-1)
    torch.testing.assert_close(summed[m.start : m.stop] + errors, exact[m.start : m.stop], rtol=1e-12, atol=1e-12)
    assert (summed[m.start : m.stop] - exact[m.start : m.stop]).abs().max() > 1e-3  # rank 2 of 30: it did compress
    torch.testing.assert_close(summed[m.stop :], exact[m.stop :], rtol=1e-12, atol=1e-12)  # the rest: exact


@pytest.mark.unit
def test_a_low_rank_gradient_comes_through_and_the_first_steps_are_exact():
    layout = FlatLayout(mlp(), 1)
    plan = shard_compression(layout, 0, 2)
    g = torch.Generator().manual_seed(0)
    one = torch.randn(30, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 40, generator=g, dtype=torch.float64)
    low_rank = [torch.cat([one.reshape(-1) * (n + 1), torch.randn(layout.numel - one.numel(), generator=g,
                                                                   dtype=torch.float64)]) for n in range(2)]

    def node(n, group):
        compressor = PowerSGD(plan, 2, after=1, seed=5)
        first = compressor.reduce(low_rank[n].clone(), group)  # step 1 of after=1: sent whole
        return first, compressor.reduce(low_rank[n].clone(), group)

    (first, second), _ = in_threads(2, node)
    assert torch.equal(first, low_rank[0] + low_rank[1])
    # Both gradients' matrices are multiples of one rank-1 matrix: rank 2 holds their sum.
    torch.testing.assert_close(second, low_rank[0] + low_rank[1], rtol=1e-9, atol=1e-9)


@pytest.mark.unit
def test_a_rank_too_large_for_every_matrix_sends_all_whole_and_says_so_once():
    layout = FlatLayout(mlp(), 2)
    for shard in range(2):
        assert shard_compression(layout, shard, 30).matrices == ()
    line = describe(layout, 30, 0)
    assert "0 matrices" in line and "approximate" in line
    assert line.count("0.weight") == 1 and line.count("2.weight") == 1 and "smaller side <= rank 30" in line
    gradients = [torch.randn(layout.shards[0].size, dtype=torch.float64) for _ in range(2)]
    results = in_threads(2, lambda n, group: PowerSGD(shard_compression(layout, 0, 30), 30, 0, 1).reduce(
        gradients[n].clone(), group))
    assert torch.equal(results[0], gradients[0] + gradients[1])


@pytest.mark.unit
@pytest.mark.parametrize("settings, message", [
    ({"compress": "zip"}, "compress must be one of none, powersgd, got 'zip'"),
    ({"compress_rank": 0}, "compress_rank must be >= 1, got 0"),
    ({"compress_after": -1}, "compress_after must be >= 0, got -1"),
])
def test_bad_compression_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as caught:
        TrainerConfig.from_keywords(settings)
    assert str(caught.value) == message


@pytest.mark.unit
def test_several_phases_are_refused_with_compression():
    settings = TrainerConfig(compress="powersgd")
    with pytest.raises(ConfigError, match="2 optimizers in turn .*use compress=none"):
        _say_compression(settings, [object(), object()], FlatLayout(mlp(), 1))


@pytest.mark.timeout(120)
def test_one_node_says_compression_is_between_nodes_only_and_runs_exact():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    result = Trainer(workers=1, batch_size=12, max_steps=2, compress="powersgd").fit(
        net, tiny_dataset(), optimizer=torch.optim.SGD)
    assert result.compression == "none" and result.settings.compress == "none"
    assert any("compress applies between nodes only" in note for note in result.plan["notes"])


# --- two nodes -----------------------------------------------------------------------------------

def two_nodes_in_namespaces(pair, out: Path, marker: str, *job_args) -> dict[str, int]:
    """Run compress_job.py as two nodes, one in each namespace; the bytes each end of the pair sent."""
    (_, _, host_a), port = pair["a"], 29500 + int(uuid.uuid4().hex[:3], 16)
    out.mkdir()
    before = {side: tx_bytes(ns, dev) for side, (ns, dev, _) in pair.items()}
    nodes = []
    for node_rank, (ns, device, _) in enumerate(pair.values()):
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={device}", sys.executable, "-m",
             "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node_rank}",
             f"--master-addr={host_a}", f"--master-port={port}", "--max-restarts=0", str(JOB),
             "--out", str(out), *job_args],
            env={**os.environ, "SN_TEST_MARKER": marker}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        _, stderr = node.communicate(timeout=200)
        assert node.returncode == 0, stderr[-3000:]
        (out / f"stderr{nodes.index(node)}.txt").write_text(stderr)
    return {side: tx_bytes(ns, dev) - before[side] for side, (ns, dev, _) in pair.items()}


def weights(out: Path, node: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"params{node}.pt", weights_only=True)


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(600)
def test_two_nodes_compressed_agree_bit_for_bit_send_less_and_are_exact_until_compress_after(tmp_path, veth_pair):  # noqa: F811
    marker = uuid.uuid4().hex
    sent = {name: two_nodes_in_namespaces(veth_pair, tmp_path / name, marker, *args) for name, args in (
        ("exact", ("--compress", "none")), ("late", ("--compress", "powersgd", "--after", "5")),
        ("compressed", ("--compress", "powersgd", "--after", "1")))}
    assert processes_with_marker(marker) == []
    for name in sent:  # every node applied the same updates
        assert same_bits(weights(tmp_path / name, 0), weights(tmp_path / name, 1)), name
    assert same_bits(weights(tmp_path / "late", 0), weights(tmp_path / "exact", 0))  # 5 steps, all sent whole
    differs = max((weights(tmp_path / "compressed", 0)[k] - weights(tmp_path / "exact", 0)[k]).abs().max().item()
                  for k in weights(tmp_path / "exact", 0))
    assert differs > 1e-6
    # 4 of its 5 steps sent rank-2 factors of the 256 x 64 layer: far fewer bytes on the wire.
    assert all(sent["compressed"][side] < 0.5 * sent["exact"][side] for side in ("a", "b")), sent
    summary = json.loads((tmp_path / "compressed" / "summary0.json").read_text())
    assert summary["compression"] == "powersgd rank 2 after 1 steps: approximate"
    assert json.loads((tmp_path / "exact" / "summary0.json").read_text())["compression"].endswith("(exact)")
    stderr = (tmp_path / "compressed" / "stderr0.txt").read_text()
    assert stderr.count("sent uncompressed, their smaller side <= rank 2") == 1 and "3.weight" in stderr


def two_nodes_on_loopback(out: Path, marker: str, *job_args) -> None:
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    out.mkdir(exist_ok=True)
    env = {**os.environ, "SN_TEST_MARKER": marker, "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                               "--max-restarts=0", "--monitor-interval=0.5", str(JOB), "--out", str(out), *job_args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for node in nodes:
        _, stderr = node.communicate(timeout=200)
        assert node.returncode == 0, stderr[-3000:]


@pytest.mark.timeout(600)
def test_a_compressed_run_resumed_from_its_checkpoint_goes_on_as_the_uninterrupted_one(tmp_path):
    marker, compressed = uuid.uuid4().hex, ("--compress", "powersgd", "--after", "1", "--workers", "2")
    two_nodes_on_loopback(tmp_path / "whole", marker, *compressed, "--steps", "6")
    ckpt = str(tmp_path / "ckpt")
    two_nodes_on_loopback(tmp_path / "first", marker, *compressed, "--steps", "3", "--checkpoint-dir", ckpt)
    saved = torch.load(Path(ckpt) / "step-000000003.pt", weights_only=True)
    assert len(saved["compress"]) == 2 and saved["compress"][0]["errors"].shape[0] == 2  # 2 shards, 2 nodes
    two_nodes_on_loopback(tmp_path / "rest", marker, *compressed, "--steps", "6", "--checkpoint-dir", ckpt,
                          "--resume", "latest")
    assert processes_with_marker(marker) == []
    for node in (0, 1):
        assert same_bits(weights(tmp_path / "rest", node), weights(tmp_path / "whole", node))
