"""Defaults of the pipeline, overridable from the environment (like KvikIO's ``KVIKIO_*``).

Explicit arguments always win over these.

- ``SMARTINF_DEVICE``: device kind used for plain directory paths (``cpu``).
- ``SMARTINF_SLOTS``: ring slots per device (unset: 4, more where a device's storage runs
  phased: enough to hold a turn of its burst, at most 64; see ``pipeline.cc``'s ``auto_slots``).
- ``SMARTINF_CHUNK``: parameters per chunk, i.e. per slot (1 Mi; 16 Mi with a GPU device).
- ``SMARTINF_IO``: storage engine, ``auto`` (io_uring, else threads), ``uring`` or ``threads``.
- ``SMARTINF_QUEUE_DEPTH``: storage requests in flight per engine (32).
- ``SMARTINF_HOST_LINK_GBPS``: cap on the host link all devices share, GB/s in each
  direction (none): models a PCIe switch or root port with emulated devices.
- ``SMARTINF_MEMORY_BUDGET``: bytes of states per device kept resident in memory (0), as
  a number or with a unit (``24GiB``, ``512MB``).
- ``SMARTINF_COMMIT_EVERY``: steps per durable commit (1: every step).
- ``SMARTINF_COMPUTE_THREADS``: threads of the update kernel (0: the usable cores).
- ``SMARTINF_IO_SCHEDULE``: ``auto`` (from the probe's mix curve recorded in a device's
  directory, else ``mixed``), ``mixed`` (reads and write-backs together) or ``phased``.
- ``SMARTINF_IO_TURNS``: ``host`` (the default: phased rings on one drive take its turns
  across the host's processes, e.g. a machine's ranks; ``pipeline/host_turns.h``) or
  ``process`` (each process's rings alone). Read by the native library when a ring starts.
- ``SMARTINF_OVERLAP``: the optimizer's work behind the caller's (1, on; 0 off).
- ``SMARTINF_SPECULATE_RESIDENT``: under DeepSpeed with overlap, resident sub-groups' updates
  start during backward too, on their twins (off).
- ``SMARTINF_SPECULATE_ON_CPU``: with overlap, updates start during a backward that runs on
  the CPU too (0, off: it holds the cores the update needs).
- ``SMARTINF_GPU_MEMORY``: the GPU's memory a budget of ``"auto"`` takes its margin as a
  share of (unset: the device's whole memory), for a smaller GPU emulated on a larger one
  (the examples' ``--gpu-memory`` sets it).
"""
from __future__ import annotations

import math
import os
from typing import Optional

DEVICE = "cpu"
CHUNK = 1 << 20
# A pipeline with a GPU: each chunk the GPU updates costs a few launches and waits besides
# its work (the H100 host, 6.6 B params int8 + split resident in its memory: a step's updates
# 2.05 s in chunks of 1 Mi, 0.23 s in chunks of 16 Mi).
GPU_CHUNK = 1 << 24
# A GPU budget of "auto" (the DeepSpeed block) sized before the first iteration (a
# "reserve" given, or the first step not yet run) leaves this share of the GPU's memory to
# the activations and what else the training allocates besides params and gradients (13 B,
# 8 x 1024, activation checkpointing on the H100: 6.7 GiB allocated at the peak, 1.8 GiB
# more reserved by torch's allocator; a 22 GB budget ran out of memory without
# expandable segments, 15 % leaves 11.9 GiB). Too little for 30 B on four H100s (about 1 GB
# short) and for GPT-2 XL without activation checkpointing: hence the measured budget.
GPU_RESERVE_SHARE = 0.15
# A GPU budget of "auto" measured by the first step (what the first iteration took at its
# peak) leaves this share of the GPU's memory besides: the CUDA devices' slots (a few
# chunks of 16 Mi params each), what DeepSpeed's prefetch gathers from the second
# iteration on, and the allocator's fragmentation.
GPU_MARGIN_SHARE = 0.1
#: A GPU budget's host twin (``CudaDevice(twins="host")``) is chosen where the host's available
#: memory holds it for every rank of the machine, beside their other host budgets, with this
#: share of the machine's memory still left (the model's host copies, DeepSpeed's buffers).
HOST_TWIN_SPARE_SHARE = 0.1
IO = "auto"
# Two fp32 chunks' requests (12 MiB each) in flight per engine: with 16 the ring drew 0.47x
# (this project's VM) and 0.88x (the H200 host) of what it drew with 32 (bench/storage_ring.py).
QUEUE_DEPTH = 32
PIECE_BYTES = 1 << 20  # storage requests are split into pieces of this size
IO_ENGINES = ("auto", "uring", "threads")
IO_SCHEDULE = "auto"
IO_SCHEDULES = ("auto", "mixed", "phased")
MEMORY_BUDGET = 0
COMMIT_EVERY = 1
COMPUTE_THREADS = 0
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value, what: str) -> int:
    """A byte count: an int, or a string with an optional unit ("24GiB", "1.5 GB")."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes, got a bool")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip().replace(" ", "")
        digits = text.rstrip("BbKkMmGgTtIi")
        unit = text[len(digits):].upper()
        try:
            number = float(digits) * _UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(f"{what}={value!r}: expected bytes, e.g. 25769803776, '24GiB' or "
                             f"'512MB'") from None
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{what}={value!r} is not a whole number of bytes")
        number = int(number)
    if number < 0:
        raise ValueError(f"{what}={value!r} must not be negative")
    return number


#: where launchers give the number of a host's ranks, in this order: torchrun's, the
#: deepspeed launcher's, Open MPI's (``device/compute_pool.cc`` reads the same)
LOCAL_RANKS_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def local_ranks(default: int = 1) -> int:
    """The ranks of this host, as its launcher says (``LOCAL_RANKS_VARIABLES``); ``default``
    where none does. They share its memory, cores and disk."""
    for name in LOCAL_RANKS_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


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


def slots() -> Optional[int]:
    """None: the core sizes the ring (``auto_slots``)."""
    return None if not os.environ.get("SMARTINF_SLOTS") else _int_env("SMARTINF_SLOTS", 0)


def chunk() -> Optional[int]:
    """None: the pipeline's default (``CHUNK``; ``GPU_CHUNK`` with a CUDA device; a
    directory's own when it holds a run)."""
    return None if not os.environ.get("SMARTINF_CHUNK") else _int_env("SMARTINF_CHUNK", 0)


