"""smartinf: near-storage optimizer updates for storage-offloaded LLM training.

The optimizer states (fp32 master weights, Adam moments) live on computational storage
devices and are updated next to the storage; only gradients go in and updated params
come out.
"""
from smartinf import _build_info
from smartinf._native import io_uring_built
from smartinf.pipeline.devices import CpuDevice, CudaDevice, XrtDevice
from smartinf.pipeline.pipeline import ParamsChangedWarning, Pipeline, UpdateFuture
from smartinf.pipeline.settings import PipelineSettings
from smartinf import update_rules as _update_rules
from smartinf.update_rules import *  # noqa: F401,F403 (the rules: update_rules.__all__)
from smartinf.integrations import deepspeed_hook

deepspeed_hook.install()  # a "smartinf" block in a DeepSpeed config takes effect

__version__ = "0.1.0"
__all__ = ["Pipeline", "ParamsChangedWarning", "PipelineSettings", "UpdateFuture", "CpuDevice", "CudaDevice",
           "XrtDevice", *_update_rules.__all__, "build_info", "__version__"]


def build_info() -> dict[str, bool]:
    """What the native core was built with: io_uring (liburing), XRT (SmartSSD) and CUDA
    (the GPU device)."""
    return {"io_uring": _build_info.IO_URING, "xrt": _build_info.XRT, "cuda": _build_info.CUDA}
