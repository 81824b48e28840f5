"""What a pipeline will take, checked before it takes it: the bytes its states files grow by
on each file system and the host memory its budgets hold. A refusal names what is needed,
what is free, and what would fit, before the first byte is written (a 13 B model's states
had filled a disk for minutes before the first step, then failed). Ranks of one host that
open their pipelines at once are checked together (``ranks_opening``).
"""
from __future__ import annotations

import contextlib
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


def check_disk(directories: Sequence[str], grow: Sequence[int], params: int,
               state_dtype: str, master: str, copies: int = 2) -> None:
    """Refuses states files growing by ``grow`` bytes in ``directories`` (one each) where
    their file system has less free; ``params``, ``state_dtype``, ``master`` and ``copies``
    say what would fit instead."""
    from smartinf.planning.model import state_bytes_per_param  # the layout's bytes per param
    need: dict[int, tuple[int, list[str]]] = {}
    for path, nbytes in zip(directories, grow):
        device = os.stat(path).st_dev
        total, paths = need.get(device, (0, []))
        need[device] = (total + nbytes, paths + [path])
    for total, paths in need.values():
        free = shutil.disk_usage(paths[0]).free
        if total <= free:
            continue
        per_param = total / max(params, 1)
        ours = state_bytes_per_param(state_dtype, master)
        scaled = {(d, m): per_param * state_bytes_per_param(d, m) / ours * params for d, m in FORMATS}
        fits = [f"state_dtype={d!r}, master={m!r}: {_size(b)}" for (d, m), b in scaled.items()
                if b <= free]
        if copies == 2 and total / 2 <= free:
            fits.insert(0, f"copies=1 (every sub-group resident, written in place at durable "
                           f"commits: a crash during one loses the states): {_size(total / 2)}")
        if copies == 2 and master == "fp32" and total / 2 + 2 * params <= free:
            fits.insert(0, f"copies='log' (every instant recoverable; streamed, overlap off): "
                           f"one copy, {_size(total / 2)}, a step's logged gradients "
                           f"({_size(2 * params)} in bf16, {_size(4 * params)} in fp32) and two "
                           f"spare extents a slot")
        what = {2: ("two copies of its", "the committed one and the one a step writes"),
                "log": ("one copy of its", "with spare extents and a step's logged gradients")
                }.get(copies, ("one copy of its", "written in place"))
        raise OSError(errno.ENOSPC,
                      f"the states of {_count(params)} params need {_size(total)} in "
                      f"{', '.join(paths)} ({per_param:.1f} B a param: {what[0]} "
                      f"state_dtype={state_dtype!r}, master={master!r} states, {what[1]}), and "
                      f"that file system has {_size(free)} free. "
                      + (f"What would fit: {'; '.join(fits)}; or another directory."
                         if fits else f"No state format fits: at most "
                         f"{_count(free / scaled[FORMATS[-1]] * params)} params would, with "
                         f"the smallest (state_dtype='int4', master='split'); or another "
                         f"directory."))


def forget_new_directory(path: str) -> None:
    """Removes the files a refused pipeline's open made in ``path`` (it held no run before):
    the directory is as it was found, so another format can be tried there."""
    from smartinf.pipeline.checkpoint import LOG_FILES, MANIFEST, STATES
    for name in (MANIFEST, STATES, "lock", *LOG_FILES):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass
