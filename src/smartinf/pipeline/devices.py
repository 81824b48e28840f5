"""Near-storage devices a Pipeline runs on."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from smartinf import _build_info, defaults
from smartinf.pipeline import smartssd


class NativeDeviceSpec(NamedTuple):
    """What the native core is told of one device (the binding reads it by name)."""

    kind: str            # a row of the core's device registry: cpu | xrt | cuda
    dir: str
    # the kind's own options, which its registry row names (bool, int or str values)
    options: Mapping[str, object] = MappingProxyType({})
    storage_bps: float = 0.0  # cpu: emulated storage bandwidth cap (0: the disk's)
    io_schedule: str = "mixed"  # mixed | phased (smartinf.planning.io_schedule chooses it)
    io_burst: int = 0  # phased: bytes per turn (0: the core's default, 256 MiB)
    twins: bool = False  # resident sub-groups placed with their twin (smartinf.planning.twins)


_BDF = re.compile(r"^([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def positive_gbps(value: object, what: str) -> float:
    """A bandwidth in GB/s: a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of GB/s, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}={value!r} must be a positive finite number of GB/s")
    return float(value)


def _abspath(path: object, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} path must be a str or os.PathLike, got {type(path).__name__}")
    return os.path.abspath(os.fspath(path))


@dataclass(frozen=True)
class CpuDevice:
    """The emulated computational storage device (the default).

    Its states live in ``path`` (ideally on its own NVMe disk); host threads run the same
    kernels a SmartSSD's FPGA would, over io_uring ``O_DIRECT`` storage. ``N`` devices on
    ``N`` disks model ``N`` CSDs.

    ``storage_gbps`` caps the device's storage traffic (reads and writes together, in
    GB/s = 1e9 bytes/s) to model a CSD's internal SSD, e.g. several emulated CSDs on one
    fast disk; ``None`` (the default) runs at the disk's speed. ``twins``: its share of the
    pipeline's ``memory_budget`` holds each resident sub-group with room for a second copy
    (``smartinf.planning.twins``; default False).
    """

    path: str
    storage_gbps: Optional[float] = None
    twins: bool = False
    kind = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _abspath(self.path, "CpuDevice"))
        if self.storage_gbps is not None:
            object.__setattr__(self, "storage_gbps", positive_gbps(self.storage_gbps, "storage_gbps"))
        _check_twins(self.twins, "CpuDevice", allow_none=False)

    def native_spec(self) -> NativeDeviceSpec:
        return NativeDeviceSpec("cpu", self.path, storage_bps=(self.storage_gbps or 0.0) * 1e9)


@dataclass(frozen=True)
class XrtDevice:
    """A Samsung SmartSSD through XRT: its FPGA (``fpga``: index or PCIe BDF such as
    ``"0000:3b:00.1"``) and ``path``, a directory on the NVMe of the same SmartSSD, which
    the FPGA reads peer to peer. ``xclbin`` is the build of ``hls_kernels/``; without it
    the device moves data but its kernel stage is unavailable (an update raises)."""

    path: str
    fpga: Union[int, str] = 0
    xclbin: Optional[str] = None
    kind = "xrt"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _abspath(self.path, "XrtDevice"))
        if isinstance(self.fpga, bool) or not isinstance(self.fpga, (int, str)):
            raise TypeError(f"fpga must be a device index or a PCIe BDF string, got {self.fpga!r}")
        if isinstance(self.fpga, int) and self.fpga < 0:
            raise ValueError(f"fpga index must be >= 0, got {self.fpga}")
        if isinstance(self.fpga, str) and not _BDF.match(self.fpga):
            raise ValueError(f"fpga={self.fpga!r} is not a PCIe BDF (like 0000:3b:00.1)")
        if self.xclbin is not None:
            object.__setattr__(self, "xclbin", _abspath(self.xclbin, "xclbin"))
            if not os.path.isfile(self.xclbin):
                raise FileNotFoundError(f"xclbin {self.xclbin} does not exist: build it with "
                                        f"`make -C hls_kernels` (Vitis) or pass its path")

    def native_spec(self) -> NativeDeviceSpec:
        if not _build_info.XRT:
            raise OSError("smartinf was built without XRT: install XRT (Debian: libxrt-dev, or "
                          "Xilinx's xrt package) and reinstall smartinf")
        if not os.environ.get("XILINX_XRT"):
            raise OSError("XILINX_XRT is not set: source /opt/xilinx/xrt/setup.sh (or set "
                          "XILINX_XRT to XRT's install prefix) before opening a SmartSSD")
        if isinstance(self.fpga, str):
            smartssd.check_pairing(self.path, self.fpga)
        return NativeDeviceSpec("xrt", self.path, {"fpga": self.fpga, "xclbin": self.xclbin or ""})

    @classmethod
    def discover(cls, subdir: str = "smartinf", xclbin: Optional[str] = None,
                 sysfs: str = "/sys", mounts_file: str = "/proc/mounts") -> list:
        """One ready device per SmartSSD whose drive is mounted: its FPGA paired with
        ``<mount point>/<subdir>`` on its own NVMe (see smartinf.pipeline.smartssd)."""
        return [cls(os.path.join(card.mounts[0], subdir), card.fpga, xclbin)
                for card in smartssd.discover(sysfs, mounts_file) if card.mounts]


