"""Topology read from fabricated /sys trees, and the pinning plan made from it."""
import logging

import pytest

from sn_trainer.node.topology import auto_workers, parse_cpu_list, plan_pinning, read_topology

pytestmark = pytest.mark.unit  # the unit tier: starts no process


def make_sys(tmp_path, sockets, cores_per_socket, smt):
    """A sysfs tree like Linux's: logical CPUs numbered socket-major, SMT siblings in the top half."""
    root = tmp_path / "sys"
    cpu_dir = root / "devices" / "system" / "cpu"
    physical = sockets * cores_per_socket
    logical = physical * (2 if smt else 1)
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text(f"0-{logical - 1}\n")
    nodes = {s: [] for s in range(sockets)}
    for cpu in range(logical):
        core_index = cpu % physical
        socket, core_id = divmod(core_index, cores_per_socket)
        siblings = [core_index, core_index + physical] if smt else [core_index]
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{socket}\n")
        (topo / "core_id").write_text(f"{core_id}\n")
        (topo / "thread_siblings_list").write_text(",".join(map(str, siblings)) + "\n")
        nodes[socket].append(cpu)
    for socket, cpus in nodes.items():
        node = root / "devices" / "system" / "node" / f"node{socket}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
    return root


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


@pytest.mark.quick
def test_two_sockets_with_smt(tmp_path):
    topo = read_topology(make_sys(tmp_path, sockets=2, cores_per_socket=4, smt=True))
    assert (topo.physical_cores, topo.logical_cpus, topo.numa_nodes, topo.smt) == (8, 16, 2, True)
    assert topo.cores[0].cpus == (0, 8)  # a core and its hyper-thread sibling
    assert [c.numa_node for c in topo.cores] == [0] * 4 + [1] * 4
    assert auto_workers(topo, threads=1) == 8
    assert auto_workers(topo, threads=3) == 2
    # One logical CPU per physical core; a worker's cores stay on one socket when they can.
    assert plan_pinning(topo, workers=4, threads=2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # One worker per core: workers 0-3 on node 0's cores, 4-7 on node 1's; each first touches its
    # own gradient row (test_shared_memory.py), which the kernel then places on that worker's node.
    node_of = {cpu: core.numa_node for core in topo.cores for cpu in core.cpus}
    assert [node_of[cpus[0]] for cpus in plan_pinning(topo, workers=8, threads=1)] == [0] * 4 + [1] * 4


def test_two_sockets_without_smt(tmp_path):
    topo = read_topology(make_sys(tmp_path, sockets=2, cores_per_socket=2, smt=False))
    assert (topo.physical_cores, topo.logical_cpus, topo.numa_nodes, topo.smt) == (4, 4, 2, False)
    assert plan_pinning(topo, workers=4, threads=1) == [(0,), (1,), (2,), (3,)]


def test_affinity_mask_restricts_the_cores(tmp_path):
    # As under taskset or a container's cpuset: only the allowed CPUs count.
    topo = read_topology(make_sys(tmp_path, sockets=2, cores_per_socket=4, smt=True), allowed={4, 5, 12, 13})
    assert topo.physical_cores == 2 and topo.cores[0].cpus == (4, 12)
    assert auto_workers(topo, threads=1) == 2


def test_oversubscription_warns_and_shares_cores(tmp_path, caplog):
    topo = read_topology(make_sys(tmp_path, sockets=1, cores_per_socket=2, smt=False))
    with caplog.at_level(logging.WARNING):
        plan = plan_pinning(topo, workers=3, threads=1)
    assert plan == [(0,), (1,), (0,)]
    assert "exceeds the 2 physical cores" in caplog.text


def test_this_machine_has_at_least_one_core():
    topo = read_topology()
    assert topo.physical_cores >= 1


def test_empty_tree_is_an_error(tmp_path):
    (tmp_path / "devices" / "system" / "cpu").mkdir(parents=True)
    (tmp_path / "devices" / "system" / "cpu" / "online").write_text("\n")
    with pytest.raises(RuntimeError, match="no usable CPU"):
        read_topology(tmp_path)


def make_cgroup(root, proc, lines, files):
    """A fabricated /proc/self/cgroup (``lines``) and cgroup files under <root>/fs/cgroup."""
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("\n".join(lines) + "\n")
    for relative, text in files.items():
        path = root / "fs" / "cgroup" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def test_a_containers_cpu_quota_bounds_the_workers(tmp_path, caplog):
    """cgroup v2: 3.5 CPUs (cpu.max 350000 100000) on a 16-core view: 3 workers, each pinned."""
    root = make_sys(tmp_path, sockets=1, cores_per_socket=16, smt=False)
    make_cgroup(root, tmp_path / "proc", ["0::/kubepods/pod1/box"],
                {"kubepods/cpu.max": "max 100000", "kubepods/pod1/box/cpu.max": "350000 100000"})
    topo = read_topology(root, proc_root=tmp_path / "proc")
    assert (topo.physical_cores, topo.cpu_quota, topo.usable_cores) == (16, 3.5, 3)
    with caplog.at_level(logging.INFO):
        assert auto_workers(topo, threads=1) == 3
    assert "cgroup allows 3.50 CPUs of the 16 cores it sees" in caplog.text
    assert plan_pinning(topo, workers=3, threads=1) == [(0,), (1,), (2,)]


def test_cgroup_v1_quotas_and_cpusets_apply_the_tightest(tmp_path):
    root = make_sys(tmp_path, sockets=1, cores_per_socket=8, smt=False)
    make_cgroup(root, tmp_path / "proc", ["3:cpuset:/docker/abc", "2:cpu,cpuacct:/docker/abc", "1:memory:/docker"],
                {"cpu,cpuacct/docker/cpu.cfs_quota_us": "600000", "cpu,cpuacct/docker/cpu.cfs_period_us": "100000",
                 "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
                 "cpuset/docker/abc/cpuset.cpus": "2-6"})
    topo = read_topology(root, proc_root=tmp_path / "proc")
    assert [c.cpus[0] for c in topo.cores] == [2, 3, 4, 5, 6]  # the cpuset's CPUs only
    assert (topo.cpu_quota, topo.usable_cores) == (6.0, 5)  # the parent's 6 CPUs, more than the 5 cores left
    assert auto_workers(topo, threads=2) == 2


def test_no_cgroup_files_means_no_limit(tmp_path):
    topo = read_topology(make_sys(tmp_path, sockets=1, cores_per_socket=4, smt=False), proc_root=tmp_path / "none")
    assert (topo.cpu_quota, topo.usable_cores) == (None, 4)


@pytest.mark.parametrize("cpu_max", ["abc 100000", "350000", "350000 abc", "", "-5 100000", "350000 0", "1 2 3"])
def test_a_cpu_max_that_cannot_be_parsed_is_no_limit_said_in_one_warning(tmp_path, caplog, cpu_max):
    root = make_sys(tmp_path, sockets=1, cores_per_socket=4, smt=False)
    make_cgroup(root, tmp_path / "proc", ["garbled line", "0::/box"],
                {"box/cpu.max": cpu_max, "box/cpuset.cpus.effective": "0-x"})
    with caplog.at_level(logging.WARNING, logger="sn_trainer.node.topology"):
        topo = read_topology(root, proc_root=tmp_path / "proc")
    assert (topo.cpu_quota, topo.usable_cores, len(topo.cores)) == (None, 4, 4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"{root}/fs/cgroup/box/cpu.max holds {cpu_max!r}, not '<quota> <period>' or 'max <period>': "
                     "taken as no CPU limit",
                     f"{root}/fs/cgroup/box/cpuset.cpus.effective holds '0-x', not a list of CPUs such as 0-3,8: "
                     "taken as no cpuset"]


@pytest.mark.parametrize("workers, threads, quota, tuned, expected", [
    ("auto", "auto", None, None, (16, 1)),  # a worker per core: the SingleCaffe shape
    (1, "auto", None, None, (1, 16)),  # one worker has every core, as one plain PyTorch process does
    (4, "auto", None, None, (4, 4)),
    (3, "auto", 7.5, None, (3, 2)),  # the cores the container's quota allows, shared out
    (32, "auto", None, None, (32, 1)),
    ("auto", 4, None, None, (4, 4)),
    (2, 1, None, None, (2, 1)),  # both given: as given
    ("auto", "auto", None, {"workers": 8, "threads": 2}, (8, 2)),  # the tuned pair
    ("auto", 4, None, {"workers": 8, "threads": 2}, (4, 4)),  # threads given: the tuned pair does not apply
])
def test_workers_and_threads_fill_the_usable_cores(workers, threads, quota, tuned, expected):
    from sn_trainer.config import TrainerConfig
    from sn_trainer.node.topology import PhysicalCore, Topology
    from sn_trainer.fit.decide import workers_and_threads

    topology = Topology(tuple(PhysicalCore(0, core, 0, (core,)) for core in range(16)), cpu_quota=quota)
    got_workers, got_threads, decided = workers_and_threads(TrainerConfig(workers=workers, threads=threads),
                                                            topology, tuned)
    assert (got_workers, got_threads) == expected
    # Each auto comes with its reason, naming the setting; a setting given is no decision.
    autos = [name for name, value in (("workers", workers), ("threads", threads)) if value == "auto"]
    assert [(d.setting, d.value) for d in decided] == [(name, dict(zip(("workers", "threads"), expected))[name])
                                                       for name in autos]
    assert all(d.why.startswith(f"{d.setting}=auto: ") for d in decided)