def queue_depth() -> int:
    return _int_env("SMARTINF_QUEUE_DEPTH", QUEUE_DEPTH)


def io() -> str:
    value = os.environ.get("SMARTINF_IO") or IO
    if value not in IO_ENGINES:
        raise ValueError(f"SMARTINF_IO={value!r}: expected one of {', '.join(IO_ENGINES)}")
    return value


def memory_budget() -> int:
    raw = os.environ.get("SMARTINF_MEMORY_BUDGET")
    return MEMORY_BUDGET if not raw else parse_bytes(raw, "SMARTINF_MEMORY_BUDGET")


def commit_every() -> int:
    return _int_env("SMARTINF_COMMIT_EVERY", COMMIT_EVERY)


def placement_given() -> dict:
    """The placement settings the environment gives (``SMARTINF_MEMORY_BUDGET``,
    ``SMARTINF_COMMIT_EVERY``, ``SMARTINF_OVERLAP``): explicit, as keywords are, so the
    planner keeps them instead of choosing (``smartinf.planning.plan``)."""
    given = {}
    if os.environ.get("SMARTINF_MEMORY_BUDGET"):
        given["memory_budget"] = memory_budget()
    if os.environ.get("SMARTINF_COMMIT_EVERY"):
        given["commit_every"] = commit_every()
    if os.environ.get("SMARTINF_OVERLAP"):
        given["overlap"] = overlap()
    return given


def io_schedule() -> str:
    value = os.environ.get("SMARTINF_IO_SCHEDULE") or IO_SCHEDULE
    if value not in IO_SCHEDULES:
        raise ValueError(f"SMARTINF_IO_SCHEDULE={value!r}: expected one of {', '.join(IO_SCHEDULES)}")
    return value


def compute_threads() -> int:
    return _int_env("SMARTINF_COMPUTE_THREADS", COMPUTE_THREADS)


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


def _flag_env(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 1 (on{', the default' if default else ''}) "
                         f"or 0 (off{'' if default else ', the default'})")
    return raw == "1"


def overlap() -> bool:
    return _flag_env("SMARTINF_OVERLAP", True)


def speculate_resident() -> bool:
    """Whether, under DeepSpeed with ``overlap``, a resident sub-group's update starts during
    backward too, on its twin (``SMARTINF_SPECULATE_RESIDENT``, off: left to the step's tail,
    which updates it in place; on the H100 hosts the twin's update was no faster)."""
    return _flag_env("SMARTINF_SPECULATE_RESIDENT", False)


def speculate_on_cpu() -> bool:
    """Whether updates start during a backward that runs on the CPU (``overlap``;
    ``SMARTINF_SPECULATE_ON_CPU``, off): there backward holds the cores the update needs (on
    this project's 2-core machine the 266 M GPT's iteration was 1.1x slower with them)."""
    return _flag_env("SMARTINF_SPECULATE_ON_CPU", False)


def gpu_memory() -> Optional[int]:
    """``SMARTINF_GPU_MEMORY`` in bytes (None: unset)."""
    raw = os.environ.get("SMARTINF_GPU_MEMORY")
    return None if not raw else parse_bytes(raw, "SMARTINF_GPU_MEMORY")


def step_tail_on_cpu() -> bool:
    """Whether ``smartinf.optim``'s step finishes while the next forward runs where the params
    are on the CPU (``SMARTINF_STEP_TAIL_ON_CPU``, off; with ``overlap`` and updates started
    during backward): there the forward holds the cores the updates need. On a GPU it does,
    always with ``overlap``."""
    return _flag_env("SMARTINF_STEP_TAIL_ON_CPU", False)


#: With int8/int4 states, tensors of at most this many elements keep fp32 moments (lpmm's
#: rule: a quantisation block shared with larger neighbours costs them most of their
#: moments' precision, and they are few bytes). The front-ends put them in sub-groups of
#: their own (``Pipeline(small_sizes=)``).
SMALL_TENSOR = 4096


def small_tensor(state_dtype: str) -> int:
    """Elements up to which a tensor's moments stay fp32 beside ``state_dtype`` states
    (int8/int4: ``SMARTINF_SMALL_TENSOR``, else ``SMALL_TENSOR``; 0 there: every tensor's
    are quantised; fp32 states: 0, every moment is fp32 already)."""
    if state_dtype == "fp32":
        return 0
    value = _int_env("SMARTINF_SMALL_TENSOR", SMALL_TENSOR)
    if value < 0:
        raise ValueError(f"SMARTINF_SMALL_TENSOR={value} must not be negative (0: none)")
    return value
