"""``Pipeline``: optimizer states on near-storage devices, updated per sub-group.

A sub-group is a flat range of parameters. Its fp32 master copy and optimizer states
live on a device's storage; ``update`` sends the gradient in and gets the updated
parameters out, while the transfer handler overlaps storage reads, the update kernel,
the parameter copy-out and the write-back of the states of different chunks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
import warnings
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from . import _native, buffers, space, twins
from . import io_schedule as schedules
from .compress import Compressed
from .checkpoint import MANIFEST
from .devices import DeviceLike, resolve, small_directory
from .settings import PipelineSettings
from .update_rules import AdamW, UpdateRule

logger = logging.getLogger("smartinf")
_warned: set[str] = set()
_KEYWORD_DEFAULTS = dict(slots=None, chunk=None, io=None, queue_depth=None, host_link_gbps=None,
                         verify=False, state_dtype="fp32", if_exists="resume", memory_budget=None,
                         commit_every=None, compute_threads=None, master="fp32",
                         io_schedule=None, overlap=None, copies=2)


class ParamsChangedWarning(UserWarning):
    """With ``master="split"``: params came back other than the devices emitted them, so
    the changed ones were taken as the new fp32 masters (where a stored low half does not
    round back to its param)."""


class UpdateFuture:
    """Completion of one ``Pipeline.update``: done when every updated param is in ``out``.

    The gradient and ``out`` buffers must stay untouched until then; the future keeps
    them alive. Write-back of the states continues after it is done.
    """

    __slots__ = ("_native", "_buffers")

    def __init__(self, native: Any, keep_alive: tuple) -> None:
        self._native = native
        self._buffers = keep_alive

    def done(self) -> bool:
        return self._native.done()

    def wait(self) -> None:
        """Blocks until the params are out; raises the update's error, if any."""
        self._native.wait()

    get = result = wait