@dataclass(frozen=True)
class CudaDevice:
    """A CUDA GPU as the update device, its states in ``path``; the same kernels run on GPU
    ``gpu`` (a CUDA ordinal), bit for bit the CPU's.

    ``memory_budget`` (bytes, or a string such as ``"8GiB"``; none by default) of GPU memory,
    allocated when the pipeline is created, keeps states resident there: sub-groups fill it
    before any are placed on other devices, are updated where they are, and are written to
    ``path`` at durable commits. The rest stream: the storage engine reads each chunk into
    page-locked host memory, it crosses PCIe to the GPU and its states come back. Gradients
    and params in this GPU's memory are read and written where they are (``Pipeline.update``
    takes CUDA tensors for its sub-groups); others cross PCIe. fp32, int8 and int4 moments,
    with an fp32 master or a split one (streamed, params in host memory); dense gradients.
    ``twins``: the budget holds each resident sub-group with room for a second copy, so a
    durable commit's write never holds its updates (True), or holds twice as many
    sub-groups (False); ``"host"``: a page-locked host copy of the budget (as large, allocated
    with it), into which a durable commit copies the resident states (about a second for
    25 GB) and from which it writes them, so no update waits for the disk and the budget
    keeps its whole capacity; None (the default): ``smartinf.planning.twins`` chooses, ``"host"``
    where the host's available memory holds it, else by the model.

    ``memory="host"``: the budget is page-locked host memory instead, for states the GPU
    updates: each update moves a resident chunk's states across PCIe to the GPU and back
    (its gradient and params stay where they are, in the GPU's memory for a model there),
    and the host loads and commits them as a ``CpuDevice``'s. Where the link moves states
    faster than the host's cores update them (int8/int4 moments: ~3-4 B a param each way)
    it is the faster home for the states the GPU has no room for. Twins only from what is
    left of its budget, unless ``twins=True``."""

    path: str
    gpu: Optional[int] = None  # None: torch's current CUDA device when the pipeline opens
    memory_budget: Union[int, str, None] = None
    twins: Union[bool, str, None] = None
    memory: str = "gpu"  # where the budget is: "gpu" (GPU memory) or "host" (page-locked)
    kind = "cuda"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _abspath(self.path, "CudaDevice"))
        if self.gpu is not None and (isinstance(self.gpu, bool) or not isinstance(self.gpu, int)
                                     or self.gpu < 0):
            raise ValueError(f"gpu must be a CUDA device ordinal (an int >= 0), got {self.gpu!r}")
        budget = 0 if self.memory_budget is None else \
            defaults.parse_bytes(self.memory_budget, "CudaDevice memory_budget")
        object.__setattr__(self, "memory_budget", budget)
        if self.twins != "host":
            _check_twins(self.twins, "CudaDevice", allow_none=True, host=True)
        if self.memory not in ("gpu", "host"):
            raise ValueError(f'CudaDevice memory must be "gpu" (its budget in GPU memory) or '
                             f'"host" (page-locked host memory the GPU updates over PCIe), '
                             f'got {self.memory!r}')
        if self.memory == "host" and self.twins == "host":
            raise ValueError('CudaDevice twins="host" is a host copy of a budget in GPU memory; '
                             'with memory="host" the states are written from where they are: '
                             'leave twins out, or pass True or False')
        if self.memory == "host" and self.twins is None:
            object.__setattr__(self, "twins", False)  # as a CpuDevice's budget

    def native_spec(self) -> NativeDeviceSpec:
        if not _build_info.CUDA:
            raise OSError("smartinf was built without CUDA: install a CUDA toolkit (nvcc on the "
                          "PATH, or CUDACXX) and reinstall smartinf")
        # host_twin: the pipeline's (smartinf.planning.twins chooses it)
        return NativeDeviceSpec("cuda", self.path, {"gpu": self.ordinal(), "memory_budget": self.memory_budget,
                                                    "memory": self.memory})

    def ordinal(self) -> int:
        """The CUDA ordinal: ``gpu``, or torch's current device (each rank's own under DDP)."""
        if self.gpu is not None:
            return self.gpu
        import torch  # the devices module stays importable without initialising CUDA
        return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _check_twins(twins: object, what: str, allow_none: bool, host: bool = False) -> None:
    if not isinstance(twins, bool) and not (allow_none and twins is None):
        raise TypeError(f"{what} twins must be True or False" + (', "host" (a host copy of the '
                        'budget)' if host else "") + (" or None (the model chooses)" if allow_none
                                                       else "") + f", got {twins!r}")


