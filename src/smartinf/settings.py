"""The settings of a Pipeline, resolved and validated in one place.

``Pipeline``, ``smartinf.optim`` (its keyword options) and the DeepSpeed integration (its
``"smartinf"`` block) all build one ``PipelineSettings`` and hand it, whole, to the native
core. Unset values come from the environment (``defaults``), explicit ones win.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

from . import defaults
from .devices import positive_gbps

STATE_DTYPES = ("fp32", "int8", "int4")
MASTERS = ("fp32", "split")
IF_EXISTS = ("resume", "overwrite", "error")


@dataclass(frozen=True)
class PipelineSettings:
    """``slots`` ring slots per device (None: 4, or enough for a phased turn); ``chunk`` params per chunk (fixed for a directory);
    ``io`` storage engine; ``queue_depth`` requests in flight per engine;
    ``host_link_gbps`` cap on the shared host link (None: none); ``verify`` checksum every
    load; ``state_dtype`` fp32, int8 or int4 moments; ``master`` fp32 masters or, for
    bf16 params, ``"split"``: only their low 16 bits stored (the params are the high ones); ``if_exists`` resume, overwrite or error
    for directories holding a run; ``memory_budget`` bytes of states per device kept
    resident in memory (the rest streams from storage); ``commit_every`` steps per durable
    commit; ``compute_threads`` threads of the update kernel (0: the usable cores, less two from 8 on;
    each of a host's ranks its share);
    ``overlap`` the optimizer's work hidden behind the caller's: a durable commit's resident
    states written in the background while later steps run (False: ``commit()`` waits for
    them); ``io_schedule`` how each device's reads and write-backs share its storage: ``auto``
    (from the probe's mix curve recorded in its directory or above it, else ``mixed``), ``mixed``
    (in flight together) or ``phased`` (turns of one direction); ``piece_bytes`` size of
    one storage request; ``copies`` extents of each chunk in a directory, fixed when it is
    made: 2 (the committed copy and the one a step writes: a crash at any instant reopens at
    the last durable step) or 1 (half the disk; every sub-group must be resident, and is
    written in place at durable commits: a crash while one is written loses the states, and
    the reopen refuses them)."""

    slots: Optional[int]
    chunk: int
    io: str
    queue_depth: int
    host_link_gbps: Optional[float]
    verify: bool
    state_dtype: str
    if_exists: str
    memory_budget: int = defaults.MEMORY_BUDGET
    commit_every: int = defaults.COMMIT_EVERY
    compute_threads: int = defaults.COMPUTE_THREADS
    master: str = "fp32"
    io_schedule: str = defaults.IO_SCHEDULE
    overlap: bool = True
    piece_bytes: int = defaults.PIECE_BYTES
    copies: int = 2

    @classmethod
    def resolve(cls, *, slots: Optional[int] = None, chunk: Optional[int] = None,
                io: Optional[str] = None, queue_depth: Optional[int] = None,
                host_link_gbps: Optional[float] = None, verify: bool = False,
                state_dtype: str = "fp32", if_exists: str = "resume",
                memory_budget=None, commit_every: Optional[int] = None,
                compute_threads: Optional[int] = None,
                master: str = "fp32", io_schedule: Optional[str] = None,
                overlap: Optional[bool] = None, copies: int = 2) -> "PipelineSettings":
        """Settings from explicit values, the environment for the unset ones; checked."""
        slots = defaults.slots() if slots is None else slots
        chunk = defaults.chunk() if chunk is None else chunk
        queue_depth = defaults.queue_depth() if queue_depth is None else queue_depth
        io = defaults.io() if io is None else io
        io_schedule = defaults.io_schedule() if io_schedule is None else io_schedule
        memory_budget = defaults.memory_budget() if memory_budget is None \
            else defaults.parse_bytes(memory_budget, "memory_budget")
        commit_every = defaults.commit_every() if commit_every is None else commit_every
        compute_threads = defaults.compute_threads() if compute_threads is None else compute_threads
        overlap = defaults.overlap() if overlap is None else overlap
        checked = (("slots", slots, 1, 256), ("chunk", chunk, 1, 1 << 28),
                   ("queue_depth", queue_depth, 1, 4096), ("commit_every", commit_every, 1, 1 << 20),
                   ("compute_threads", compute_threads, 0, 4096), ("copies", copies, 1, 2))
        for name, value, low, high in checked:
            if name == "slots" and value is None:  # the core sizes the ring
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"{name}={value} is outside [{low}, {high}]")
        if io_schedule not in defaults.IO_SCHEDULES:
            raise ValueError(f"io_schedule={io_schedule!r}: expected one of "
                             f"{', '.join(defaults.IO_SCHEDULES)}")
        if io not in defaults.IO_ENGINES:
            raise ValueError(f"io={io!r}: expected one of {', '.join(defaults.IO_ENGINES)}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={state_dtype!r}: expected one of {', '.join(STATE_DTYPES)}")
        if master not in MASTERS:
            raise ValueError(f"master={master!r}: expected one of {', '.join(MASTERS)}")
        if if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists={if_exists!r}: expected one of {', '.join(IF_EXISTS)}")
        for name, flag in (("verify", verify), ("overlap", overlap)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        host_link_gbps = defaults.host_link_gbps() if host_link_gbps is None \
            else positive_gbps(host_link_gbps, "host_link_gbps")
        return cls(slots, chunk, io, queue_depth, host_link_gbps, verify, state_dtype, if_exists,
                   memory_budget, commit_every, compute_threads, master, io_schedule, overlap,
                   copies=copies)


#: The keywords every entry point takes for its pipeline: ``Pipeline``, ``smartinf.optim``'s
#: optimizers and the DeepSpeed block pass exactly these to ``PipelineSettings.resolve``.
KEYWORDS = tuple(inspect.signature(PipelineSettings.resolve).parameters)
