"""Near-storage devices a Pipeline runs on."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, Union

from . import defaults


@dataclass(frozen=True)
class CpuDevice:
    """The emulated computational storage device (the default).

    Its states live in ``path`` (ideally on its own NVMe disk); host threads run the same
    kernels a SmartSSD's FPGA would, over io_uring ``O_DIRECT`` storage. ``N`` devices on
    ``N`` disks model ``N`` CSDs.
    """

    path: str
    kind = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"CpuDevice path must be a str or os.PathLike, got {type(self.path).__name__}")
        object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))


Device = CpuDevice
DeviceLike = Union[CpuDevice, str, "os.PathLike[str]"]


def resolve(devices: DeviceLike | Sequence[DeviceLike]) -> list[CpuDevice]:
    """Turns the ``devices`` argument (a device, a path, or a list of them) into devices."""
    if isinstance(devices, (str, os.PathLike, CpuDevice)):
        devices = [devices]
    if not isinstance(devices, Sequence) or len(devices) == 0:
        raise ValueError("devices must be a non-empty list of devices or directory paths")
    resolved = []
    for d in devices:
        if isinstance(d, (str, os.PathLike)):
            kind = defaults.device()
            if kind != "cpu":
                raise ValueError(f"SMARTINF_DEVICE={kind!r}: only 'cpu' is available in this build")
            d = CpuDevice(d)
        if not isinstance(d, CpuDevice):
            raise TypeError(f"not a device: {d!r} (pass smartinf.CpuDevice(path) or a path)")
        resolved.append(d)
    paths = [d.path for d in resolved]
    if len(set(paths)) != len(paths):
        raise ValueError(f"two devices share a directory: {paths}")
    return resolved
