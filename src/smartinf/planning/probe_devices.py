"""The probe's devices beside the host: a CUDA GPU as an update device (its update rate
over states in its memory per state format, and PCIe's copy rates: ``measure_gpu``) and
SmartSSDs through XRT (``measure_smartssd``, ``smartssds``). ``probe.py`` measures the host
and its storage, and puts these in its report.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch

from smartinf import _native, build_info
from smartinf.planning import model
from smartinf.pipeline.pipeline import Pipeline
from smartinf.pipeline.settings import STATE_DTYPES
from smartinf.update_rules import AdamW

MiB = 1 << 20
GPU_NUMEL = 64 * MiB
HOST_COPY_BYTES = 256 * MiB


@dataclass(frozen=True)
class GpuRates:
    """A CUDA GPU as an update device: params per second its update runs over states
    resident in its memory (bf16 gradients and params in its memory, AdamW), per state
    format, best of ``repeats`` steps of ``numel`` params; pinned host <-> GPU copies
    (``host_to_gpu_bps``, ``gpu_to_host_bps``) of ``copy_bytes``."""

    name: str
    numel: int
    update_pps: dict
    host_to_gpu_bps: float
    gpu_to_host_bps: float
    copy_bytes: int
    repeats: int


def measure_gpu(numel: int = GPU_NUMEL, copy_bytes: int = HOST_COPY_BYTES,
                repeats: int = 3) -> Optional[GpuRates]:
    """The current CUDA GPU's update and PCIe rates (``GpuRates``), or None where smartinf
    has no CUDA or torch sees no GPU."""
    if not (build_info()["cuda"] and torch.cuda.is_available()):
        return None
    from smartinf.pipeline.devices import CudaDevice  # noqa: PLC0415

    def best(run) -> float:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    to_gpu = best(lambda: gpu.copy_(host, non_blocking=True))
    to_host = best(lambda: host.copy_(gpu, non_blocking=True))
    del host, gpu
    rates = {}
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16, device="cuda")
    params = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
    for state_dtype in STATE_DTYPES:  # every moments format
        budget = int(numel * model.state_bytes_per_param(state_dtype) * 1.05) + 64 * MiB
        with tempfile.TemporaryDirectory(prefix="smartinf-probe-gpu-") as d:
            pipe = Pipeline(CudaDevice(d, memory_budget=budget, twins=False), AdamW(),
                            state_dtype=state_dtype,
                            commit_every=1 << 20, if_exists="overwrite")
            try:
                pipe.add_subgroup(numel, None)

                def step() -> None:
                    with pipe.step():
                        pipe.update(0, grad, params).wait()
                rates[state_dtype] = numel / best(step)
            finally:
                pipe.close()
    return GpuRates(torch.cuda.get_device_name(), numel, rates, copy_bytes / to_gpu,
                    copy_bytes / to_host, copy_bytes, repeats)


def measure_smartssd(directory: str, fpga: "int | str" = 0, nbytes: int = 256 * MiB) -> dict:
    """One SmartSSD through XRT: SSD -> FPGA DRAM (P2P read), FPGA DRAM -> SSD (P2P
    write) over a file in ``directory`` on its drive, and host <-> FPGA DRAM syncs, in
    bytes per second. Under XRT emulation (XCL_EMULATION_MODE) the figures are host ones."""
    index, bdf = (fpga, "") if isinstance(fpga, int) else (0, fpga)
    t = _native.time_xrt_bandwidth(index, bdf, directory, nbytes)
    return {"fpga": fpga, "directory": directory, "nbytes": nbytes, "direct": t["direct"],
            "emulation": os.environ.get("XCL_EMULATION_MODE") or None,
            "p2p_read_bps": nbytes / t["p2p_read_s"], "p2p_write_bps": nbytes / t["p2p_write_s"],
            "host_to_fpga_bps": nbytes / t["to_fpga_s"], "fpga_to_host_bps": nbytes / t["from_fpga_s"]}


def smartssds() -> list:
    """Every SmartSSD found in sysfs whose drive is mounted, measured (XRT builds only)."""
    if not build_info()["xrt"] or not os.environ.get("XILINX_XRT"):
        return []
    from smartinf.pipeline.smartssd import discover  # noqa: PLC0415
    return [measure_smartssd(card.mounts[0], card.fpga) for card in discover() if card.mounts]
