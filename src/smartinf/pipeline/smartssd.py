"""Finding SmartSSDs: which FPGA and which NVMe drive form one card, from sysfs.

A Samsung SmartSSD puts its FPGA (Xilinx, PCI vendor 0x10ee) and its NVMe controller
behind one PCIe switch, so their sysfs paths share the switch's upstream port:
``.../<upstream port>/<downstream port>/<function>``. Peer-to-peer reads only work
between the FPGA and the drive of the same card; ``pair_of`` checks a directory against
that, ``discover`` lists the cards and where their drives are mounted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

XILINX = "0x10ee"
NVME_CLASS = "0x010802"


@dataclass(frozen=True)
class SmartSSD:
    fpga: str                 # PCIe BDF of the FPGA's user function (what XRT opens)
    nvme: str                 # controller name, e.g. nvme0
    block_devices: list = field(default_factory=list)  # /dev/nvme0n1 ...
    mounts: list = field(default_factory=list)         # mount points of those


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _switch(device_path: str) -> str:
    """The upstream port of the switch above a PCI function (two levels up)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(device_path)))


def _fpgas(sysfs: str) -> dict:
    """BDF -> switch of the Xilinx user functions (function 1; function 0 is management)."""
    root = os.path.join(sysfs, "bus", "pci", "devices")
    found = {}
    for bdf in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, bdf)
        if _read(os.path.join(path, "vendor")) == XILINX and bdf.endswith(".1"):
            found[bdf] = _switch(path)
    return found


def _mounts(mounts_file: str) -> list:
    lines = _read(mounts_file).splitlines()
    return [line.split()[:2] for line in lines if len(line.split()) >= 2]


def discover(sysfs: str = "/sys", mounts_file: str = "/proc/mounts") -> list:
    """The SmartSSDs of this machine: each FPGA paired with the NVMe controller behind
    the same switch, with its namespaces' block devices and their mount points."""
    fpgas = _fpgas(sysfs)
    mounts = _mounts(mounts_file)
    root = os.path.join(sysfs, "class", "nvme")
    cards = []
    for ctrl in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        switch = _switch(os.path.join(root, ctrl, "device"))
        fpga = next((b for b, s in fpgas.items() if s == switch), None)
        if fpga is None:
            continue
        namespaces = sorted(n for n in os.listdir(os.path.join(root, ctrl)) if n.startswith(ctrl + "n"))
        blocks = [f"/dev/{n}" for n in namespaces]
        points = [m for src, m in mounts if any(src == b or src.startswith(b + "p") for b in blocks)]
        cards.append(SmartSSD(fpga, ctrl, blocks, points))
    return cards


def card_of_directory(path: str, sysfs: str = "/sys") -> Optional[str]:
    """The switch (card) of the NVMe drive holding ``path``, or None when it is not on
    an NVMe drive behind a PCI device sysfs knows."""
    st = os.stat(path)
    block = os.path.realpath(os.path.join(sysfs, "dev", "block", f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
    # .../<nvme pci function>/nvme/nvme0/nvme0n1[/nvme0n1p1]
    parts = block.split(os.sep)
    if "nvme" not in parts:
        return None
    return _switch(os.sep.join(parts[:parts.index("nvme")]))


def check_pairing(path: str, fpga: str, sysfs: str = "/sys") -> None:
    """Raises when ``path`` is not on the NVMe drive of the SmartSSD whose FPGA is ``fpga``
    (only for cards sysfs knows; XRT reports unknown ones)."""
    fpga_path = os.path.join(sysfs, "bus", "pci", "devices", fpga)
    if not os.path.exists(fpga_path):
        return
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    card = card_of_directory(existing, sysfs)
    if card != _switch(fpga_path):
        mounts = [m for c in discover(sysfs) if c.fpga == fpga for m in c.mounts]
        where = mounts[0] if mounts else "that card's drive (mount it first)"
        raise ValueError(f"{path} is not on the NVMe drive of the SmartSSD with FPGA {fpga} "
                         f"(its FPGA reads states peer to peer from its own drive only); use a "
                         f"directory under {where}")
