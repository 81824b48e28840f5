"""The cores nearest a rank's GPU. Several ranks of one host each run their update on a
slice of its cores (``device/compute_pool.h``: ``SMARTINF_CORES``, else each rank's equal
slice in NUMA-node order, which is GPU r's node only where the host numbers its GPUs by
node). Where the GPUs' NUMA nodes are known (``/sys/bus/pci/devices/<GPU>/numa_node``), a
rank's slice is taken from its own GPU's node, shared with the other ranks whose GPUs are
there: its threads and the pages they touch stay next to the GPU that sends its gradients
and takes its params."""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8] (sysfs's cpulist)."""
    cores: list[int] = []
    for item in text.strip().split(","):
        if item:
            lo, _, hi = item.partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def format_cpu_list(cores: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def gpu_bus_ids() -> list[str]:
    """The PCI addresses (``0000:1a:00.0``) of the GPUs torch sees, in its numbering."""
    import torch
    ids = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        domain, bus, device = (getattr(p, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
        if bus is None or device is None:
            return []
        ids.append(f"{domain or 0:04x}:{bus:02x}:{device:02x}.0")
    return ids


def nearest_cores(local_rank: int, local_world: int, gpu_of_rank: Callable[[int], int],
                  bus_ids: Sequence[str], allowed: Sequence[int],
                  sys_root: str = "/sys") -> Optional[list[int]]:
    """Local rank ``local_rank``'s cores: an equal share of its GPU's NUMA node's cores (of
    ``allowed``) among the ranks whose GPUs are on that node (``gpu_of_rank``: a local rank's
    GPU, ``bus_ids``: each GPU's PCI address). None where that tells nothing new: one node,
    a GPU's node unknown, or this process bound narrower than the host by its launcher."""
    nodes = {}
    for gpu, bus_id in enumerate(bus_ids):
        node = _read(os.path.join(sys_root, "bus", "pci", "devices", bus_id, "numa_node"))
        nodes[gpu] = int(node) if node is not None and node.lstrip("-").isdigit() else -1
    ranks = [gpu_of_rank(r) for r in range(local_world)]
    if not nodes or any(nodes.get(g, -1) < 0 for g in ranks) or len(set(nodes.values())) < 2:
        return None
    node = nodes[ranks[local_rank]]
    cpus = {n: parse_cpu_list(_read(os.path.join(sys_root, "devices", "system", "node",
                                                 f"node{n}", "cpulist")) or "")
            for n in set(nodes.values())}
    if not cpus[node] or not {c for listed in cpus.values() for c in listed} <= set(allowed):
        return None
    mine = [c for c in cpus[node] if c in set(allowed)]
    sharing = [r for r in range(local_world) if nodes[ranks[r]] == node]
    share = max(1, len(mine) // len(sharing))
    at = sharing.index(local_rank) * share
    return mine[at:at + share] or None


def set_rank_cores(local_rank: int, local_world: int, gpu: int) -> Optional[str]:
    """Under a launcher with several local ranks, sets ``SMARTINF_CORES`` (unless given) to
    this rank's cores nearest its GPU (``gpu``; the others' taken as their local rank's, as
    launchers assign them) before its pipeline makes its threads; returns what it set."""
    if local_world <= 1 or os.environ.get("SMARTINF_CORES"):
        return None
    cores = nearest_cores(local_rank, local_world,
                          lambda r: gpu if r == local_rank else r, gpu_bus_ids(),
                          sorted(os.sched_getaffinity(0)))
    if cores is None:
        return None
    os.environ["SMARTINF_CORES"] = format_cpu_list(cores)
    return os.environ["SMARTINF_CORES"]
