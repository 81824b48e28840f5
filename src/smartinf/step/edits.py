"""Edits between steps: a digest per sub-group of its params as the model holds them,
taken when a step puts them and compared at the next one, so that whatever the caller
writes into a param in between (clamped, pruned, rolled back, loaded by a framework; in
place, through ``.data`` or by a new ``.data``) becomes the master instead of being
overwritten by the stored one. Detected, not copied: a digest reads the params where they
are. (A split master needs none: its devices checksum the params sent in.)

The digest sees any change of bits: on the host XXH3-64 of each 256 KiB of each slice (the
extents' checksum), computed by every core at the check and, where the step copies the
params into the model, while copying them (``copy``: in cache); on a GPU the native kernel's
sums (``native_digests``, ``device/cuda_digest.cu``), one launch for every sub-group there,
reading each byte once where it lies (one changed 2-byte unit changes the plain sum; two,
cancelling there, the weighted one: the weights, a bijection of positions below 2^32, differ).
Where smartinf was built without CUDA, torch's integer
ops, which wrap and so are order-free, over the sub-group's bytes (its slices one after
another, copied together first). There rows of 4 KiB are multiplied
by a fixed int8 matrix of 8 columns (``torch._int_mm``, the tensor cores: 1.5 reads' time of
the bytes on an H200, where the sums of rows of 8 words took 3.2): a changed word changes
its row's eight exact sums, since each 8-byte block of the weights is nonsingular, and so
does a word moved within its row; the rows' sums are summed plain and under mixed 64-bit
weights of their positions. The last partial row, and fewer bytes than the matmul takes,
go by ``_words_digest``: position-weighted sums of the 64-bit words (any single changed word
changes the plain sum, and moving words between rows of 8 the weighted one), which is also
the whole digest where ``_int_mm`` does not run. (Matmuls slice by slice, without that
copy, were launch-bound: 1.30 ms for a GPT-2 XL sub-group of 48 slices, no less than the copy
and the sums of rows of 8 words had taken.) Small tensors on a GPU (up to ``SMALL`` bytes:
DeepSpeed's kept-whole params, hundreds a step) are digested together, a few kernels for all
of them (``digests``): each byte weighted by a mixed hash of its position in its tensor,
summed per tensor. What it cannot tell from no edit is an edit that writes the bits already
there: with a bf16/fp16 param over an fp32 master, writing the master's rounding keeps the
master (see ``merge``).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence, Union

import torch

from smartinf import _build_info, _native
from smartinf.step.rounding import round_to

logger = logging.getLogger("smartinf")

Digest = Union[int, torch.Tensor]  # a host int, or a 0-d int64 tensor on the params' GPU
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as a signed int64
_MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64)  # another (splitmix64's)
_ROW = 8  # words per row of the GPU digest's weighted sum
PIECE = 256 << 10  # bytes per XXH3 of the host digest: hashed in cache right after a copy
SMALL = 1 << 20  # bytes up to which a GPU tensor's digest is taken with the others' (digests)
MM_ROW = 4096  # bytes per row of the GPU digest's matmul
MM_LEAST_ROWS = 17  # the fewest rows torch._int_mm takes
_MM_WEIGHTS: dict = {}  # device -> the matmul's weights there (None: no torch._int_mm there)
_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def digest(parts: Sequence[torch.Tensor]) -> Digest:
    """The digest of flat tensors (one sub-group's slices of params, in order), computed
    where they live."""
    if parts[0].device.type == "cpu":
        return host_digests([parts])[0]
    if _native_takes(parts):
        return native_digests(parts[0].device, [parts])[0]
    raw = [t.detach().contiguous().view(-1).view(torch.uint8) for t in parts]
    b = raw[0] if len(raw) == 1 else torch.cat(raw)
    weights = mm_weights(b.device)
    return _words_digest(b) if weights is None else _matmul_digest(b, weights)


def host_digests(keys_parts: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """``digest`` of each key's host parts, all in one walk on every core (a walk a key left
    the cores waiting for each other at its end)."""
    held = [[t.detach().contiguous() for t in parts] for parts in keys_parts]  # (alive through it)
    sums = _native.walk_pieces([(0, t.data_ptr(), t.numel() * t.element_size())
                                for parts in held for t in parts], PIECE, _THREADS, hash=True)[1]
    out, at = [], 0
    for parts in held:
        out.append(fold(sums[at:at + len(parts)]))
        at += len(parts)
    return out


def digests(keys_parts: Sequence[Sequence[torch.Tensor]]) -> list:
    """``digest`` of each key's parts, the small ones on a GPU together (``SMALL``): what a
    key's digest is depends on its own parts only, never on the others in the call."""
    out: list = [None] * len(keys_parts)
    small: dict = {}
    native: dict = {}
    host = [i for i, parts in enumerate(keys_parts) if parts[0].device.type == "cpu"]
    for i, d in zip(host, host_digests([keys_parts[i] for i in host])):
        out[i] = d
    for i, parts in enumerate(keys_parts):
        if out[i] is not None:
            continue
        if parts[0].device.type != "cpu" and _native_takes(parts):
            native.setdefault(parts[0].device, []).append(i)
        elif parts[0].device.type != "cpu" and sum(t.numel() * t.element_size() for t in parts) <= SMALL:
            small.setdefault(parts[0].device, []).append(i)
        else:
            out[i] = digest(parts)
    for device, keys in native.items():
        for i, d in zip(keys, native_digests(device, [keys_parts[i] for i in keys])):
            out[i] = d
    for keys in small.values():
        raw = [t.detach().contiguous().view(-1).view(torch.uint8)
               for i in keys for t in keys_parts[i]]
        sizes = [sum(t.numel() * t.element_size() for t in keys_parts[i]) for i in keys]
        out_small = _small_digests(torch.cat(raw), sizes)
        for i, d in zip(keys, out_small.unbind()):
            out[i] = d
    return out


