"""What a pipeline will take, checked before it takes it: the bytes its states files grow by
on each file system and the host memory its budgets hold. A refusal names what is needed,
what is free, and what would fit, before the first byte is written (a 13 B model's states
had filled a disk for minutes before the first step, then failed). Ranks of one host that
open their pipelines at once are checked together (``ranks_opening``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
from typing import Iterator, Optional, Sequence



def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _count(params: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g} {unit}"
    return f"{params:.0f}"
#: (state_dtype, master) formats a refusal offers, fewest bytes last
FORMATS = (("fp32", "fp32"), ("int8", "fp32"), ("int8", "split"), ("int4", "split"))


def available_memory() -> int:
    """Bytes of host memory the kernel can give without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


#: (ranks, available bytes) while ``ranks_opening`` holds
_opening: Optional[tuple[int, int]] = None


@contextlib.contextmanager
def ranks_opening(ranks: int, available: int) -> Iterator[None]:
    """Within: ``ranks`` processes of this host open their pipelines at once, each for about
    as much host memory as this one, from ``available`` bytes (the least any of them
    measured before any took some): ``check_memory`` counts a need ``ranks`` times. Each
    rank's check alone passes where together they exceed the host: four ranks at the 65B
    shape each asked 74 GB with about 250 GB available, and were killed for memory at 539 GB
    of the host's 540."""
    global _opening
    before, _opening = _opening, (ranks, available)
    try:
        yield
    finally:
        _opening = before


def check_memory(needed: int, what: str) -> None:
    """Refuses ``needed`` bytes of host memory held from creation (``what`` they are for)
    where the host has fewer available (``ranks_opening``: for as many ranks as open at
    once): a setting the machine cannot give (``ValueError``), found before the memory is
    touched."""
    ranks, free = _opening or (1, available_memory())
    if needed * ranks > free:
        together = f", and {ranks} ranks of this host open as much at once" if ranks > 1 else ""
        raise ValueError(f"{what} holds {_size(needed)} of host memory from creation{together}; "
                         f"{_size(free)} is available: give a memory_budget of at most "
                         f"{_size(free // ranks)} in all{' a rank' if ranks > 1 else ''} (the "
                         f"rest of the states stream from storage)")


@dataclasses.dataclass(frozen=True)
class Planned:
    """What a pipeline's commits will write beside the states' growth: its sub-groups
    (``sizes``, params each, every one it will hold) in ``chunk``-param chunks of ``arrays``
    arrays; with a log, their gradients of ``gradient_bytes`` a param and ``slots`` slots' spare
    extents; ``split``: a split master would run (bf16 params); ``resident``: the bytes its
    memory budgets hold (one copy runs only with every sub-group resident)."""
    sizes: Sequence[int]
    chunk: int
    arrays: int = 3
    gradient_bytes: int = 4
    slots: int = 4
    split: bool = False
    resident: int = 0


#: A manifest's most (store/manifest.cc ``serialize``): its header (hyper-parameters and
#: membership), a sub-group's lines (``sg``, its fingerprint, its sums' prefixes), and a
#: chunk's 17-character fields (its two copies' sums; with a log, where its version is).
MANIFEST_HEAD, MANIFEST_PER_SUBGROUP, MANIFEST_PER_CHUNK = 1024, 288, 17
#: A log's files beside its gradients (store/step_log.cc): grads.bin's header, each
#: gradient's region rounded up, and the journal's record of each chunk a step rewrites.
LOG_HEADER, LOG_REGION_ALIGN, JOURNAL_RECORD = 1 << 20, 4096, 40