class Pipeline:
    """Near-storage optimizer over one or more devices.

    Parameters
    ----------
    devices
        A device, a directory path, or a list of them (one per computational storage
        device). Each directory holds ``states.bin`` and ``manifest``; reopening a
        directory resumes at its last committed step.
    optimizer
        The update rule and its hyper-parameters: ``smartinf.AdamW()`` (the default),
        ``Adam``, ``SGD`` or ``Adagrad``; fixed for a directory.
    slots
        Ring slots per device (``SMARTINF_SLOTS``; unset: 4, and where a device's storage
        runs phased enough more to hold one turn of its burst, at most 64): memory is
        ``slots`` chunks per device, whatever the model size (``stats["slots"]``).
    chunk
        Parameters per chunk (``SMARTINF_CHUNK``, 1 Mi); fixed for a directory.
    param_dtype
        If given, every ``out`` must have this dtype (float32, float16 or bfloat16).
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
        bit for bit; ``discard()`` and a failed step go back to it as well.
    copies
        Extents of each chunk in a directory, fixed when it is made (2). 2: the committed
        copy and the one a step writes, so a crash at any instant reopens at the last
        durable step. 1: half the disk, for a model whose two copies do not fit: every
        sub-group must be resident (refused before any byte is written otherwise), and a
        durable commit writes the states in place, so a crash while it writes loses them
        (the reopen refuses the directory, naming the step; ``if_exists="overwrite"``
        starts afresh). ``discard()`` after ``write_states`` closes the pipeline likewise.
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
    settings
        All of the above but ``param_dtype`` at once (``smartinf.PipelineSettings``, as
        ``smartinf.optim`` and the DeepSpeed integration build it), instead of the keywords.
    subgroup_sizes
        The sizes of the sub-groups the caller will add, in order, where it knows them (the
        front-ends do): a ``CudaDevice(twins=None)`` then takes twins by the model's
        prediction of the whole placement with and without (``smartinf.twins``). Placement
        itself is by ``add_subgroup``, as always.
    small_sizes
        With int8/int4 states, the sizes of the sub-groups of small tensors the caller will
        add with ``add_subgroup(small=True)`` (a sequence, even empty: such sub-groups may
        come; None: none are expected) (``smartinf.optim`` and the DeepSpeed
        integration put tensors of at most ``defaults.SMALL_TENSOR`` elements in sub-groups
        of their own): their moments stay fp32, in a cpu device of their own over
        ``<first directory>/fp32-moments`` (``devices.small_directory``), resident when
        ``memory_budget`` is given (their bytes held beside it). A quantisation block shared
        with larger neighbours costs a small tensor most of its moments' precision (lpmm
        keeps such tensors in fp32 too); their bytes are few. Reopened directories that hold
        such a device keep it.

    With several devices, sub-groups fill the GPU memory budgets of ``CudaDevice``s first
    (in device order; their update there is ~100x the host's), and the others are placed by
    bytes (each new one on the device holding the fewest params outside GPU budgets); every
    device runs its own ring, in parallel. Each
    directory records its place in the device list; reopening needs the same list.
    """

    __slots__ = ("_native", "_devices", "_gpus", "optimizer", "settings", "_param_dtype", "_inflight",
                 "_small",
                 "_final_stats", "_final_device_stats", "_resumed", "io_schedules", "twins",
                 "_params_unchecked")

    def __init__(
        self,
        devices: DeviceLike | Sequence[DeviceLike],
        optimizer: Optional[UpdateRule] = None,
        *,
        slots: Optional[int] = None,
        chunk: Optional[int] = None,
        param_dtype: Any = None,
        io: Optional[str] = None,
        queue_depth: Optional[int] = None,
        host_link_gbps: Optional[float] = None,
        verify: bool = False,
        state_dtype: str = "fp32",
        if_exists: str = "resume",
        memory_budget: Any = None,
        commit_every: Optional[int] = None,
        compute_threads: Optional[int] = None,
        master: str = "fp32",
        io_schedule: Optional[str] = None,
        overlap: Optional[bool] = None,
        copies: int = 2,
        settings: Optional[PipelineSettings] = None,
        subgroup_sizes: Sequence[int] = (),
        small_sizes: Optional[Sequence[int]] = None,
    ) -> None:
        self._native = None
        for name, sizes in (("subgroup_sizes", subgroup_sizes), ("small_sizes", small_sizes or ())):
            bad = [n for n in sizes
                   if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0]
            if bad:
                raise ValueError(f"{name} must be positive ints (the params of each "
                                 f"sub-group to come), got {bad[0]!r} among them")
        self._devices = resolve(devices)
        specs = [d.native_spec() for d in self._devices]  # environment errors before any I/O
        self._gpus = [s.gpu if s.kind == "cuda" else None for s in specs]
        self.optimizer = AdamW() if optimizer is None else optimizer
        if not isinstance(self.optimizer, UpdateRule):
            raise TypeError(f"optimizer must be smartinf.AdamW(...), Adam(...), SGD(...), "
                            f"Adagrad(...) or Lion(...), got {type(optimizer).__name__}")
        self._param_dtype = None if param_dtype is None else buffers.dtype_code(param_dtype)
        given = dict(slots=slots, chunk=chunk, io=io, queue_depth=queue_depth,
                     host_link_gbps=host_link_gbps, verify=verify, state_dtype=state_dtype,
                     if_exists=if_exists, memory_budget=memory_budget, commit_every=commit_every,
                     compute_threads=compute_threads, master=master, io_schedule=io_schedule,
                     overlap=overlap, copies=copies)
        if settings is None:
            settings = PipelineSettings.resolve(**given)
        elif given != _KEYWORD_DEFAULTS:
            raise TypeError("pass the settings either as settings= or as keywords, not both")
        # directories that held a run before this open: a refusal leaves them as they are
        held = {p for p in (*(d.path for d in self._devices), small_directory(self._devices[0].path))
                if os.path.isfile(os.path.join(p, MANIFEST))}
        for d in self._devices:
            if os.path.exists(d.path) and not os.path.isdir(d.path):
                raise NotADirectoryError(f"device path {d.path} is a file: pass a directory "
                                         f"(it will hold states.bin, manifest and lock)")
            os.makedirs(d.path, exist_ok=True)
        self._inflight: list[UpdateFuture] = []
        self._final_stats: dict[str, float] = {}
        self._final_device_stats: list[dict[str, float]] = []
        self._resumed: set[int] = set()
        # Split master: the first step's commit checks the resumed sub-groups' params (commit)
        self._params_unchecked = True
        self.settings = settings
        self.io_schedules = [schedules.choose(settings.io_schedule, d.path) for d in self._devices]
        holders = sum(_native.device_kind(s.kind)["host_budget"] for s in specs)
        host_memory = settings.memory_budget * holders
        space.check_memory(host_memory, f"memory_budget={settings.memory_budget} on each of "
                                        f"{holders} cpu device(s)")
        self.twins = [twins.choose(d, settings.state_dtype, settings.master, settings.commit_every,
                                   settings.overlap, subgroup_sizes, host_memory, c.schedule)
                      for d, c in zip(self._devices, self.io_schedules)]
        specs = [s._replace(io_schedule=c.schedule, io_burst=c.burst, twins=t.twins)
                 for s, c, t in zip(specs, self.io_schedules, self.twins)]
        small = small_directory(self._devices[0].path)
        quantized = settings.state_dtype != "fp32"
        if not quantized or (small_sizes is None and not os.path.isfile(os.path.join(small, MANIFEST))):
            small = ""
        else:
            os.makedirs(small, exist_ok=True)
        self._small = bool(small)
        if small:
            self._gpus.append(None)  # the small sub-groups' device, last
        self._native = _native.NativePipeline(specs, self.optimizer.name,
                                              float(self.optimizer.initial_state), settings,
                                              small, [int(n) for n in small_sizes or ()] if small else [])
        self._check_disk(subgroup_sizes, small_sizes or (), small, held)
        for note in self._native.notes():
            if note not in _warned:
                _warned.add(note)
                logger.warning(note)

    def _check_disk(self, sizes: Sequence[int], small: Sequence[int], small_dir: str,
                    held: set) -> None:
        """Before any sub-group is added: the sub-groups to come fit their file systems, or
        the pipeline is closed and refused with what would fit (``space.check_disk``); the
        directories it made (not in ``held``) are left as they were found."""
        if not sizes and not small:
            return
        dirs = [d.path for d in self._devices] + ([small_dir] if small_dir else [])
        try:  # copies=1 refuses a sub-group placed to stream here
            grow = self._native.planned_bytes([int(n) for n in (*sizes, *small)],
                                              [False] * len(sizes) + [True] * len(small))
            space.check_disk(dirs, grow, sum(sizes) + sum(small), self.settings.state_dtype,
                             self.settings.master, self.settings.copies)
        except (OSError, ValueError):
            self.close()
            for d in dirs:  # those this open made (nothing held) are left as they were found
                if d not in held:
                    space.forget_new_directory(d)
            raise

    # -- layout -----------------------------------------------------------------------
    def add_subgroup(self, numel: int, init: Any = None, *, fingerprint: int = 0,
                     small: bool = False) -> int:
        """Adds the next sub-group of ``numel`` params and returns its id.

        ``init`` (fp32, ``numel`` elements; zeros when None) becomes the master weights of
        a new sub-group; the optimizer moments start at zero. When the directories already
        hold this sub-group (reopened), its stored states are kept and ``init`` is ignored.
        ``fingerprint`` (a 64-bit int, e.g. a hash of the params' shapes; 0: unchecked) is
        recorded with a new sub-group, and a held one with another fingerprint is refused:
        a model of the same size but another layout must not take its weights. ``small``:
        its params are small tensors whose moments stay fp32 with int8/int4 states
        (``small_sizes``; with fp32 states it changes nothing).
        """
        native = self._open()
        if not isinstance(numel, (int, np.integer)) or isinstance(numel, bool):
            raise TypeError(f"numel must be an int, got {type(numel).__name__}")
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        if not isinstance(fingerprint, (int, np.integer)) or not 0 <= fingerprint < 1 << 64:
            raise ValueError(f"fingerprint must be an int in [0, 2**64), got {fingerprint!r}")
        address, owner = 0, None
        if init is not None:
            address, _, owner = buffers.host_buffer("init", init, int(numel), [buffers.F32],
                                                    writable=False)
        if small and self.settings.state_dtype != "fp32" and not self._small:
            raise ValueError("add_subgroup(small=True): give the pipeline the small sub-groups' "
                             "sizes at creation (small_sizes=), so that their fp32 moments have "
                             "a device of their own")
        sg, resumed = native.add_subgroup(int(numel), address, int(fingerprint), bool(small))
        del owner
        if resumed:
            self._resumed.add(sg)
        return sg

    def resumed(self, sg: int) -> bool:
        """Whether sub-group ``sg`` was found on the devices (reopened) rather than created."""
        return self._subgroup(sg) in self._resumed

    @property
    def num_subgroups(self) -> int:
        return self._open().subgroup_count

    def numel(self, sg: int) -> int:
        return self._open().numel(self._subgroup(sg))

    @property
    def step_count(self) -> int:
        """Steps committed (with ``commit_every`` > 1, durable or not)."""
        return self._open().step

    @property
    def durable_step_count(self) -> int:
        """Steps committed durably: what reopening the directories resumes at."""
        return self._open().durable_step

    @property
    def previous_step_count(self) -> int:
        """The durable step before ``durable_step_count`` that the directories still hold
        (their shadow copies), or ``durable_step_count`` where they hold none in common."""
        return self._open().previous_step

    def roll_back_to(self, step: int) -> None:
        """Before any sub-group is added: back to ``step``, the durable step or the one
        before it (``previous_step_count``), as other ranks are after a crash between their
        commits; another step is refused (ValueError) naming what the directories hold."""
        self._open().roll_back_to(step)

    @property
    def commit_pending(self) -> bool:
        """Whether a durable commit is being written in the background (``overlap``)."""
        return self._open().commit_pending

    def resident(self, sg: int) -> bool:
        """Whether ``sg``'s states stay in the device's memory (the memory budget)."""
        native = self._open()
        return native.resident(self._subgroup(sg))

    def subgroup_steps(self, sg: int) -> int:
        """Optimizer steps applied to sub-group ``sg`` (Adam's ``t``, AdaGrad's ``step``)."""
        return self._open().subgroup_steps(self._subgroup(sg))

    # -- steps ------------------------------------------------------------------------
    def update(self, sg: int, grad: Any, out: Any, *, grad_scale: float = 1.0,
               speculative: bool = False, **overrides: Any) -> UpdateFuture:
        """Starts the update of sub-group ``sg``; returns a future done when ``out`` is.

        ``grad`` is the sub-group's gradient: a dense fp32/fp16/bf16 buffer, or a
        ``smartinf.compress.Compressed`` (top-k int32 indices + fp16/bf16 values, on the
        CPU) that the device decompresses. Buffers are contiguous CPU numpy arrays or
        tensors. The gradient is multiplied by ``grad_scale`` (1/loss scale, times a
        clipping coefficient) before use. ``out`` receives the updated params
        (fp32/fp16/bf16; with ``master="split"`` bf16, holding the current params on entry).
        On a ``CudaDevice`` (``gpu_of(sg)``) ``grad``, and ``out`` but with a split master,
        may be CUDA tensors on its GPU: read and written there, nothing crosses PCIe (what the
        caller's current stream queued is waited for first). Keyword ``overrides`` replace the optimizer's hyper-parameters
        for this update (``lr=``, ``weight_decay=``, ``betas=``, ``momentum=`` ...:
        schedulers, param groups). Each sub-group is updated at most once per step; the
        step becomes durable with ``commit()`` (or ``with pipe.step():``).
        ``speculative=True`` (where ``retractable(sg)``): the update may be taken back with
        ``retract(sg)`` before the step is committed (its gradient or the step's global
        decisions turned out other than assumed).
        """
        native = self._open()
        sg = self._subgroup(sg)
        numel = native.numel(sg)
        allowed = [self._param_dtype] if self._param_dtype is not None else \
            [buffers.F32, buffers.F16, buffers.BF16]
        gpu = self.gpu_of(sg)
        o = buffers.host_buffer("out", out, numel, allowed, writable=True,
                                gpu=None if self.settings.master == "split" else gpu)
        if isinstance(grad, Compressed):
            if grad.numel != numel:
                raise ValueError(f"the compressed gradient is of {grad.numel} params, "
                                 f"sub-group {sg} has {numel}")
            nnz = len(grad.values)
            g = buffers.host_buffer("grad.values", grad.values, nnz, [buffers.F16, buffers.BF16],
                                    writable=False)
            index = buffers.index_buffer("grad.indices", grad.indices, nnz)
            keep = (g.owner, index.owner, o.owner)
            spans = [(g, nnz), (index, nnz)]
        else:
            g = buffers.host_buffer("grad", grad, numel, [buffers.F32, buffers.F16, buffers.BF16],
                                    writable=False, gpu=gpu)
            index, nnz, keep, spans = None, 0, (g.owner, o.owner), [(g, numel)]
        if any(_overlaps(b, n, o, numel) for b, n in spans):
            raise ValueError("grad and out overlap; give out its own memory")
        rule = self._rule(overrides)
        if not np.isfinite(grad_scale) or grad_scale <= 0:
            raise ValueError(f"grad_scale={grad_scale!r} must be a positive finite number")
        # maximize: torch negates the gradient first; a negated scale is the same, exactly
        hyper = dict(rule.hyper(), grad_scale=-float(grad_scale) if rule.maximize else float(grad_scale))
        on_gpu = [b.owner for b in (g, o) if isinstance(b.owner, torch.Tensor) and b.owner.is_cuda]
        if on_gpu:  # the device's own stream reads them: what the caller's queued must land
            torch.cuda.current_stream(on_gpu[0].device).synchronize()
        done = native.update(sg, g.address, g.dtype, index is not None,
                             index.address if index else 0, nnz, o.address, o.dtype, hyper,
                             bool(speculative))
        future = UpdateFuture(done, keep)
        self._inflight.append(future)
        return future

    def gpu_of(self, sg: int) -> Optional[int]:
        """The CUDA ordinal of the GPU sub-group ``sg`` is updated on (its gradient and
        params may be CUDA tensors there), or None: a CPU or SmartSSD device."""
        return self._gpus[self._open().device_of(self._subgroup(sg))]

    def retractable(self, sg: int) -> bool:
        """Whether ``sg`` can be updated speculatively now: its update would leave the states
        it reads untouched (a streamed sub-group not updated since the last durable commit;
        a resident one with a twin, see ``overlap``), and it was not updated in this step."""
        return self._open().retractable(self._subgroup(sg))

    def retract(self, sg: int) -> None:
        """Takes back ``sg``'s speculative update of the step in progress (waiting for it):
        its states and step count are as before it; its ``out`` holds params to ignore."""
        self._open().retract(self._subgroup(sg))

    def wait(self) -> None:
        """Waits until every update started so far has its params out."""
        for future in self._inflight:
            future.wait()

    def commit(self) -> None:
        """Ends the step: waits for its write-backs; every ``commit_every``-th step also
        writes the resident states, makes the writes durable, then flips the sub-groups'
        shadow copies in one atomic manifest update per device (with ``overlap``, once the
        resident states are written in the background: ``commit_pending``). If that fails,
        the pipeline is back at ``durable_step_count``."""
        native = self._open()
        self._refuse_other_params_after_resume()
        try:
            native.commit()
            self._params_unchecked = False
        finally:
            self._inflight.clear()
            self._warn_foreign()

    def _refuse_other_params_after_resume(self) -> None:
        """The first step after a resume with a split master: the directories hold only the
        masters' low halves, so the resumed sub-groups' bf16 params must be the ones of the
        step they were committed at. Other params (a model freshly built whose weights were
        not loaded) would pair their weights with the stored moments and low halves: the
        step is discarded and refused, before it commits. (Params changed later, between
        steps, are taken as the masters with a warning.)"""
        if not self._params_unchecked or self.settings.master != "split":
            return
        found = self._native.take_foreign()
        resumed = sorted({sg for sg, _ in found if sg in self._resumed})
        if not resumed:
            self._warn_foreign(found)
            return
        step = self.step_count
        self.discard()
        raise ValueError(
            f"master='split': sub-groups {resumed} were resumed from "
            f"{[d.path for d in self.devices]} at step {step}, whose directories hold only the "
            f"low halves of the fp32 masters, and the model's bf16 params are not the ones of "
            f"that step (its weights not loaded?). The step was discarded. Load the model's "
            f"weights of step {step} (the checkpoint saved with it) before training on, or start "
            f"afresh with if_exists='overwrite'")

    def flush(self) -> None:
        """Makes the committed steps durable now (between steps; a no-op when they are)."""
        self._open().flush()

    def settle(self) -> None:
        """Waits for a durable commit being written in the background (``overlap``) to
        land. If it fails, the pipeline is back at the durable commit before it
        (``step_count`` tells) and its error is raised here."""
        self._open().settle()

    def discard(self) -> None:
        """Ends the step without committing it and goes back to the last durable commit
        (with ``commit_every`` 1: the last committed step)."""
        native = self._open()
        try:
            native.discard()
        finally:
            self._inflight.clear()
            self._warn_foreign()

    @contextlib.contextmanager
    def step(self) -> Iterator["Pipeline"]:
        """``with pipe.step(): pipe.update(...)`` commits on success, discards on error."""
        self._open()
        try:
            yield self
        except BaseException:
            self.discard()
            raise
        self.commit()

    # -- states -----------------------------------------------------------------------
    def read_states(self, sg: int, into: Optional[Sequence[Any]] = None, *,
                    params: Any = None) -> dict[str, Any]:
        """The fp32 states of ``sg`` at ``step_count``: ``param`` and the optimizer's
        (``exp_avg``/``exp_avg_sq``, ``momentum_buffer``, ``sum`` ...), in new numpy arrays,
        or in ``into``: one writable fp32 buffer of the sub-group's size per name, in order.
        With ``master="split"`` the masters are rebuilt from ``params`` (the sub-group's bf16
        params as they are now); without them ``param`` is left out."""
        native = self._open()
        sg = self._subgroup(sg)
        split = self.settings.master == "split"
        names = ("param", *self.optimizer.state_names)
        if split and params is None:
            names = names[1:]
        numel = native.numel(sg)
        address, params_owner = 0, None
        if split and params is not None:
            address, _, params_owner = buffers.host_buffer("params", params, numel,
                                                           [buffers.BF16], writable=False)
        if into is None:
            into = [np.empty(numel, np.float32) for _ in names]
        if len(into) != len(names):
            raise ValueError(f"into has {len(into)} buffers, the states are {names}")
        held = [buffers.host_buffer(k, a, numel, [buffers.F32], writable=True)
                for k, a in zip(names, into)]
        arrays = {k: b.owner for k, b in zip(names, held)}
        addresses = [b.address for b in held]
        native.read_states(sg, addresses if names[0] == "param" else [0, *addresses], address)
        del params_owner
        self._warn_foreign()
        return arrays

    def write_master(self, sg: int, param: Any) -> None:
        """Replaces the fp32 master weights of ``sg`` (``param``, fp32 of the sub-group's
        size) as part of the current step; its optimizer states and step count stay. (With
        ``master="split"`` the params must then be ``param`` rounded: ``rounding.to_bf16``.)"""
        states = self.read_states(sg)
        states["param"] = param
        self.write_states(sg, states, self.subgroup_steps(sg))

    def write_states(self, sg: int, states: dict, steps: int) -> None:
        """Replaces the states of ``sg`` as part of the current step (current once it is
        committed, like an update): ``states`` maps ``param`` and the optimizer's state
        names (see ``read_states``) to fp32 buffers of the sub-group's size; a missing
        state starts at the optimizer's initial value. ``steps`` is the sub-group's
        optimizer step count from then on (Adam's ``t``)."""
        native = self._open()
        sg = self._subgroup(sg)
        numel = native.numel(sg)
        names = ("param", *self.optimizer.state_names)
        unknown = set(states) - set(names)
        if unknown:
            raise ValueError(f"unknown states {sorted(unknown)}: {self.optimizer.name} keeps {names}")
        if "param" not in states:
            raise ValueError("states must include 'param' (the fp32 master weights)")
        if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"steps must be a non-negative int, got {steps!r}")
        held = [buffers.host_buffer(k, states[k], numel, [buffers.F32], writable=False)
                if k in states else None for k in names]
        native.write_states(sg, [b.address if b else 0 for b in held], int(steps))

    @property
    def stats(self) -> dict[str, float]:
        """Bytes moved per link (``host_to_device``, ``device_to_host``, ``storage_read``,
        ``storage_write``), busy seconds per stage (``busy_*``), seconds spent waiting
        for a bandwidth cap (``wait_host_link``, ``wait_storage``), ``chunks`` and
        ``step``: all devices together. ``update_s``: seconds with an update in flight;
        ``update_wait_s``: seconds a caller waited for one (``UpdateFuture.wait``,
        ``commit``); ``update_hidden_s``: the rest, the update time hidden behind the
        caller's own work (with ``overlap``: backward, and under DeepSpeed the next
        forward); ``speculative_updates`` and ``retracted_updates`` (the rollbacks)."""
        if self.closed:
            return dict(self._final_stats)
        return self._native.stats()

    @property
    def device_stats(self) -> list[dict[str, float]]:
        """``stats`` of each device (in the order of ``devices``), plus ``numel``: the
        params placed on it."""
        if self.closed:
            return [dict(s) for s in self._final_device_stats]
        return self._native.device_stats()

    @property
    def engine(self) -> str:
        """The storage engine in use: ``uring`` or ``threads``."""
        return self._open().engine

    @property
    def devices(self) -> list:
        return list(self._devices)

    # -- lifetime ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._native is None or self._native.closed

    def close(self) -> None:
        """Closes the devices: committed steps are made durable, an uncommitted step is
        discarded (with ``commit_every`` > 1: back to the last durable commit); the layout
        is saved."""
        if self.closed:
            return
        if self._native.pending:
            logger.warning("closing with an uncommitted step: its updates are discarded")
        self._final_stats = self._native.stats()
        self._final_device_stats = self._native.device_stats()
        try:
            self._native.close()
        finally:
            self._inflight.clear()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else \
            f"{self._native.subgroup_count} sub-groups, step {self._native.step}, {self._native.engine}"
        return f"Pipeline({[d.path for d in self._devices]}, {self.optimizer}, {state})"

    def _open(self) -> Any:
        if self.closed:
            raise ValueError("the pipeline is closed")
        return self._native

    def _rule(self, overrides: dict) -> UpdateRule:
        """The optimizer with this update's hyper-parameter overrides (validated)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if not overrides:
            return self.optimizer
        fields = {f.name for f in dataclasses.fields(self.optimizer)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"unknown hyper-parameters {sorted(unknown)} for "
                            f"{type(self.optimizer).__name__}: expected some of {sorted(fields)}")
        rule = dataclasses.replace(self.optimizer, **overrides)
        if rule.name != self.optimizer.name:  # amsgrad: another state layout
            raise ValueError(f"an update cannot change the rule from {self.optimizer.name} to "
                             f"{rule.name}: it is fixed for the directories")
        return rule

    def _warn_foreign(self, found: Optional[list] = None) -> None:
        if self._native is None or self.settings.master != "split":
            return
        found = self._native.take_foreign() if found is None else found
        if found:
            groups = sorted({sg for sg, _ in found})
            warnings.warn(ParamsChangedWarning(
                f"master='split': the bf16 params of sub-groups {groups} ({len(found)} chunks) "
                f"were not the ones the devices emitted (weights loaded or edited since?): the "
                f"changed params were taken as the new fp32 masters, the others' kept"),
                stacklevel=3)

    def _subgroup(self, sg: Any) -> int:
        if not isinstance(sg, (int, np.integer)) or isinstance(sg, bool):
            raise TypeError(f"sub-group id must be an int, got {type(sg).__name__}")
        count = self._native.subgroup_count
        if not 0 <= sg < count:
            raise IndexError(f"unknown sub-group {sg}: the pipeline has {count} (0..{count - 1})")
        return int(sg)


def _overlaps(a: buffers.Buffer, a_numel: int, out: buffers.Buffer, numel: int) -> bool:
    size = {buffers.F32: 4, buffers.F16: 2, buffers.BF16: 2, -1: 4}  # -1: int32 indices
    return (a.address < out.address + numel * size[out.dtype]
            and out.address < a.address + a_numel * size[a.dtype])
