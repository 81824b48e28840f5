"""The limits a step is measured against: raw storage, host memory and kernel throughput.

``python -m smartinf.probe [DIR ...] [--json] [--size-mib N] [--engine auto|uring|threads] [--record]``

For each directory: sequential ``O_DIRECT`` write then read bandwidth through the
project's own storage engine, in the pipeline's I/O pattern (1 MiB requests, 16 in
flight; the page cache is not involved), and the mix curve: half read and half written
with both directions in flight, and in bursts of one direction (``--record`` also times the
ring itself streaming states under each schedule, and keeps it all in the directory, with
the host's kernel rates, for ``io_schedule="auto"`` and ``smartinf.planning.twins``), and the write
while the host's update runs on the compute threads (a durable commit's background write
beside the next steps). Then host memory copy bandwidth and the Adam
kernel's throughput per grad/param dtype pair, on one thread and on the usable cores beside
a STREAM triad over the same threads (what memory gives the parallel update, whose limit
it is when states are resident). Where smartinf has CUDA and torch sees a GPU: the GPU's
update rate over states resident in its memory (the CudaDevice's kernels, gradients and
params in place) per state format, and PCIe's host <-> GPU copy rates (what
``smartinf.planning.model`` places sub-groups with). The functions return dataclasses (the
demo and the benchmarks divide by them); the command line is ``probe_cli.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from smartinf import _native, build_info, defaults
from smartinf.pipeline import buffers
from smartinf.planning import io_schedule, model
from smartinf.planning.probe_devices import measure_gpu, smartssds
from smartinf.pipeline.pipeline import Pipeline
from smartinf.update_rules import AdamW

logger = logging.getLogger("smartinf")

MiB = 1 << 20
GiB = 1 << 30
BLOCK = 1 * MiB  # the pipeline's storage piece size
DEPTH = defaults.QUEUE_DEPTH  # the pipeline's
KERNEL_NUMEL = 16 * MiB
HOST_COPY_BYTES = 256 * MiB
TRIAD_BYTES = 768 * MiB
GPU_NUMEL = 64 * MiB
#: Timed steps of the ring under each schedule (``measure_ring``), after one to warm up.
RING_STEPS = 2
#: Burst lengths of one direction the mix curve tries (those up to half the probe file).
MIX_BURSTS = (64 * MiB, 256 * MiB, GiB)
#: (grad, param) dtype pairs the kernel is timed for (fp32 states; int8 states once, f32/f16).
KERNEL_DTYPES = (("float32", "float32"), ("float32", "float16"),
                 ("float16", "float16"), ("bfloat16", "bfloat16"))


@dataclass(frozen=True)
class StorageLimit:
    """Raw sequential bandwidth of one directory's storage, bytes per second."""

    directory: str
    nbytes: int
    write_bps: float
    read_bps: float
    write_s: float
    read_s: float
    engine: str  # the engine actually used: "uring" or "threads"
    direct: bool  # False where the file system has no O_DIRECT (tmpfs): page-cache speed
    block: int = BLOCK
    depth: int = DEPTH
    # The mix curve, half the bytes read and half written as a step moves states, aggregate
    # bytes per second: both directions in flight at once (the pipeline's "mixed" schedule),
    # and alternating bursts of one direction ((burst bytes, bps) pairs: "phased"). 0 and ()
    # when not measured.
    mixed_bps: float = 0.0
    phased_bps: tuple = ()
    # What the ring itself drew (bytes read + written per second of a streamed step of fp32
    # states) under each schedule, phased in the curve's best turns: a disk may favour a
    # schedule for the probe's two streams and the other for the ring's requests (the H100's
    # NVMe: the probe's turns 1.1x its mix, the ring's 0.9x). 0 when not measured.
    ring_mixed_bps: float = 0.0
    ring_phased_bps: float = 0.0
    # The write bandwidth while the host's update runs back to back on the compute threads
    # over resident fp32 states: what a durable commit's background write gets while the next
    # steps update resident states (the H100 host's commits landed at ~0.85 of the plain
    # write figure). 0 when not measured.
    write_beside_update_bps: float = 0.0

    @property
    def sequential_bps(self) -> float:
        """Reading half then writing half at the one-direction rates: what a step would
        get if the directions took turns in long phases."""
        return 2 / (1 / self.read_bps + 1 / self.write_bps)

    @property
    def best_phased(self) -> tuple:
        """The burst with the highest aggregate bandwidth and that bandwidth ((0, 0.0): none)."""
        return max(self.phased_bps, key=lambda pair: pair[1], default=(0, 0.0))


