"""Validation of the host buffers handed to the native core (numpy arrays, CPU tensors).

Each check names the argument and says what to do, so a bad call fails before any data
moves.
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

import numpy as np
import torch

# Codes of the core's kernels::DType.
F32, F16, BF16 = 0, 1, 2
DTYPE_CODES = {
    torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16,
    np.dtype(np.float32): F32, np.dtype(np.float16): F16,
}
DTYPE_NAMES = {F32: "float32", F16: "float16", BF16: "bfloat16"}


class Buffer(NamedTuple):
    address: int
    dtype: int
    owner: Any  # keeps the memory alive while the core uses it


def dtype_code(dtype: Any) -> int:
    """The code of a torch dtype, numpy dtype or name ('float16', 'bf16', ...)."""
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}
    if isinstance(dtype, str):
        name = aliases.get(dtype, dtype)
        if name == "bfloat16":
            return BF16
        try:
            dtype = np.dtype(name)
        except TypeError:
            raise ValueError(f"unknown dtype {dtype!r}") from None
    elif not isinstance(dtype, torch.dtype):
        dtype = np.dtype(dtype)
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} is not supported: use float32, float16 or bfloat16")
    return DTYPE_CODES[dtype]


def host_buffer(name: str, x: Any, numel: int, dtypes: Iterable[int], *, writable: bool,
                gpu: Optional[int] = None) -> Buffer:
    """Checks that ``x`` is a contiguous CPU buffer of ``numel`` elements of an allowed dtype
    (or a tensor in the memory of CUDA device ``gpu``, whose update device reads and writes
    it there)."""
    allowed = sorted(set(dtypes))
    wanted = " or ".join(DTYPE_NAMES[c] for c in allowed)
    if isinstance(x, torch.Tensor):
        on_gpu = gpu is not None and x.device.type == "cuda" and x.device.index == gpu
        if x.device.type != "cpu" and not on_gpu:
            where = f"a CUDA tensor on cuda:{gpu}, or " if gpu is not None else ""
            raise ValueError(f"{name} is on {x.device}; pass {where}a CPU (ideally pinned) "
                             f"tensor: the device copies it over the host link itself")
        if x.dtype not in DTYPE_CODES or DTYPE_CODES[x.dtype] not in allowed:
            raise TypeError(f"{name} has dtype {x.dtype}, expected {wanted}")
        if not x.is_contiguous():
            raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
        if x.numel() != numel:
            raise ValueError(f"{name} has {x.numel()} elements, the sub-group has {numel}")
        if writable and x.requires_grad and x.is_leaf and torch.is_grad_enabled():
            x = x.detach()  # writing a parameter's storage in place is what the caller wants
        return Buffer(x.data_ptr(), DTYPE_CODES[x.dtype], x)
    if isinstance(x, np.ndarray):
        if x.dtype not in DTYPE_CODES or DTYPE_CODES[x.dtype] not in allowed:
            raise TypeError(f"{name} has dtype {x.dtype}, expected {wanted}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} is not contiguous; pass np.ascontiguousarray({name})")
        if not x.flags.aligned:
            raise ValueError(f"{name} is not aligned to its dtype")
        if x.size != numel:
            raise ValueError(f"{name} has {x.size} elements, the sub-group has {numel}")
        if writable and not x.flags.writeable:
            raise ValueError(f"{name} is read-only")
        return Buffer(x.ctypes.data, DTYPE_CODES[x.dtype], x)
    raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(x).__name__}")


def index_buffer(name: str, x: Any, nnz: int) -> Buffer:
    """Checks that ``x`` is a contiguous CPU int32 vector of ``nnz`` compressed positions."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on {x.device}; move it to the CPU (pinned) first")
        if x.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {x.dtype}, expected torch.int32")
        if not x.is_contiguous() or x.dim() != 1:
            raise ValueError(f"{name} must be a contiguous 1-D tensor")
        if x.numel() != nnz:
            raise ValueError(f"{name} has {x.numel()} elements, the values have {nnz}")
        return Buffer(x.data_ptr(), -1, x)
    if isinstance(x, np.ndarray):
        if x.dtype != np.int32:
            raise TypeError(f"{name} has dtype {x.dtype}, expected int32")
        if not x.flags.c_contiguous or x.ndim != 1:
            raise ValueError(f"{name} must be a contiguous 1-D array")
        if x.size != nnz:
            raise ValueError(f"{name} has {x.size} elements, the values have {nnz}")
        return Buffer(x.ctypes.data, -1, x)
    raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(x).__name__}")
