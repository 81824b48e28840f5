"""Defaults of the pipeline, overridable from the environment (like KvikIO's ``KVIKIO_*``).

Explicit arguments always win over these.

- ``SMARTINF_DEVICE``: device kind used for plain directory paths (``cpu``).
- ``SMARTINF_SLOTS``: ring slots per device (4).
- ``SMARTINF_CHUNK``: parameters per chunk, i.e. per slot (1 Mi).
- ``SMARTINF_IO``: storage engine, ``auto`` (io_uring, else threads), ``uring`` or ``threads``.
- ``SMARTINF_QUEUE_DEPTH``: storage requests in flight per engine (16).
"""
from __future__ import annotations

import os

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