@dataclass(frozen=True)
class HostCopy:
    """Host memory copy bandwidth (bytes copied per second, best of ``repeats``)."""

    nbytes: int
    bps: float
    seconds: float
    repeats: int


@dataclass(frozen=True)
class KernelThroughput:
    """One Adam update over ``numel`` in-memory params with the given dtypes."""

    numel: int
    grad: str
    param: str
    seconds: float
    params_per_s: float
    state_dtype: str = "fp32"
    threads: int = 1
    master: str = "fp32"

    @property
    def state_bps(self) -> float:
        """Optimizer-state bytes the kernel gets through per second (read + written per
        param: 24 with fp32 states, ~12 with int8, ~8 with int8 and a split master, ~6 int4
        and split): compare with the storage bandwidth to see which one limits."""
        return self.params_per_s * 2 * model.state_bytes_per_param(self.state_dtype, self.master)


@dataclass(frozen=True)
class MemoryBandwidth:
    """STREAM's triad (a = b + q * c over fp32 arrays of ``nbytes`` together) on
    ``threads`` threads: bytes moved per second, the best pass."""

    nbytes: int
    threads: int
    bps: float
    seconds: float


def engine_in_use(directory: str, engine: str = "auto") -> str:
    """The storage engine ``engine`` resolves to here (``uring`` or ``threads``): ``auto``
    falls back to threads when io_uring is not built or refused at run time."""
    # A throwaway Pipeline resolves the engine exactly as the core does.
    from smartinf.pipeline.pipeline import Pipeline

    scratch = tempfile.mkdtemp(prefix=".smartinf-probe-engine-", dir=directory)
    try:
        with Pipeline(scratch, chunk=1024, slots=1, io=engine) as pipe:
            return pipe.engine
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def supports_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` (tmpfs cannot: there
    the engines fall back to buffered I/O and the probe measures the page cache)."""
    fd, path = tempfile.mkstemp(prefix=".smartinf-probe-direct-", dir=directory)
    os.close(fd)
    try:
        os.close(os.open(path, os.O_RDWR | os.O_DIRECT))
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.remove(path)


def _check_directory(directory: str, nbytes: int) -> str:
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.exists(directory):
        raise FileNotFoundError(errno.ENOENT, "probe directory does not exist", directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, "probe path is not a directory", directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "probe directory is not writable", directory)
    usage = shutil.disk_usage(directory)
    free = usage.free
    if usage.total and free < nbytes:  # ramfs reports no size at all: nothing to check
        raise OSError(errno.ENOSPC, f"probe needs {nbytes / GiB:.2f} GiB free, "
                      f"{free / GiB:.2f} GiB left (use a smaller size)", directory)
    return directory


def measure_storage(directory: str, nbytes: int = GiB, engine: str = "auto",
                    repeats: int = 1, mix: bool = True,
                    mix_bursts: Sequence[int] = MIX_BURSTS, ring: bool = False,
                    update_numel: int = 0, depth: Optional[int] = None) -> StorageLimit:
    """Writes then reads back ``nbytes`` of ``DIR/.smartinf-probe-<pid>.bin`` with O_DIRECT
    through the storage engine (1 MiB requests, ``depth`` in flight; None: the pipeline's
    queue depth, ``SMARTINF_QUEUE_DEPTH``); the file is removed after.
    With ``repeats`` > 1 the write+read pair is repeated and the fastest of each kept
    (the highest bandwidth gives the smallest limit, so a ratio to it is never flattered).
    With ``mix``, also the mix curve over the same file (half read, half written): both
    directions at once, and bursts of one direction (``mix_bursts``, whole blocks, those up
    to half the file). With ``ring`` (and ``mix``), also what the ring draws under each
    schedule (``measure_ring``: ``nbytes`` of states, twice that free). With
    ``update_numel``, also the write while the host's update over that many resident
    params runs on the compute threads (``write_beside_update_bps``; best of ``repeats``).

    Raises ``OSError`` naming the directory when it is missing, not writable or too full.
    """
    if engine not in defaults.IO_ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(defaults.IO_ENGINES)}")
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    depth = defaults.queue_depth() if depth is None else depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if any(b <= 0 or b % BLOCK for b in mix_bursts):
        raise ValueError(f"mix_bursts must be positive multiples of {BLOCK}, got {list(mix_bursts)}")
    nbytes = -(-int(nbytes) // BLOCK) * BLOCK  # whole blocks: O_DIRECT needs aligned lengths
    directory = _check_directory(directory, nbytes * (2 if ring and mix else 1))
    used = engine_in_use(directory, engine)
    path = os.path.join(directory, f".smartinf-probe-{os.getpid()}.bin")
    try:
        write_s = read_s = float("inf")
        mixed_s = beside_s = float("inf")
        phased_s = {b: float("inf") for b in mix_bursts if b <= nbytes // 2}
        for _ in range(repeats):
            write_s = min(write_s, _native.time_storage(path, nbytes, True, engine, BLOCK, depth))
            read_s = min(read_s, _native.time_storage(path, nbytes, False, engine, BLOCK, depth))
            if mix:
                mixed_s = min(mixed_s, _native.time_mixed_storage(path, nbytes, engine, BLOCK, depth, 0))
                for burst in phased_s:
                    phased_s[burst] = min(phased_s[burst], _native.time_mixed_storage(
                        path, nbytes, engine, BLOCK, depth, burst))
            if update_numel:
                beside_s = min(beside_s, _native.time_storage_beside_update(
                    path, nbytes, engine, BLOCK, depth, update_numel, buffers.dtype_code("bfloat16"),
                    buffers.dtype_code("bfloat16"), "fp32", _native.default_compute_threads()))
    finally:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    limit = StorageLimit(directory, nbytes, nbytes / write_s, nbytes / read_s,
                         write_s, read_s, used, supports_direct_io(directory), depth=depth,
                         mixed_bps=nbytes / mixed_s if mix else 0.0,
                         phased_bps=tuple((b, nbytes / t) for b, t in phased_s.items()) if mix else (),
                         write_beside_update_bps=nbytes / beside_s if update_numel else 0.0)
    if ring and mix:
        limit = dataclasses.replace(limit, **measure_ring(directory, nbytes, limit))
    if not limit.direct:
        logger.warning("%s has no O_DIRECT (tmpfs?): measured buffered I/O, i.e. memory "
                       "speed, not a storage limit", directory)
    logger.info("storage %s: write %.2f GB/s, read %.2f GB/s (%s, %d MiB)", directory,
                limit.write_bps / 1e9, limit.read_bps / 1e9, used, nbytes // MiB)
    return limit


def measure_ring(directory: str, nbytes: int, curve: StorageLimit,
                 steps: int = RING_STEPS) -> dict:
    """What the ring draws from ``directory`` under each schedule: a Pipeline streaming
    ``nbytes`` of fp32 AdamW states (bf16 params) in 8 sub-groups sent two at a time (as
    the DeepSpeed front-end does), the schedules' steps alternating (the disk drifts),
    after one step each to warm up; the best of ``steps``, as bytes read + written over the
    step. Phased runs in the turns of the curve's best burst, which auto would choose.
    Returns ``ring_mixed_bps`` and ``ring_phased_bps``."""
    burst, _ = curve.best_phased
    params = max(1, nbytes // model.STATE_BYTES)
    subgroups = min(8, params)
    sizes = [params // subgroups + (i < params % subgroups) for i in range(subgroups)]
    grads = [torch.full((max(sizes),), 1e-3, dtype=torch.bfloat16) for _ in range(2)]
    outs = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    root = tempfile.mkdtemp(prefix=".smartinf-ring-", dir=directory)
    try:
        # auto in a directory whose record holds the one burst: the ring takes the turns
        # auto takes where the record favours them (no burst measured: the ring's default).
        if burst:
            io_schedule.record(root, {"mixed_bps": 1.0, "phased_bps": [[burst, 2.0]]})
        with contextlib.ExitStack() as pipelines:
            pipes = {}
            for schedule, setting in (("mixed", "mixed"), ("phased", "auto" if burst else "phased")):
                pipes[schedule] = pipelines.enter_context(Pipeline(
                    os.path.join(root, schedule), AdamW(lr=1e-4), io_schedule=setting,
                    if_exists="overwrite"))
                for n in sizes:
                    pipes[schedule].add_subgroup(n)
            best = {schedule: 0.0 for schedule in pipes}
            for step in range(1 + steps):
                for schedule, pipe in pipes.items():
                    bps = ring_step(pipe, sizes, grads, outs)["disk_bps"]
                    if step:
                        best[schedule] = max(best[schedule], bps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"ring_mixed_bps": best["mixed"], "ring_phased_bps": best["phased"]}


def ring_step(pipe: Pipeline, sizes: Sequence[int], grads: Sequence[torch.Tensor],
              outs: Sequence[torch.Tensor]) -> dict:
    """One step of ``pipe`` over its sub-groups of ``sizes``, two in flight as the DeepSpeed
    front-end sends them (each of the two gradient buffers reused when its last update is
    done): the step's ``pipe.stats`` counters, ``step_s`` and ``disk_bps`` (bytes read +
    written per second)."""
    before, start = pipe.stats, time.perf_counter()
    pending = [None, None]
    with pipe.step():
        for sg, n in enumerate(sizes):
            if pending[sg % 2] is not None:
                pending[sg % 2].wait()
            pending[sg % 2] = pipe.update(sg, grads[sg % 2][:n], outs[sg])
    seconds = time.perf_counter() - start
    after = pipe.stats
    step = {k: after[k] - before.get(k, 0) for k in after}
    return dict(step, step_s=seconds, disk_bps=(step["storage_read"] + step["storage_write"]) / seconds)


def measure_host_copy(nbytes: int = HOST_COPY_BYTES, repeats: int = 3) -> HostCopy:
    """Host memory copy bandwidth: ``np.copyto`` of ``nbytes``, best of ``repeats``."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    dst.fill(1)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return HostCopy(nbytes, nbytes / best, best, repeats)


def measure_kernel(numel: int = KERNEL_NUMEL, grad: str = "float32",
                   param: str = "float32", state_dtype: str = "fp32",
                   threads: int = 1, master: str = "fp32") -> KernelThroughput:
    """Adam kernel throughput for one grad/param dtype pair (dtype names or codes), state
    dtype and master format (split: bf16 params) on ``threads`` threads (0: the pipeline's
    default, ``_native.default_compute_threads()``): one update warms up (threads, page
    faults), the best of three more is kept (one short update on many threads is noisy)."""
    g, p = buffers.dtype_code(grad), buffers.dtype_code(param)
    threads = threads or _native.default_compute_threads()
    seconds = _native.time_kernel(numel, g, p, state_dtype, threads, master)
    return KernelThroughput(numel, buffers.DTYPE_NAMES[g], buffers.DTYPE_NAMES[p], seconds,
                            numel / seconds, state_dtype, threads, master)


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def measure_triad(nbytes: int = TRIAD_BYTES, threads: int = 0, repeats: int = 3) -> MemoryBandwidth:
    """Host memory bandwidth as STREAM's triad measures it, on ``threads`` threads (0: the
    usable cores), best of ``repeats`` (as STREAM reports): the limit of a memory-bound
    update over resident states."""
    threads = threads or usable_cores()
    seconds = min(_native.triad_seconds(nbytes, threads) for _ in range(repeats))
    return MemoryBandwidth(nbytes // 12 * 12, threads, nbytes // 12 * 12 / seconds, seconds)


def probe(dirs: Optional[Sequence[str]] = None, nbytes: int = GiB, engine: str = "auto",
          repeats: int = 1, kernel_numel: int = KERNEL_NUMEL,
          host_copy_bytes: int = HOST_COPY_BYTES, ring: bool = False) -> dict:
    """Everything ``python -m smartinf.probe`` reports, as a JSON-ready dict (with
    ``ring``, what the ring draws from each directory under each schedule)."""
    dirs = [tempfile.gettempdir()] if not dirs else list(dirs)
    # On the usable cores, each thread's part far beyond the caches: a step's states are
    # (16 Mi params on 14 threads of the H100 host, in its L3 in part, read 1.5-1.7x fast).
    parallel_numel = kernel_numel * max(1, _native.default_compute_threads() // 2)
    storage = [measure_storage(d, nbytes, engine, repeats, ring=ring, update_numel=parallel_numel)
               for d in dirs]
    gpu = measure_gpu()
    return {
        "build": build_info(),
        "engine_requested": engine,
        "repeats": repeats,
        "storage": [dataclasses.asdict(s) for s in storage],
        "host_copy": dataclasses.asdict(measure_host_copy(host_copy_bytes)),
        "kernel": [dict(dataclasses.asdict(k), state_bps=k.state_bps)
                   for k in [*(measure_kernel(kernel_numel, g, p) for g, p in KERNEL_DTYPES),
                             measure_kernel(kernel_numel, "float32", "float16", "int8"),
                             measure_kernel(parallel_numel, "bfloat16", "bfloat16", threads=0),
                             measure_kernel(parallel_numel, "bfloat16", "bfloat16", "int8", 0),
                             measure_kernel(parallel_numel, "bfloat16", "bfloat16", "int8", 0, "split"),
                             measure_kernel(parallel_numel, "bfloat16", "bfloat16", "int4", 0),
                             measure_kernel(parallel_numel, "bfloat16", "bfloat16", "int4", 0, "split")]],
        "triad": dataclasses.asdict(measure_triad()),
        "smartssd": smartssds(),
        "gpu": gpu and dataclasses.asdict(gpu),
    }
