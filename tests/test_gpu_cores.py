"""The cores nearest each rank's GPU (smartinf.planning.gpu_cores), on a host described by a sysfs
tree of its own: two NUMA nodes, four GPUs numbered against the nodes' order."""
from __future__ import annotations

import os


from smartinf.planning import gpu_cores


def host(root, nodes: dict, gpus: dict) -> str:
    """``nodes``: node -> cpulist; ``gpus``: PCI address -> its node."""
    for node, cpus in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for bus_id, node in gpus.items():
        d = root / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return str(root)


BUS = ["0000:1a:00.0", "0000:3d:00.0", "0000:9a:00.0", "0000:bd:00.0"]


def test_each_rank_takes_a_share_of_its_gpus_node(tmp_path):
    # GPUs 0 and 1 on node 1 (cores 8-15), 2 and 3 on node 0 (cores 0-7)
    root = host(tmp_path, {0: "0-7", 1: "8-15"}, dict(zip(BUS, [1, 1, 0, 0])))
    cores = [gpu_cores.nearest_cores(r, 4, lambda r: r, BUS, range(16), root) for r in range(4)]
    assert cores == [[8, 9, 10, 11], [12, 13, 14, 15], [0, 1, 2, 3], [4, 5, 6, 7]]
    # the slice in NUMA-node order would have put rank 0 on node 0, away from its GPU
    # two ranks on one node, one on the other: each takes its node's share
    three = [gpu_cores.nearest_cores(r, 3, lambda r: r, BUS, range(16), root) for r in range(3)]
    assert three == [[8, 9, 10, 11], [12, 13, 14, 15], list(range(8))]


def test_nothing_new_is_said_where_it_is_not_known(tmp_path):
    one = host(tmp_path / "one", {0: "0-15"}, dict(zip(BUS, [0, 0, 0, 0])))
    assert gpu_cores.nearest_cores(0, 4, lambda r: r, BUS, range(16), one) is None
    unknown = host(tmp_path / "unknown", {0: "0-7", 1: "8-15"}, dict(zip(BUS, [1, 1, -1, 0])))
    assert gpu_cores.nearest_cores(0, 4, lambda r: r, BUS, range(16), unknown) is None
    two = host(tmp_path / "two", {0: "0-7", 1: "8-15"}, dict(zip(BUS, [1, 1, 0, 0])))
    # a launcher bound the rank already (--bind_cores_to_rank): its binding stands
    assert gpu_cores.nearest_cores(0, 4, lambda r: r, BUS, range(4), two) is None
    # a rank sees only its own GPU (CUDA_VISIBLE_DEVICES per rank): the others' are unknown
    assert gpu_cores.nearest_cores(1, 4, lambda r: 0 if r == 1 else r + 10, BUS[:1], range(16),
                                   two) is None


def test_cpu_lists_round_trip():
    assert gpu_cores.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert gpu_cores.format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_a_given_core_list_wins(monkeypatch):
    monkeypatch.setenv("SMARTINF_CORES", "0-1")
    assert gpu_cores.set_rank_cores(0, 4, 0) is None
    assert os.environ["SMARTINF_CORES"] == "0-1"
    monkeypatch.delenv("SMARTINF_CORES")
    assert gpu_cores.set_rank_cores(0, 1, 0) is None  # one rank: its cores are all of them
    assert "SMARTINF_CORES" not in os.environ