def _native_takes(parts: Sequence[torch.Tensor]) -> bool:
    """Whether the native GPU digest (``native_digests``) takes these GPU parts: smartinf built
    with CUDA, and elements of an even size (it sums 2-byte units). Decided by the dtype, never
    by where the parts are cut, so that a key's digest is one function of its bytes."""
    return _build_info.CUDA and all(t.element_size() % 2 == 0 for t in parts)


def native_digests(device: torch.device, keys_parts: Sequence[Sequence[torch.Tensor]]) -> list:
    """Each key's digest of its parts (tensors on ``device``, a GPU, of elements of an even
    size) by one launch of the native kernel (device/cuda_digest.cu) on the current stream:
    over the key's 2-byte units one after another, their plain sum and their sum weighted by a
    bijective hash of each unit's position, with the key's length (int64, wrapping). The parts
    are read where they lie, each byte once; the table of where they lie crosses to the GPU
    from page-locked memory, without waiting for the stream. 0-d int64 tensors, on ``device``."""
    chunk = _native.digest_chunk_units()
    rows, keep, lengths, first = [], [], [], 0
    for key, parts in enumerate(keys_parts):
        offset = 0
        for t in parts:
            if not t.is_contiguous():
                t = t.detach().contiguous()  # (kept until queued: the stream reads it after)
                keep.append(t)
            units = t.numel() * t.element_size() // 2
            if units:
                rows.append((t.data_ptr(), units, offset, key, first))
                first += -(-units // chunk)
                offset += units
        lengths.append(2 * offset)
    sums = torch.zeros(2 * len(keys_parts), dtype=torch.int64, device=device)
    if rows:
        table = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        _native.queue_gpu_unit_sums(table.data_ptr(), len(rows), first, sums.data_ptr(),
                                    device.index if device.index is not None else torch.cuda.current_device(),
                                    torch.cuda.current_stream(device).cuda_stream)
    plain, mixed = sums.view(-1, 2).unbind(1)
    if len(lengths) == 1:  # (a step's record of the sub-group it put: a scalar, no copy to make)
        length = lengths[0]
    else:
        length = torch.tensor(lengths, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    return list(((plain * _MIX + mixed) * _MIX + length).unbind())


def _small_digests(b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """For consecutive runs of ``sizes`` bytes of ``b`` (1-D uint8), each run's sum of its
    bytes and their sum weighted by a mixed hash of each byte's position in its run (a
    changed byte changes the first; moved ones, or changes that cancel in it, the second:
    the weights are not linear in the position), with its length: int64, wrapping."""
    device = b.device
    lengths = torch.tensor(sizes, device=device)  # one copy to the device
    ends = lengths.cumsum(0)
    starts = ends - lengths
    key = torch.repeat_interleave(torch.arange(len(sizes), device=device), lengths)
    weight = _mixed(torch.arange(b.numel(), device=device) - starts[key] + 1)
    value = b.to(torch.int64)
    plain, mixed = _run_sums(value, starts, ends), _run_sums(value * weight, starts, ends)
    return (plain * _MIX + mixed) * _MIX + lengths


def _run_sums(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each run's sum of ``x[start:end]`` (int64, wrapping) as a difference of one prefix
    sum: sums modulo 2**64 do not depend on the order of their additions, so these are
    ``index_add_``'s values, without its atomic adds to a few addresses on a GPU (two of
    them took 2.8 ms of a 7 B step's digest check on an H200, ``h200-j-7b-*``)."""
    prefix = torch.cat([x.new_zeros(1), x.cumsum(0)])
    return prefix[ends] - prefix[starts]


def fold(sums: Sequence[Sequence[int]]) -> int:
    """The host digest of parts from their pieces' checksums (``digest``, ``copy``)."""
    h = 0
    for part in sums:
        for x in (len(part), *part):
            h = (h * 0x100000001B3 + x) & ((1 << 64) - 1)
    return h


def copy(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    """Copies each pair's ``src`` into its ``dst`` (host tensors of one dtype, contiguous, of
    one size) on every core, and returns the checksums of each ``dst``'s pieces, as
    ``digest`` takes them (``fold``)."""
    return _native.walk_pieces([(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size())
                                for d, s in pairs], PIECE, _THREADS, hash=True)[1]


def _words_digest(b: torch.Tensor) -> torch.Tensor:
    """Position-weighted int64 sums of the bytes ``b`` (1-D uint8, contiguous) as words,
    counted from its first byte wherever it lies (one not 8-aligned is copied first)."""
    if b.data_ptr() % 8:
        b = b.clone()
    n = b.numel() // 8
    words = b[:8 * n].view(torch.int64)
    rows = n // _ROW
    loose = torch.cat([words[rows * _ROW:], b[8 * n:].to(torch.int64)])  # < 8 words, 8 bytes

    def weighted(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device)).sum()
    # the plain sum of the words from their rows' sums (wrapping: the same value), so that
    # the params are read once, not twice
    row_sums = words[:rows * _ROW].view(rows, _ROW).sum(1)
    h = (row_sums.sum() + words[rows * _ROW:].sum()) * _MIX + weighted(row_sums)
    return h * _MIX + weighted(loose) + b.numel()


def mm_weights(device: torch.device) -> Optional[torch.Tensor]:
    """The GPU digest's matmul weights on ``device``: ``MM_ROW`` x 8 int8, none zero, the same
    in every process (column-major, as ``torch._int_mm`` takes them); None where
    ``torch._int_mm`` does not run."""
    if device not in _MM_WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED)
        size = torch.randint(1, 128, (8, MM_ROW), generator=g, dtype=torch.int16)
        sign = torch.randint(0, 2, (8, MM_ROW), generator=g, dtype=torch.int16) * 2 - 1
        weights = (size * sign).to(torch.int8).to(device).t()
        try:
            probe = torch.zeros(MM_LEAST_ROWS, MM_ROW, dtype=torch.int8, device=device)
            torch._int_mm(probe, weights)
        except (RuntimeError, NotImplementedError, AttributeError):  # (an older GPU, or torch)
            weights = None
        _MM_WEIGHTS[device] = weights
    return _MM_WEIGHTS[device]


def _matmul_digest(b: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The digest of bytes ``b`` (1-D uint8, contiguous) on a GPU: its whole rows of ``MM_ROW``
    bytes times ``weights`` (int32 sums, exact: at most 4096 x 128 x 127), the rows' sums
    under mixed weights of their positions, the rest of the bytes by ``_words_digest``, and
    the length. A function of the bytes alone: ``b`` not 16-byte aligned (a cut param's
    slice) is copied first, for the matmul."""
    rows = b.numel() // MM_ROW
    if rows < MM_LEAST_ROWS:
        return _words_digest(b)
    if b.data_ptr() % 16:
        b = b.clone()
    sums = torch._int_mm(b[:rows * MM_ROW].view(torch.int8).view(rows, MM_ROW), weights)
    # (sum(o) * _MIX + sum(o * mixed)) * _MIX: one product with weights mixed + _MIX, kept
    h = (sums.view(-1) * _row_weights(sums.numel(), b.device)).sum() * _MIX + b.numel()
    if rows * MM_ROW < b.numel():
        h = h * _MIX + _words_digest(b[rows * MM_ROW:])
    return h


@functools.lru_cache(maxsize=16)  # (bounded: an odd size each time would not pile up)
def _row_weights(n: int, device: torch.device) -> torch.Tensor:
    """``_mixed(1..n) + _MIX`` on ``device`` (int64), made once per size: a step digests
    sub-groups of a few sizes."""
    return _mixed(torch.arange(1, n + 1, dtype=torch.int64, device=device)) + _MIX


def _mixed(positions: torch.Tensor) -> torch.Tensor:
    """A mixed hash of each of ``positions`` (int64, wrapping; splitmix64's constants): weights
    between which no small linear relation cancels, as position times a constant would."""
    weight = positions * _MIX
    return (weight ^ (weight >> 29)) * _MIX2


def merge(stored: torch.Tensor, held: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The new fp32 masters of params the caller edited: ``held`` (the params, as fp32)
    where they differ from ``stored`` rounded to their ``dtype``, else ``stored`` (an fp32
    param's master is the param; a bf16/fp16 one's keeps its low bits where untouched)."""
    if dtype == torch.float32:
        return held
    same = round_to(stored, dtype) == held.to(dtype)
    return torch.where(same, stored, held)


class ParamWatch:
    """The digests of what each sub-group's params held when the optimizer last put or
    took them; ``parts(key)`` gives a sub-group's flat param slices as they are now."""

    def __init__(self, parts: Callable[[Hashable], Sequence[torch.Tensor]]) -> None:
        self._parts = parts
        self._held: dict = {}
        self._warned = False  # the adoption said once at warning level

    def record(self, key: Hashable, pieces: Optional[Sequence[Sequence[int]]] = None) -> None:
        """The params of ``key`` are what the optimizer put (or took) now; ``pieces``: their
        parts' piece checksums, where ``copy`` put them (else read now)."""
        self._held[key] = digests([self._parts(key)])[0] if pieces is None else fold(pieces)

    def record_parts(self, key: Hashable, parts: Sequence[torch.Tensor]) -> None:
        """``record`` of ``key`` from ``parts`` given (what its parts will hold)."""
        self._held[key] = digests([parts])[0]

    def record_all(self, keys: Sequence[Hashable]) -> None:
        """``record`` of each of ``keys``, their digests taken together (``digests``)."""
        self._held.update(zip(keys, digests([self._parts(k) for k in keys])))

    def look(self, keys: Iterable[Hashable]) -> dict:
        """The digests of ``keys``' params as they are now (queued on their GPUs), for
        ``changed`` to compare later: taken early in a step, so the GPUs compute them while
        the host goes on."""
        keys = [k for k in keys if k in self._held]
        return dict(zip(keys, digests([self._parts(k) for k in keys])))

    def forget(self, keys: Iterable[Hashable]) -> None:
        """No record of ``keys`` (until ``record``)."""
        for k in keys:
            self._held.pop(k, None)

    def changed(self, keys: Iterable[Hashable], now: Optional[dict] = None,
                unrecorded: bool = False) -> list:
        """The sub-groups among ``keys`` whose params differ from the last record (one host
        sync per GPU); ``record`` them once the devices hold their edits. ``now``: ``look``'s
        digests of them, taken earlier in the step (nothing writes the params in between).
        ``unrecorded``: keys without a record count as changed (else they are skipped)."""
        keys = list(keys)
        fresh = [k for k in keys if k not in self._held] if unrecorded else []
        keys = [k for k in keys if k in self._held]
        now = now or {}
        missing = [k for k in keys if k not in now]  # (recorded since the look, or none taken)
        if missing:
            now = {**now, **self.look(missing)}
        same = {k: now[k] == self._held[k] for k in keys if not isinstance(now[k], torch.Tensor)}
        by_device: dict = {}
        for k in keys:
            if isinstance(now[k], torch.Tensor):
                by_device.setdefault(now[k].device, []).append(k)
        for device, on_gpu in by_device.items():  # one comparison and one sync per GPU
            held = torch.stack([torch.as_tensor(self._held[k], device=device) for k in on_gpu])
            flags = (torch.stack([now[k] for k in on_gpu]) == held).cpu().tolist()
            same.update(zip(on_gpu, flags))
        return fresh + [k for k in keys if not same[k]]

    def adopt(self, pipeline: Any, edited: Sequence[int],
              held: Callable[[int], tuple[torch.Tensor, torch.dtype]],
              speculation: Any = None) -> None:
        """The ``edited`` sub-groups' params become their masters (``merge``), as a step of
        their own on the devices (their optimizer states and step counts stay), and are
        recorded as held. ``held(sg)``: the params as the model holds them, as fp32 on the
        host, and their dtype. Updates ``speculation`` started from the stored masters are
        retracted first."""
        if speculation is not None:
            speculation.drop(edited)
        if edited:  # (none: a step of its own all the same, with the other ranks')
            (logger.debug if self._warned else logger.warning)(
                "the model's params of sub-groups %s changed since the optimizer put them (weights "
                "loaded or edited): they are the new master weights (said once at warning level)",
                list(edited))
            self._warned = True
        with pipeline.step():
            for sg in edited:
                states = pipeline.read_states(sg)
                stored = torch.from_numpy(states["param"])
                params, dtype = held(sg)
                stored.copy_(merge(stored, params, dtype))
                pipeline.write_states(sg, states, pipeline.subgroup_steps(sg))
        for sg in edited:
            self.record(sg)