def _blocks(nbytes: float, block: int) -> int:
    return int(-(-nbytes // block) * block)


def commit_bytes(planned: Planned, log: bool, block: int) -> int:
    """Bytes a directory's commits write beyond its states file's growth, in ``block``-byte
    blocks: the new manifest (``manifest.tmp``, written while the old one is still there),
    and with a log grads.bin's header and regions' rounding and the journal."""
    chunks = sum(-(-n // planned.chunk) for n in planned.sizes)
    manifest = MANIFEST_HEAD + MANIFEST_PER_SUBGROUP * len(planned.sizes) + \
        MANIFEST_PER_CHUNK * (3 if log else 2) * chunks
    logs = LOG_HEADER + LOG_REGION_ALIGN * len(planned.sizes) + \
        _blocks(JOURNAL_RECORD * chunks, block) if log else 0
    return _blocks(manifest, block) + logs


def _extent_tree(grow: int, block: int) -> int:
    """ext4's own bytes for ``grow`` bytes allocated: an extent maps at most 32768 blocks and
    the inode holds 4; beyond, an index block per 340 extents."""
    extents = -(-grow // (32768 * block))
    return 0 if extents <= 4 else block * -(-extents // 340)


def _allocated(path: str) -> int:
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def held_bytes(directory: str, arrays: int) -> int:
    """Bytes ``directory``'s files hold already that its growth takes again, so a reopen
    does not count them: its states file's beyond the extents its manifest records (a run
    stopped before its first durable commit recorded none), a log's gradients and journal
    (each step writes them over). 0 where the manifest is unreadable."""
    from smartinf import _native
    from smartinf.pipeline.checkpoint import LOG_FILES, MANIFEST, STATES
    try:
        with open(os.path.join(directory, MANIFEST), errors="replace") as f:
            lines = [line.split() for line in f if line.strip()]
        fields = {w[0]: w[1:] for w in lines}
        chunk, copies = int(fields["chunk"][0]), int(fields["copies"][0])
        dtype, master, log = fields["state_dtype"][0], fields["master"][0], "log" in fields
        extent = _native.copy_bytes(dtype, master, chunk, chunk, arrays)
        ends = [int(w[3]) + (-(-int(w[2]) // chunk) * extent if log else
                             copies * _native.copy_bytes(dtype, master, chunk, int(w[2]), arrays))
                for w in lines if w[0] == "sg"]
        if log and ends:
            ends.append(int(fields["spares"][0]) + int(fields["spares"][1]) * extent)
    except (OSError, KeyError, IndexError, ValueError):
        return 0
    logs = sum(_allocated(os.path.join(directory, name)) for name in LOG_FILES) if log else 0
    return max(0, _allocated(os.path.join(directory, STATES)) - max(ends, default=0)) + logs


def check_opening(directories: Sequence[str], held: "set | frozenset") -> None:
    """Refuses opening ``directories`` where their file system cannot hold what the open
    writes before ``check_disk`` can run (store/state_store.cc): a new directory's lock and
    manifest, one that holds a run (in ``held``) its next manifest beside the current one.
    The core's own error named no bytes ("cannot write the manifest") and left files."""
    from smartinf.pipeline.checkpoint import MANIFEST
    need: dict[int, list] = {}
    for path in directories:
        block = os.statvfs(path).f_frsize
        nbytes = _blocks(os.path.getsize(os.path.join(path, MANIFEST)), block) if path in held \
            else 2 * block
        entry = need.setdefault(os.stat(path).st_dev, [0, []])
        entry[0] += nbytes
        entry[1].append(path)
    for total, paths in need.values():
        free = shutil.disk_usage(paths[0]).free
        if total > free and _sized(paths[0]):
            needed, has = _apart(total, free)
            raise OSError(errno.ENOSPC, f"opening {', '.join(paths)} writes a lock and a manifest "
                                        f"there first: {needed}, and that file system has {has} "
                                        f"free; free some space there, or use another directory")


def _sized(path: str) -> bool:
    """Whether ``path``'s file system reports its size: ramfs (and some FUSE ones) report 0
    blocks and 0 free whatever they hold, so nothing can be checked there."""
    return os.statvfs(path).f_blocks > 0


def _apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` as sizes, in bytes where rounded ones would read the same."""
    return (_size(a), _size(b)) if _size(a) != _size(b) else (f"{a:,.0f} B", f"{b:,.0f} B")


def check_disk(directories: Sequence[str], grow: Sequence[int], params: int,
               state_dtype: str, master: str, copies: "int | str", planned: Planned) -> None:
    """Refuses states files growing by ``grow`` bytes in ``directories`` (one each), and what
    their commits write (``commit_bytes``), where their file system has less free, less what
    the directories hold already (``held_bytes``); ``params``, ``state_dtype``, ``master``,
    ``copies`` and ``planned`` say what would fit instead (each offer one that runs)."""
    need: dict[int, list] = {}
    for path, nbytes in zip(directories, grow):
        block = os.statvfs(path).f_frsize
        overhead = commit_bytes(planned, copies == "log", block) + _extent_tree(nbytes, block)
        held = held_bytes(path, planned.arrays)
        entry = need.setdefault(os.stat(path).st_dev, [0, 0, 0, []])
        entry[0] += max(0, nbytes + overhead - held)
        entry[1] += nbytes
        entry[2] += overhead - held
        entry[3].append(path)
    for total, states, beside, paths in need.values():
        free = shutil.disk_usage(paths[0]).free
        if total <= free or not _sized(paths[0]):
            continue
        raise OSError(errno.ENOSPC, _too_small(total, states, beside, free, paths, params,
                                               state_dtype, master, copies, planned))


def _too_small(total: int, states: int, beside: int, free: int, paths: list, params: int,
               state_dtype: str, master: str, copies: "int | str", planned: Planned) -> str:
    """The refusal: what is needed and free, and what would fit (each offer one that runs)."""
    from smartinf import _native
    from smartinf.planning.model import state_bytes_per_param  # the layout's bytes per param
    per_param = states / max(params, 1)
    ours = state_bytes_per_param(state_dtype, master)
    formats = [(d, m) for d, m in FORMATS if m == "fp32" or planned.split]
    scaled = {f: per_param * state_bytes_per_param(*f) / ours * params for f in formats}
    fits = [f"state_dtype={d!r}, master={m!r}: {_size(b + beside)}" for (d, m), b in scaled.items()
            if b + beside <= free and (d, m) != (state_dtype, master)]
    one = states / 2 if copies == 2 else states
    if copies == 2 and one + beside <= free:
        budget = "" if planned.resident >= one else \
            f": a memory_budget of about {_size(one / len(paths))} a device or more"
        if planned.resident >= one or one <= available_memory():
            fits.insert(0, f"copies=1 (every sub-group resident{budget}; written in place at "
                           f"durable commits: a crash during one loses the states): "
                           f"{_size(one + beside)}")
    if copies == 2 and master == "fp32":
        log = _log_bytes(state_dtype, master, planned, len(paths))
        if log <= free:
            fits.insert(0, f"copies='log' (every instant recoverable; durable every step, "
                           f"streamed, overlap off): {_size(log)}: one copy, a step's logged "
                           f"gradients and {2 * planned.slots} spare extents")
    what = {2: ("two copies of its", "the committed one and the one a step writes"),
            "log": ("one copy of its", "with spare extents and a step's logged gradients")
            }.get(copies, ("one copy of its", "written in place"))
    smallest = formats[-1]
    needed, has = _apart(total, free)
    return (f"the states of {_count(params)} params need {_size(states)} in {', '.join(paths)} "
            f"({per_param:.1f} B a param: {what[0]} state_dtype={state_dtype!r}, "
            f"master={master!r} states, {what[1]}) and their commits {_size(beside)} more "
            f"(the manifest{' and the log' if copies == 'log' else ''}, less what the "
            f"directories hold already): {needed}, and that file system has {has} free. " + (f"What would fit: {'; '.join(fits)}; or another directory." if fits else
                         f"No state format fits: at most "
                         f"{_count(max(0, free - beside) / scaled[smallest] * params)} params would, "
                         f"with the smallest (state_dtype={smallest[0]!r}, master={smallest[1]!r}); "
                         f"or another directory."))


def _log_bytes(state_dtype: str, master: str, planned: Planned, directories: int) -> int:
    """Bytes a log's directories take (``copies='log'``): one copy in full-chunk extents,
    each directory's spare extents, a step's gradients, and its commits' files."""
    from smartinf import _native
    extent = _native.copy_bytes(state_dtype, master, planned.chunk, planned.chunk, planned.arrays)
    chunks = sum(-(-n // planned.chunk) for n in planned.sizes)
    return chunks * extent + directories * (2 * planned.slots * extent + commit_bytes(planned, True, 4096)) + \
        planned.gradient_bytes * sum(planned.sizes)


def forget_new_directory(path: str) -> None:
    """Removes the files a refused pipeline's open made in ``path`` (it held no run before):
    the directory is as it was found, so another format can be tried there."""
    from smartinf.pipeline.checkpoint import LOG_FILES, MANIFEST, STATES
    for name in (MANIFEST, STATES, "lock", *LOG_FILES):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass
