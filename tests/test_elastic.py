"""Nodes that come and go under torchrun's own elastic agent (--nnodes=MIN:MAX, c10d rendezvous on 127.0.0.1)."""
import copy
import datetime
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from elastic_job import BATCH, REWARMUP, SEED, SGD
from helpers import SmallConvNet, processes_with_marker, tiny_dataset
from sn_trainer import Cluster, Trainer
from test_multinode import free_port
from test_multinode import veth_pair as veth_pair  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.timeout(420)
JOB = Path(__file__).with_name("elastic_job.py")
# Rendezvous timings short enough for a test: a dead node's heartbeat is missed within seconds,
# and a round with fewer than the most nodes closes a few seconds after the fewest have come.
RDZV_CONF = "join_timeout=120,last_call_timeout=6,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def start_node(port, run_id, marker, nnodes, *job_args, max_restarts=3):
    # torch 2.14's agents share one store server across rounds and tell a node joining a later
    # round no address for it; without sharing, every round's node 0 gets a fresh one (sn_trainer hosts it).
    env = {**os.environ, "SN_TEST_MARKER": marker, "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                             "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                             f"--rdzv-id={run_id}", f"--rdzv-conf={RDZV_CONF}", f"--max-restarts={max_restarts}",
                             "--monitor-interval=0.5", str(JOB), *job_args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a node's own session, as on a machine of its own


def collect(node, outputs):
    """Read a node's output as it comes (a full pipe would stall it)."""
    thread = threading.Thread(target=lambda: outputs.append(node.communicate()[0]), daemon=True)
    thread.start()
    return thread


def wait_for(path: Path, nodes, deadline_s: float) -> dict:
    """The JSON a node writes at ``path``, waited for while the nodes run (none may have exited)."""
    end = time.monotonic() + deadline_s
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never came"
        assert all(node.poll() is None for node in nodes), f"a node ended before {path.name}"
        time.sleep(0.1)
    return json.loads(path.read_text())  # renamed into place whole


def wait_for_port(port: int, node, deadline_s: float) -> None:
    """Until the first node's agent hosts the rendezvous: it, not a node killed later, holds it."""
    end = time.monotonic() + deadline_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < end and node.poll() is None, "the first node never hosted the rendezvous"
        time.sleep(0.1)


def kill_tree(pid: int) -> None:
    """SIGKILL a torchrun agent and everything it started, as a node that loses power: every process
    below it and every process of its session and of theirs (torchrun starts each worker in one)."""
    agent = psutil.Process(pid)
    below = [agent, *agent.children(recursive=True)]
    sessions = {session for session in map(_session, below) if session is not None}
    for proc in [*below, *(p for p in psutil.process_iter() if _session(p) in sessions)]:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _session(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except ProcessLookupError:
        return None


def end_all(nodes, readers) -> None:
    """Kill what a failed test left running, then take in every node's output."""
    for node in nodes:
        if node.poll() is None:
            kill_tree(node.pid)
    for reader in readers:
        reader.join(timeout=30)


def by_hand(membership, total_steps, tmp_path):
    """The same run resumed by hand on one node: at each membership change, a torchrun-free fit with
    the workers the nodes had in all, resumed from the previous fit's checkpoint, up to the next change."""
    folder = tmp_path / "by_hand"
    torch.manual_seed(0)
    model = SmallConvNet().double()
    ends = [entry["step"] for entry in membership[1:]] + [total_steps]
    for entry, end in zip(membership, ends):
        Trainer(workers=entry["workers"], batch_size=BATCH, max_steps=end, seed=SEED, comm="shm",
                checkpoint_dir=str(folder), checkpoint_every_steps=1, rewarmup_steps=REWARMUP,
                resume="latest" if entry["step"] else None).fit(model, tiny_dataset(dtype=torch.float64),
                                                                 optimizer=SGD)
    return model.state_dict()


def lose_one_then_join(tmp_path, nnodes: str, first: int, *job) -> tuple[list[str], list[int]]:
    """Start ``first`` nodes of an elastic job; when the victim says so, kill its whole torchrun;
    when a node of the smaller round says it holds, start one more. Every node's output (also in
    ``node<i>.log``) and the survivors' exit codes."""
    marker, port, run_id = uuid.uuid4().hex, free_port(), uuid.uuid4().hex[:8]
    nodes, outputs, readers, failed = [], [], [], None
    try:
        for index in range(first):
            nodes.append(start_node(port, run_id, marker, nnodes, *job))
            readers.append(collect(nodes[-1], outputs))
            if index == 0:
                wait_for_port(port, nodes[0], 240)
        victim = wait_for(tmp_path / "victim", nodes, 240)
        kill_tree(victim["agent"])
        wait_for(tmp_path / "held", [n for n in nodes if n.pid != victim["agent"]], 240)
        nodes.append(start_node(port, run_id, marker, nnodes, *job))  # a new node joins those left
        readers.append(collect(nodes[-1], outputs))
        for node in nodes:
            node.wait(timeout=240)
    except AssertionError as error:
        failed = error
    finally:
        end_all(nodes, readers)
    for index, out in enumerate(outputs):
        (tmp_path / f"node{index}.log").write_text(out)
    if failed is not None:  # what each node said, in the report: the nodes' logs go with tmp_path
        codes = [node.returncode for node in nodes]
        raise AssertionError(f"{failed} (exit codes {codes}; the end of each node's output follows)\n" + "\n".join(
            f"--- node {index} ---\n{out[-1500:]}" for index, out in enumerate(outputs))) from None
    assert processes_with_marker(marker) == []
    return outputs, [node.returncode for node in nodes if node.pid != victim["agent"]]


@pytest.mark.timeout(600)
def test_a_node_lost_and_one_joining_resume_as_by_hand_at_each_size(tmp_path):
    steps = 9
    outputs, survivors = lose_one_then_join(
        tmp_path, "2:3", 3, "--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", str(steps),
        "--victim-step", "3", "--hold-step", "5")
    assert survivors == [0, 0, 0], "\n".join(out[-3000:] for out in outputs)
    everything = "".join(outputs)
    assert re.search(r"node \d worker 0 failed", everything) and "resuming from" in everything
    membership = json.loads((tmp_path / "summary.json").read_text())["membership"]
    assert [(e["nodes"], e["workers"]) for e in membership][-3:] == [(3, 3), (2, 2), (3, 3)], membership
    assert membership[-2]["step"] >= 3 and membership[-1]["step"] >= 5, membership  # after each hold
    elastic = torch.load(tmp_path / "params.pt", weights_only=True)
    for name, value in by_hand(membership, steps, tmp_path).items():
        torch.testing.assert_close(elastic[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(600)
def test_a_job_shrunk_to_one_node_goes_on_from_its_checkpoint_and_grows_back_to_two(tmp_path):
    """torchrun --nnodes=1:2: the node left alone is restarted as a one-node job of the same
    rdzv id, resumes the checkpoints its job wrote in the folder, and goes on at two nodes when
    one joins."""
    steps = 9
    outputs, survivors = lose_one_then_join(
        tmp_path, "1:2", 2, "--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", str(steps),
        "--victim-step", "3", "--victim-nodes", "2", "--hold-step", "5", "--hold-nodes", "1")
    assert survivors == [0, 0], "\n".join(out[-3000:] for out in outputs)
    membership = json.loads((tmp_path / "summary.json").read_text())["membership"]
    assert [(e["nodes"], e["workers"]) for e in membership][-3:] == [(2, 2), (1, 1), (2, 2)], membership
    assert 3 <= membership[-2]["step"] < membership[-1]["step"], membership  # resumed, never from step 0
    assert membership[-1]["step"] >= 5, membership  # after the hold
    elastic = torch.load(tmp_path / "params.pt", weights_only=True)
    for name, value in by_hand(membership, steps, tmp_path).items():
        torch.testing.assert_close(elastic[name], value, rtol=1e-10, atol=1e-12)


def test_a_one_node_job_torchrun_restarts_goes_on_from_its_own_checkpoint(tmp_path):
    """torchrun --nnodes=1 --max-restarts=1 (no rdzv id: torchrun's default, none), its process
    killed after a step: the restart resumes the job's checkpoint (a resume at the same size is
    exact: test_run_owns.py) and trains to the end."""
    marker, steps = uuid.uuid4().hex, 4
    node = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--monitor-interval=0.5", str(JOB),
         "--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", str(steps), "--crash-step", "2"],
        env={**os.environ, "SN_TEST_MARKER": marker}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)
    (tmp_path / "node.log").write_text(node.stdout)
    assert node.returncode == 0, node.stdout[-4000:]
    assert processes_with_marker(marker) == []
    crashed = json.loads((tmp_path / "crash").read_text())["step"]
    resumed = [int(step) for step in re.findall(r"resuming from \S+ \(step (\d+)\)", node.stdout)]
    assert len(resumed) == 1 and 1 <= resumed[0] <= crashed, node.stdout[-4000:]  # not from 0, no step skipped
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "start-1-0").exists() and summary["steps"] == steps
    assert summary["membership"] == [{"step": 0, "nodes": 1, "workers": 1}]  # the same size: no change


def test_a_node_with_other_batch_settings_is_refused_at_rendezvous_naming_it(tmp_path):
    marker, port, run_id = uuid.uuid4().hex, free_port(), uuid.uuid4().hex[:8]
    job = ["--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "3"]
    nodes = [start_node(port, run_id, marker, "2:3", *job, max_restarts=0),
             start_node(port, run_id, marker, "2:3", *job, "--batch-size", "6", max_restarts=0)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    for out in outputs:  # each node names the other and the setting, with both values
        assert "differs from this node" in out and "in batch_size" in out, out[-3000:]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())  # no step trained
    assert processes_with_marker(marker) == []


def test_rewarmup_ramps_the_schedules_lr_after_a_resume_at_another_size_as_plain_pytorch(tmp_path):
    from helpers import assert_exact, cross_entropy, plain_batches

    data, folder = tiny_dataset(dtype=torch.float64), tmp_path / "ckpt"
    schedule = functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.8)  # multiplies as it goes
    torch.manual_seed(0)
    model = SmallConvNet().double()
    reference = copy.deepcopy(model)
    for workers, steps, resume in ((2, 3, None), (1, 7, "latest")):
        result = Trainer(workers=workers, batch_size=BATCH, max_steps=steps, seed=SEED, comm="shm", rewarmup_steps=3,
                         checkpoint_dir=str(folder), checkpoint_every_steps=1, resume=resume, log_every=1).fit(
            model, data, optimizer=SGD, loss_fn=torch.nn.functional.cross_entropy, scheduler=schedule)
    assert result.membership == [{"step": 0, "nodes": 1, "workers": 2}, {"step": 3, "nodes": 1, "workers": 1}]
    optimizer = SGD(reference.parameters())
    for step, batch in zip(range(7), plain_batches(data, BATCH, SEED)):
        ramp = min(1.0, (step + 1 - 3) / 3) if step >= 3 else 1.0  # steps 4, 5, 6 at 1/3, 2/3, 1
        optimizer.param_groups[0]["lr"] = 0.05 * 0.8 ** step * ramp
        optimizer.zero_grad()
        cross_entropy(reference, batch).backward()
        optimizer.step()
    assert_exact(model, reference)


@pytest.mark.unit
def test_nodes_meet_on_a_fresh_token_past_one_a_dead_node_0_left():
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    server.set(f"sn_trainer/{run_id}/meeting/token", "stale")  # a node 0 killed mid-meeting left it
    met = {}

    def meet(rank):
        cluster = Cluster(node_rank=rank, nodes=3, master_addr="127.0.0.1", master_port=port, run_id=run_id)
        met[rank] = cluster.met(timeout_s=30, retry_s=0.2)

    followers = [threading.Thread(target=meet, args=(rank,)) for rank in (1, 2)]
    for thread in followers:
        thread.start()
    meet(0)
    for thread in followers:
        thread.join(timeout=60)
    tokens = {cluster.meeting for cluster in met.values()}
    assert len(met) == 3 and len(tokens) == 1 and tokens != {"stale"}, met
    met[0].store("x").set("k", "v")
    assert met[2].store("x").get("k") == b"v"  # the same keys for all of this meeting
    again = Cluster(node_rank=0, nodes=1, master_addr="127.0.0.1", master_port=port, run_id=run_id).met(timeout_s=30)
    assert again.meeting != met[0].meeting  # and none of another's


@pytest.mark.unit
def test_nodes_with_another_compression_are_refused_naming_it():
    from sn_trainer.errors import ConfigError
    from sn_trainer.fit.agreement import AGREED_SETTINGS, agree_with_other_nodes, node_facts

    port, run_id = free_port(), uuid.uuid4().hex[:8]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    settings = [{name: 0 for name in AGREED_SETTINGS}, {name: 0 for name in AGREED_SETTINGS}]
    settings[0].update(compress="none", compress_rank=2)
    settings[1].update(compress="powersgd", compress_rank=2)
    errors = {}

    def agree(rank):
        cluster = Cluster(node_rank=rank, nodes=2, master_addr="127.0.0.1", master_port=port, run_id=run_id)
        facts = node_facts(SmallConvNet(), 1, 5, {"batch_size": BATCH}, settings[rank], None)
        try:
            agree_with_other_nodes(cluster, facts)
        except ConfigError as error:
            errors[rank] = str(error)

    other = threading.Thread(target=agree, args=(1,))
    other.start()
    agree(0)
    other.join(timeout=60)
    assert set(errors) == {0, 1}, errors
    assert "in compress: 'powersgd' there, 'none' here" in errors[0], errors
    del server


def test_the_slurm_script_runs_an_elastic_job_between_min_and_all_nodes(tmp_path):
    """examples/slurm_torchrun.sbatch with SN_MIN_NODES, under Slurm's variables and a stand-in
    srun that notes its arguments and the store setting torchrun's agents get."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for name, body in (("srun", 'echo "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE srun $*" >> "$SLURM_FAKE_LOG"'),
                       ("scontrol", "echo node07; echo node08; echo node09")):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_FAKE_LOG": str(log),
           "SLURM_JOB_NODELIST": "node[07-09]", "SLURM_NNODES": "3", "SLURM_JOB_ID": "4242", "SN_MIN_NODES": "2"}
    script = Path(__file__).parents[1] / "examples" / "slurm_torchrun.sbatch"
    done = subprocess.run(["bash", str(script), "workers=16"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().split() == [
        "1", "srun", "--kill-on-bad-exit=0", "python", "-m", "torch.distributed.run", "--nnodes=2:3",
        "--max-restarts=3", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node07:29500",
        "--rdzv-id=4242", "-m", "sn_trainer", "workers=16"]


@pytest.mark.unit
@pytest.mark.quick
def test_a_node_restarted_for_a_membership_change_resumes_only_its_own_jobs_checkpoint(tmp_path):
    """A join restarts every node without counting a restart (a new node starts at 0): the
    checkpoint's torchrun job says whether it is this run's; torchrun's default id names no job
    but to a restart. One node alone (an elastic job shrunk to it, a one-node job restarted) too."""
    from sn_trainer import CheckpointError, TrainerConfig, checkpoint
    from sn_trainer.checkpoint.resume import locate
    from sn_trainer.config import CheckpointConfig

    def folder_of(job, steps):
        folder = tmp_path / str(job)
        for step in steps:
            checkpoint.CheckpointDir(folder).save(checkpoint.build(step, {"w": torch.zeros(1)}, None, [],
                                                                   {} if job is None else {"torchrun_run_id": job},
                                                                   None))
        return folder

    def located(folder, run_id, nodes=2, node_rank=1, restart_count=0):
        env = {"TORCHELASTIC_RUN_ID": run_id, "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": str(nodes),
               "RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
               "TORCHELASTIC_RESTART_COUNT": str(restart_count)}
        return locate(TrainerConfig(checkpoint=CheckpointConfig(dir=str(folder))), Cluster.from_env(env))[1]

    job1, unnamed, plain = folder_of("job1", [2, 4]), folder_of("none", [2]), folder_of(None, [2])
    assert located(job1, "job1") == job1 and located(job1, "job1", nodes=1, node_rank=0) == job1
    assert located(job1, "job2") is None and located(job1, "none") is None
    assert located(job1, "job2", restart_count=1) is None  # a restart too: only its own job's
    assert located(unnamed, "none", nodes=1, node_rank=0, restart_count=1) == unnamed  # torchrun --nnodes=1 restarted
    newest = job1 / "step-000000004.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn: resume passes over it, and so does this
    assert located(job1, "job1", nodes=1, node_rank=0, restart_count=2) == job1
    for folder, run_id, restarts in ((job1, "job2", 1), (unnamed, "none", 0), (plain, "none", 1)):
        with pytest.raises(CheckpointError, match="already holds checkpoints"):
            located(folder, run_id, nodes=1, node_rank=0, restart_count=restarts)  # the leader refuses another's


@pytest.mark.unit
def test_one_node_resumes_random_streams_only_from_a_checkpoint_one_node_wrote():
    from sn_trainer.checkpoint.resume import streams_resume

    def saved(nodes):
        return {"rng": [{}], "run": {"membership": [{"step": 0, "nodes": 2, "workers": 2},
                                                    {"step": 3, "nodes": nodes, "workers": nodes}]}}

    assert streams_resume(saved(1), 1, one_node=True) and streams_resume({"rng": [{}]}, 1, one_node=True)
    assert not streams_resume(saved(2), 1, one_node=True)  # node 0's alone: shrunk to one node, start afresh
    assert not streams_resume(saved(1), 2, one_node=True) and not streams_resume(saved(1), 1, one_node=False)


def wait_for_files(paths, nodes, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not all(path.exists() for path in paths):
        assert time.monotonic() < end and all(n.poll() is None for n in nodes), f"never came: {paths}"
        time.sleep(0.1)


def test_a_link_taken_down_mid_step_ends_it_within_worker_timeout_and_the_restart_picks_up(tmp_path, veth_pair):
    """Two nodes in network namespaces; node a's end of their link is set down while node 1 holds
    after a step: no peer resets a connection, the next step ends by worker_timeout on both nodes,
    each named; with the link up again, torchrun's restart resumes and finishes the run."""
    marker, timeout_s, steps = uuid.uuid4().hex, 8, 8
    (ns_a, dev_a, host_a), port = veth_pair["a"], 29500 + int(marker[:3], 16)
    nodes = []
    for node_rank, (ns, device, _) in enumerate(veth_pair.values()):
        env = {**os.environ, "SN_TEST_MARKER": marker}
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={device}", sys.executable, "-m",
             "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node_rank}",
             f"--master-addr={host_a}", f"--master-port={port}", "--max-restarts=1", "--monitor-interval=0.5",
             str(JOB), "--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", str(steps),
             "--worker-timeout", str(timeout_s), "--link-step", "3"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    readers = [collect(node, outputs) for node in nodes]
    try:
        wait_for_files([tmp_path / "link"], nodes, 240)
        subprocess.run(["ip", "netns", "exec", ns_a, "ip", "link", "set", dev_a, "down"], check=True, timeout=30)
        dropped = time.monotonic()
        (tmp_path / "link_down").touch()
        wait_for_files([tmp_path / "start-1-0"], nodes, 240)  # node a failed and was restarted
        took = time.monotonic() - dropped
        subprocess.run(["ip", "netns", "exec", ns_a, "ip", "link", "set", dev_a, "up"], check=True, timeout=30)
        for node in nodes:
            node.wait(timeout=240)
    finally:
        end_all(nodes, readers)
    (tmp_path / "nodes.log").write_text("\n".join(outputs))
    everything = "".join(outputs)
    assert [node.returncode for node in nodes] == [0, 0], everything[-4000:]
    assert took < timeout_s + 90, took  # the step ended by the timeout, and the teardown is bounded
    for rank in (0, 1):
        assert re.search(rf"node {rank} worker 0 failed: made no progress for \d+ s \(worker_timeout={timeout_s}\), "
                         r"in step \d+, stage reduce", everything), everything[-4000:]
    assert "resuming from" in everything
    assert processes_with_marker(marker) == []
    torch.manual_seed(0)
    one_node = SmallConvNet().double()
    Trainer(workers=2, batch_size=BATCH, max_steps=steps, seed=SEED, comm="shm").fit(
        one_node, tiny_dataset(dtype=torch.float64), optimizer=SGD)
    two_nodes = torch.load(tmp_path / "params.pt", weights_only=True)
    for name, value in one_node.state_dict().items():
        torch.testing.assert_close(two_nodes[name], value, rtol=1e-10, atol=1e-12)
