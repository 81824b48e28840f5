"""``Pipeline``: optimizer states on near-storage devices, updated per sub-group.

A sub-group is a flat range of parameters. Its fp32 master copy and optimizer states
live on a device's storage; ``update`` sends the gradient in and gets the updated
parameters out, while the transfer handler overlaps storage reads, the update kernel,
the parameter copy-out and the write-back of the states of different chunks.

This file: opening the devices, the layout (``add_subgroup``, where each sub-group is)
and the lifetime; ``steps.py``: the step protocol (``update``, ``retract``,
``commit``/``discard``/``settle``); ``states.py``: the states between steps. Their
keywords' owner: ``smartinf.PipelineSettings``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
from typing import Any, Optional, Sequence

import numpy as np

from smartinf import _native, defaults, update_rules
from smartinf.pipeline import at_exit, buffers
from smartinf.planning import space, twins
from smartinf.planning import io_schedule as schedules
from smartinf.pipeline.checkpoint import MANIFEST, manifest_fields
from smartinf.pipeline.devices import DeviceLike, resolve, small_directory
from smartinf.pipeline.states import States
from smartinf.pipeline.steps import ParamsChangedWarning, Steps, UpdateFuture
from smartinf.pipeline.settings import PipelineSettings
from smartinf.update_rules import AdamW, UpdateRule

__all__ = ["Pipeline", "UpdateFuture", "ParamsChangedWarning"]

logger = logging.getLogger("smartinf")
_warned: set[str] = set()
_KEYWORD_DEFAULTS = dict(slots=None, chunk=None, io=None, queue_depth=None, host_link_gbps=None,
                         verify=False, state_dtype="fp32", if_exists="resume", memory_budget=None,
                         commit_every=None, compute_threads=None, master="fp32",
                         io_schedule=None, overlap=None, copies=2, commit_waits=True)


class Pipeline(Steps, States):
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
    param_dtype
        If given, every ``out`` must have this dtype (float32, float16 or bfloat16).
    slots, chunk, io, queue_depth, host_link_gbps, verify, state_dtype, master, if_exists, \
    memory_budget, commit_every, commit_waits, copies, compute_threads, io_schedule, overlap
        The storage settings, as keywords: see ``smartinf.PipelineSettings``, which owns
        and documents them (unset ones come from the environment, ``SMARTINF_*``).
    settings
        The storage settings at once (a ``smartinf.PipelineSettings``, as ``smartinf.optim``
        and the DeepSpeed integration build it), instead of the keywords.
    subgroup_sizes
        The sizes of the sub-groups the caller will add, in order, where it knows them (the
        front-ends do): a ``CudaDevice(twins=None)`` then takes twins by the model's
        prediction of the whole placement with and without (``smartinf.planning.twins``). Placement
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
    defer_logged_step
        With ``copies="log"``, for front-ends of several processes (the DeepSpeed
        integration): a step that a crash left logged but unfinished in every device is not
        finished (or, where some device lacks its log, forgotten) here; the caller decides
        with the other processes (``logged_step_pending``, ``finish_logged_step``,
        ``drop_logged_step``) before adding sub-groups.
    gradient_bytes
        With ``copies="log"``, the bytes a param of the gradients ``update`` will get (2 in
        bf16 or fp16; 4, fp32, unless said): the disk checked before the first byte holds a
        step's log of them.

    With several devices, sub-groups fill the GPU memory budgets of ``CudaDevice``s first
    (in device order; their update there is ~100x the host's), and the others are placed by
    bytes (each new one on the device holding the fewest params outside GPU budgets); every
    device runs its own ring, in parallel. Each
    directory records its place in the device list; reopening needs the same list.
    """

    __slots__ = ("_native", "_devices", "_gpus", "optimizer", "settings", "_param_dtype", "_inflight",
                 "_small",
                 "_final_stats", "_final_device_stats", "_resumed", "io_schedules", "twins",
                 "_params_unchecked", "__weakref__")

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
        commit_waits: bool = True,
        settings: Optional[PipelineSettings] = None,
        subgroup_sizes: Sequence[int] = (),
        small_sizes: Optional[Sequence[int]] = None,
        defer_logged_step: bool = False,
        gradient_bytes: int = 4,
    ) -> None:
        self._native = None
        _check_sizes(subgroup_sizes, small_sizes)
        self._devices = resolve(devices)
        specs = [d.native_spec() for d in self._devices]  # environment errors before any I/O
        self._gpus = [s.options["gpu"] if s.kind == "cuda" else None for s in specs]
        self.optimizer = AdamW() if optimizer is None else optimizer
        if not isinstance(self.optimizer, UpdateRule):
            raise TypeError(f"optimizer must be one of smartinf's rules ("
                            f"{', '.join(f'{name}(...)' for name in update_rules.__all__)}), "
                            f"got {type(optimizer).__name__}")
        self._param_dtype = None if param_dtype is None else buffers.dtype_code(param_dtype)
        given = dict(slots=slots, chunk=chunk, io=io, queue_depth=queue_depth,
                     host_link_gbps=host_link_gbps, verify=verify, state_dtype=state_dtype,
                     if_exists=if_exists, memory_budget=memory_budget, commit_every=commit_every,
                     compute_threads=compute_threads, master=master, io_schedule=io_schedule,
                     overlap=overlap, copies=copies, commit_waits=commit_waits)
        if settings is None:
            settings = PipelineSettings.resolve(**given)
        elif given != _KEYWORD_DEFAULTS:
            raise TypeError("pass the settings either as settings= or as keywords, not both")
        if settings.chunk is None:
            settings = dataclasses.replace(settings, chunk=_default_chunk(self._devices, specs))
        held = _make_directories([d.path for d in self._devices])
        self._inflight: list[UpdateFuture] = []
        self._final_stats: dict[str, float] = {}
        self._final_device_stats: list[dict[str, float]] = []
        self._resumed: set[int] = set()
        # Split master: the first step's commit checks the resumed sub-groups' params (commit)
        self._params_unchecked = True
        self.settings = settings
        self.io_schedules = [schedules.choose(settings.io_schedule, d.path) for d in self._devices]
        host_memory = _host_budgets(specs, settings.memory_budget)
        self.twins = [twins.choose(d, settings.state_dtype, settings.master, settings.commit_every,
                                   settings.overlap, subgroup_sizes, sum(host_memory.values()), c.schedule)
                      for d, c in zip(self._devices, self.io_schedules)]
        specs = [s._replace(io_schedule=c.schedule, io_burst=c.burst, twins=t.twins,
                            options={**s.options, "host_twin": True} if t.host else s.options)
                 for s, c, t in zip(specs, self.io_schedules, self.twins)]
        host_memory["host twins of GPU budgets"] = sum(s.options["memory_budget"] for s in specs
                                                       if s.options.get("host_twin"))
        space.check_memory(sum(host_memory.values()), " and ".join(
            f"{what} ({space._size(nbytes)})" for what, nbytes in host_memory.items() if nbytes))
        small = _small_directory(self._devices[0].path, settings.state_dtype, small_sizes)
        self._small = bool(small)
        if small:
            self._gpus.append(None)  # the small sub-groups' device, last
        space.check_opening([d.path for d in self._devices] + ([small] if small else []), held)
        self._native = _native.NativePipeline(specs, self.optimizer.name,
                                              float(self.optimizer.initial_state), settings,
                                              small, [int(n) for n in small_sizes or ()] if small else [],
                                              bool(defer_logged_step))
        _check_disk(self, subgroup_sizes, small_sizes or (), small, held, gradient_bytes, specs)
        at_exit.register_pipeline(self)  # closed at exit if still open: no step lost
        for note in self._native.notes():
            if note not in _warned:
                _warned.add(note)
                logger.warning(note)

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

    def gpu_of(self, sg: int) -> Optional[int]:
        """The CUDA ordinal of the GPU sub-group ``sg`` is updated on (its gradient and
        params may be CUDA tensors there), or None: a CPU or SmartSSD device."""
        return self._gpus[self._open().device_of(self._subgroup(sg))]

    def device_of(self, sg: int):
        """The device (one of ``devices``) sub-group ``sg`` is updated on, or None: the
        small tensors' device (``small_sizes``)."""
        unit = self._open().device_of(self._subgroup(sg))
        return self._devices[unit] if unit < len(self._devices) else None

    def resident(self, sg: int) -> bool:
        """Whether ``sg``'s states stay in the device's memory (the memory budget)."""
        native = self._open()
        return native.resident(self._subgroup(sg))

    def subgroup_steps(self, sg: int) -> int:
        """Optimizer steps applied to sub-group ``sg`` (Adam's ``t``, AdaGrad's ``step``)."""
        return self._open().subgroup_steps(self._subgroup(sg))

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

    def __del__(self) -> None:  # (``at_exit`` closes one still open at interpreter exit)
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

    def _subgroup(self, sg: Any) -> int:
        if not isinstance(sg, (int, np.integer)) or isinstance(sg, bool):
            raise TypeError(f"sub-group id must be an int, got {type(sg).__name__}")
        count = self._native.subgroup_count
        if not 0 <= sg < count:
            raise IndexError(f"unknown sub-group {sg}: the pipeline has {count} (0..{count - 1})")
        return int(sg)


