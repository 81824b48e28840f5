"""The settings of a Pipeline, resolved and validated in one place.

``Pipeline``, ``smartinf.optim`` (its keyword options) and the DeepSpeed integration (its
``"smartinf"`` block) all build one ``PipelineSettings`` and hand it, whole, to the native
core. Unset values come from the environment (``defaults``), explicit ones win.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

from smartinf import _native, defaults
from smartinf.pipeline.devices import positive_gbps

STATE_DTYPES = _native.moments_names()  # store/layout.h's list of moments formats
MASTERS = ("fp32", "split")
IF_EXISTS = ("resume", "overwrite", "error")


@dataclass(frozen=True)
class PipelineSettings:
    """The settings of a ``Pipeline``'s storage and update: one per pipeline, fixed at
    creation (``resolve`` checks them and fills unset ones from the environment).

    Attributes
    ----------
    slots
        Ring slots per device (``SMARTINF_SLOTS``; unset: 4, and where a device's storage
        runs phased enough more to hold one turn of its burst, at most 64): memory is
        ``slots`` chunks per device, whatever the model size (``stats["slots"]``).
    chunk
        Parameters per chunk (``SMARTINF_CHUNK``; unset: the directory's own where it holds a
        run, else 1 Mi, or 16 Mi in a pipeline with a CUDA device); fixed for a directory.
    io
        Storage engine: ``auto`` (io_uring, else threads), ``uring`` or ``threads``
        (``SMARTINF_IO``).
    host_link_gbps
        Cap on the host link the devices share, GB/s in each direction
        (``SMARTINF_HOST_LINK_GBPS``; none by default): gradients in and params out of
        all devices together wait for it, as behind one PCIe switch.

    state_dtype
        ``"fp32"`` (default) or ``"int8"``: the rule's moments stored 8-bit, block-wise
        quantized (256 per block, a non-linear code scaled by each block's maximum), so an
        Adam param takes ~6 B of storage instead of 12 and a step moves half the bytes
        (Lion: ~5 B instead of 8). ``"int4"``: 4-bit moments (Li et al., NeurIPS 2023), ~1.1
        B per param for Adam's two. The master weights stay fp32 (see ``master``). Fixed for
        a directory; for the rules whose row in ``kernels/rules.h`` allows it (Adam, AdamW,
        Lion).
    master
        ``"fp32"`` (default): fp32 master weights stored, 4 B per param. ``"split"``, for
        bfloat16 params: bf16 is the upper half of an fp32, so only each master's low 16 bits
        are stored (2 B) and every ``update`` sends the current params in with the gradient
        (``out`` holds them on entry): the device rebuilds the exact fp32 master, updates it
        and emits the new params and low halves -- the same bits as ``"fp32"`` (bf16 rounds
        to nearest, ties away from zero, with either). Params that come back other than
        emitted (weights loaded or edited) are found by a checksum per chunk and taken as the
        new masters, with a ``ParamsChangedWarning``. Reading the masters takes the params
        (``read_states(params=)``). Fixed for a directory; cpu devices.
    verify
        Check every extent loaded in a step against the checksum (XXH3-64) written with
        it; a mismatch fails the update with ``OSError(EBADMSG)`` naming the sub-group,
        chunk and step. Reopened sub-groups are always checked once, when added.
    if_exists
        What to do with directories that hold an earlier run (committed steps or
        sub-groups): ``"resume"`` it (the default here: ``add_subgroup`` keeps the stored
        states and ``resumed()`` says so), ``"overwrite"`` it (discarded; every sub-group
        starts from its ``init``), or ``"error"`` (refused, nothing changed).
    memory_budget
        Bytes of states per ``cpu`` device kept resident in host RAM
        (``SMARTINF_MEMORY_BUDGET``; 0), allocated when the pipeline is created (memory
        stays fixed whatever the model); a ``CudaDevice`` takes a GPU memory budget of its
        own. Each sub-group whose states fit in what is left
        stays resident from ``add_subgroup`` on (``resident(sg)``): it is updated in memory
        and only written to storage, never read; the others stream through the slots.
    commit_every
        Steps per durable commit (``SMARTINF_COMMIT_EVERY``; 1). Every ``commit_every``-th
        ``commit()`` writes the resident states, syncs and switches the manifests; the
        others only advance ``step_count``. A crash reopens at ``durable_step_count``,
        bit for bit; ``discard()`` goes back to it as well (a failed step is undone alone:
        ``undo_step``).
    commit_waits
        Whether a durable commit that falls due while the last one is still written in the
        background (``overlap``) waits for it: ``True`` (the default here), every
        ``commit_every``-th step is durable exactly; ``False``, it is put off to the first
        step after that write has landed, so no step waits for the disk and the interval
        stretches to what the disk sustains (the planner's intervals: ``smartinf.optim`` and
        the DeepSpeed block where ``commit_every`` is not given, in a process alone: ranks
        would put commits off each by its own disk). The same bits either way; a crash
        reopens at the last durable commit.
    copies
        Extents of each chunk in a directory, fixed when it is made (2). 2: the committed
        copy and the one a step writes, so a crash at any instant reopens at the last
        durable step. 1: half the disk, for a model whose two copies do not fit: every
        sub-group must be resident (refused before any byte is written otherwise), and a
        durable commit writes the states in place, so a crash while it writes loses them
        (the reopen refuses the directory, naming the step; ``if_exists="overwrite"``
        starts afresh). ``discard()`` after ``write_states`` closes the pipeline likewise.
        ``"log"``: one copy with forward recovery, every instant recoverable at about
        S + G (the states, plus one step's gradients: 14 B a param for fp32 states and bf16
        gradients, against two copies' 24): each chunk's new version goes to a free extent,
        each step's gradients are logged before its first update, and a crash reopens at the
        step before or finishes the logged one. cpu devices, fp32 master, no
        memory_budget, ``commit_every=1``, ``overlap`` off (docs/memory-tiers.md).
    compute_threads
        Threads of the update kernel (``SMARTINF_COMPUTE_THREADS``; 0: the cores this
        process may use, less two from 8 on); the same bits with any number.
    io_schedule
        How each device's reads and write-backs share its storage (``SMARTINF_IO_SCHEDULE``;
        ``auto``): ``mixed`` (in flight together), ``phased`` (turns of one direction), or
        ``auto``, per directory from the probe's mix curve recorded there or above it
        (``python -m smartinf.probe DIR --record``; ``mixed`` without one). The same bits
        either way; ``io_schedules`` lists each device's choice and why.
    overlap
        Hide the optimizer's work behind the caller's (``SMARTINF_OVERLAP``; on): a durable
        commit writes the resident states in the background while later steps run, and is
        durable (``durable_step_count``) once they are written; a resident sub-group updated
        meanwhile works on a second copy when what is left of ``memory_budget`` holds one
        (else its update waits, as a streamed one's does; a device's ``twins`` places its
        resident sub-groups with room for both, ``twins`` here lists each device's choice
        and why). The same bits either way; a crash reopens at the last commit that was
        durable. ``False``: ``commit()`` waits for the writes.
    queue_depth
        Storage requests in flight per engine (``SMARTINF_QUEUE_DEPTH``; 32).
    piece_bytes
        The size of one storage request (1 MiB; not a keyword).
    """

    slots: Optional[int]
    chunk: Optional[int]
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
    copies: "int | str" = 2
    commit_waits: bool = True

    @classmethod
    def resolve(cls, *, slots: Optional[int] = None, chunk: Optional[int] = None,
                io: Optional[str] = None, queue_depth: Optional[int] = None,
                host_link_gbps: Optional[float] = None, verify: bool = False,
                state_dtype: str = "fp32", if_exists: str = "resume",
                memory_budget=None, commit_every: Optional[int] = None,
                compute_threads: Optional[int] = None,
                master: str = "fp32", io_schedule: Optional[str] = None,
                overlap: Optional[bool] = None, copies: "int | str" = 2,
                commit_waits: bool = True) -> "PipelineSettings":
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
        if isinstance(copies, str) and copies != "log":
            raise ValueError(f"copies={copies!r}: expected 1, 2 or 'log'")
        if copies == "log" and overlap:
            raise ValueError("copies='log' logs a step's gradients before its first update, so no "
                             "update runs during backward: pass overlap=False, or leave it out")
        overlap = (copies != "log" and defaults.overlap()) if overlap is None else overlap
        checked = (("slots", slots, 1, 256), ("chunk", chunk, 1, 1 << 28),
                   ("queue_depth", queue_depth, 1, 4096), ("commit_every", commit_every, 1, 1 << 20),
                   ("compute_threads", compute_threads, 0, 4096),
                   ("copies", 1 if copies == "log" else copies, 1, 2))
        for name, value, low, high in checked:
            if name in ("slots", "chunk") and value is None:  # the pipeline chooses
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
        for name, flag in (("verify", verify), ("overlap", overlap), ("commit_waits", commit_waits)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        host_link_gbps = defaults.host_link_gbps() if host_link_gbps is None \
            else positive_gbps(host_link_gbps, "host_link_gbps")
        return cls(slots, chunk, io, queue_depth, host_link_gbps, verify, state_dtype, if_exists,
                   memory_budget, commit_every, compute_threads, master, io_schedule, overlap,
                   copies=copies, commit_waits=commit_waits)


#: The keywords every entry point takes for its pipeline: ``Pipeline``, ``smartinf.optim``'s
#: optimizers and the DeepSpeed block pass exactly these to ``PipelineSettings.resolve``.
KEYWORDS = tuple(inspect.signature(PipelineSettings.resolve).parameters)
