"""Defaults of the pipeline, overridable from the environment (like KvikIO's ``KVIKIO_*``).

Explicit arguments always win over these.

- ``SMARTINF_DEVICE``: device kind used for plain directory paths (``cpu``).
- ``SMARTINF_SLOTS``: ring slots per device (4).
- ``SMARTINF_CHUNK``: parameters per chunk, i.e. per slot (1 Mi).
- ``SMARTINF_IO``: storage engine, ``auto`` (io_uring, else threads), ``uring`` or ``threads``.
- ``SMARTINF_QUEUE_DEPTH``: storage requests in flight per engine (16).
- ``SMARTINF_HOST_LINK_GBPS``: cap on the host link all devices share, GB/s in each
  direction (none): models a PCIe switch or root port with emulated devices.
"""
from __future__ import annotations

import math
import os
from typing import Optional

DEVICE = "cpu"
SLOTS = 4
CHUNK = 1 << 20
IO = "auto"
QUEUE_DEPTH = 16
PIECE_BYTES = 1 << 20  # storage requests are split into pieces of this size
IO_ENGINES = ("auto", "uring", "threads")


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw, 0)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def device() -> str:
    return os.environ.get("SMARTINF_DEVICE") or DEVICE


def slots() -> int:
    return _int_env("SMARTINF_SLOTS", SLOTS)


def chunk() -> int:
    return _int_env("SMARTINF_CHUNK", CHUNK)


def queue_depth() -> int:
    return _int_env("SMARTINF_QUEUE_DEPTH", QUEUE_DEPTH)


def io() -> str:
    value = os.environ.get("SMARTINF_IO") or IO
    if value not in IO_ENGINES:
        raise ValueError(f"SMARTINF_IO={value!r}: expected one of {', '.join(IO_ENGINES)}")
    return value


def host_link_gbps() -> Optional[float]:
    raw = os.environ.get("SMARTINF_HOST_LINK_GBPS")
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"SMARTINF_HOST_LINK_GBPS={raw!r} is not a number of GB/s") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"SMARTINF_HOST_LINK_GBPS={raw!r} must be a positive number of GB/s")
    return value