def _host_budgets(specs: list, memory_budget: int) -> dict:
    """Bytes of host memory the devices' budgets hold, by what holds them: ``memory_budget``
    on each device with a host tier, and ``CudaDevice(memory="host")`` budgets."""
    holders = sum(_native.device_kind(s.kind)["host_budget"] for s in specs)
    return {f"memory_budget={memory_budget} on each of {holders} cpu device(s)": memory_budget * holders,
            "CudaDevice(memory='host') budgets": sum(s.options["memory_budget"] for s in specs
                                                     if s.options.get("memory") == "host")}


def _check_disk(pipe: Pipeline, sizes: Sequence[int], small: Sequence[int], small_dir: str,
                held: set, gradient_bytes: int, specs: list) -> None:
    """Before any sub-group is added: the sub-groups to come and their commits fit their file
    systems, or ``pipe`` is closed and refused (``space.check_disk``), the directories it made
    (not in ``held``) left as they were found."""
    if not sizes and not small:
        return
    dirs = [d.path for d in pipe._devices] + ([small_dir] if small_dir else [])
    settings = pipe.settings
    # a split master runs with bf16 params: said by param_dtype, else by 2-byte gradients
    split = pipe._param_dtype == buffers.BF16 or (pipe._param_dtype is None and gradient_bytes == 2)
    resident = settings.memory_budget * sum(_native.device_kind(s.kind)["host_budget"] for s in specs) + \
        sum(s.options.get("memory_budget", 0) for s in specs if s.kind == "cuda")
    try:  # copies=1 refuses a sub-group placed to stream here
        grow = pipe._native.planned_bytes([int(n) for n in (*sizes, *small)],
                                          [False] * len(sizes) + [True] * len(small), gradient_bytes)
        planned = space.Planned([int(n) for n in (*sizes, *small)], settings.chunk,
                                pipe._native.state_arrays, gradient_bytes,
                                int(pipe._native.stats().get("slots", 4)), split, resident)
        space.check_disk(dirs, grow, sum(sizes) + sum(small), settings.state_dtype,
                         settings.master, settings.copies, planned)
    except (OSError, ValueError):
        pipe.close()
        for d in dirs:  # those this open made (nothing held) are left as they were found
            if d not in held:
                space.forget_new_directory(d)
        raise