SMALL_DIRECTORY = "fp32-moments"


def small_directory(path: str) -> str:
    """Where a pipeline with int8/int4 states keeps small tensors' fp32 moments, beside the
    directory ``path`` of its first device (``Pipeline(small_sizes=)``)."""
    return os.path.join(path, SMALL_DIRECTORY)


def rank_directory(path: str, rank: int) -> str:
    """Where ``rank`` keeps its partition's states under a directory that several ranks
    share (``smartinf.optim`` and the DeepSpeed integration, its checkpoints too)."""
    return os.path.join(path, f"rank{rank:05d}")


GPU_DIRECTORY = "gpu"
GPU_HOST_DIRECTORY = "gpu-host"


def with_gpu(devices: Sequence[Union["Device", str]], memory_budget: Union[int, str, None],
             gpu: int, twins: Union[bool, str, None] = None, host_budget: Union[int, str] = 0) -> list:
    """``devices`` (paths or devices) with GPU ``gpu`` in front, holding ``memory_budget``
    of states in its memory (with ``twins``; None: no such device), its directory ``gpu/``
    in the first device's, and ``host_budget`` of states in host memory that it updates
    (``CudaDevice(memory="host")``, directory ``gpu-host/``): what ``smartinf.optim``'s
    ``gpu_memory_budget`` and the DeepSpeed block's ``"gpu"`` add."""
    first = devices[0] if isinstance(devices[0], (str, os.PathLike)) else devices[0].path
    first = os.fspath(first)
    gpus = [CudaDevice(os.path.join(first, GPU_DIRECTORY), gpu, memory_budget, twins)] \
        if memory_budget is not None else []
    if host_budget:
        gpus.append(CudaDevice(os.path.join(first, GPU_HOST_DIRECTORY), gpu, host_budget,
                               memory="host"))
    return [*gpus, *devices]


Device = Union[CpuDevice, XrtDevice, CudaDevice]
DEVICE_TYPES = (CpuDevice, XrtDevice, CudaDevice)
DeviceLike = Union[CpuDevice, XrtDevice, CudaDevice, str, "os.PathLike[str]"]


def resolve(devices: DeviceLike | Sequence[DeviceLike]) -> list[Device]:
    """Turns the ``devices`` argument (a device, a path, or a list of them) into devices."""
    if isinstance(devices, (str, os.PathLike, *DEVICE_TYPES)):
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
        if not isinstance(d, DEVICE_TYPES):
            raise TypeError(f"not a device: {d!r} (pass smartinf.CpuDevice(path), "
                            f"smartinf.XrtDevice(path, fpga), smartinf.CudaDevice(path, gpu) "
                            f"or a path)")
        resolved.append(d)
    paths = [d.path for d in resolved]
    if len(set(paths)) != len(paths):
        raise ValueError(f"two devices share a directory: {paths}")
    return resolved


def resolve_devices(devices: Any) -> list:
    """The ``devices`` argument, or ``SMARTINF_DEVICES`` (directories separated by
    ``os.pathsep``) when it is None; under ``torch.distributed`` each rank gets its own:
    ``{rank}`` in a path is replaced by the rank, a path without it gets ``rank<R>/``."""
    if devices is None:
        raw = os.environ.get("SMARTINF_DEVICES", "")
        devices = [d for d in raw.split(os.pathsep) if d]
        if not devices:
            raise ValueError("pass devices=[directories] (where the states live), or set "
                             "SMARTINF_DEVICES to directories separated by ':'")
    import torch  # (the optimizers' argument: torch is there)
    if isinstance(devices, (str, os.PathLike, *DEVICE_TYPES)):
        devices = [devices]
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    split = distributed and torch.distributed.get_world_size() > 1

    def for_rank(path: str) -> str:
        if "{rank}" in path:
            return path.replace("{rank}", str(rank))
        return rank_directory(path, rank) if split else path

    return [replace(d, path=for_rank(d.path)) if isinstance(d, DEVICE_TYPES)
            else for_rank(os.fspath(d)) if isinstance(d, (str, os.PathLike)) else d
            for d in devices]