def _check_sizes(subgroup_sizes: Sequence[int], small_sizes: Optional[Sequence[int]]) -> None:
    for name, sizes in (("subgroup_sizes", subgroup_sizes), ("small_sizes", small_sizes or ())):
        bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0]
        if bad:
            raise ValueError(f"{name} must be positive ints (the params of each "
                             f"sub-group to come), got {bad[0]!r} among them")


def _default_chunk(devices: list, specs: list) -> int:
    """The chunk of a pipeline not given one: the run a directory holds keeps its own, a new
    one takes ``defaults.GPU_CHUNK`` where a GPU updates and ``defaults.CHUNK`` elsewhere."""
    for d in devices:
        chunk = (manifest_fields(d.path) or {}).get("chunk", "")
        if chunk.isdigit():
            return int(chunk)
    return defaults.GPU_CHUNK if any(s.kind == "cuda" for s in specs) else defaults.CHUNK


def _make_directories(paths: Sequence[str]) -> set:
    """The devices' directories made where missing; returns those (and the small tensors'
    directory) that held a run before this open: a refusal leaves them as they are."""
    held = {p for p in (*paths, small_directory(paths[0]))
            if os.path.isfile(os.path.join(p, MANIFEST))}
    for path in paths:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(f"device path {path} is a file: pass a directory "
                                     f"(it will hold states.bin, manifest and lock)")
        os.makedirs(path, exist_ok=True)
    return held


def _small_directory(first: str, state_dtype: str, small_sizes: Optional[Sequence[int]]) -> str:
    """The small tensors' directory (made), where quantized states expect small sub-groups
    or an earlier run left one; else ""."""
    small = small_directory(first)
    if state_dtype == "fp32" or (small_sizes is None and not os.path.isfile(os.path.join(small, MANIFEST))):
        return ""
    os.makedirs(small, exist_ok=True)
    return small
