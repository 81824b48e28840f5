"""Which I/O schedule a device's ring runs on its storage, and why.

A step reads every streamed state and writes it back. The ring can keep reads and
write-backs in flight together (``mixed``) or let them take turns in bursts of one
direction (``phased``, ``pipeline/io_phases.h``). Many NVMe drives (and virtual disks)
lose bandwidth on a mixed stream; others do not, so the right choice is a property of the
device: ``python -m smartinf.probe DIR --record`` measures the mix curve there and what
the ring itself draws under each schedule, and records them in
``DIR/.smartinf-probe.json``; ``io_schedule="auto"`` (the default) reads the record of a
device's directory or of the nearest directory above it on the same file system (a run's
``rank<R>`` directories share the record of the directory the probe measured).
Neither schedule changes a bit of the results, only the order of the requests.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

RECORD = ".smartinf-probe.json"
#: phased is chosen where its best burst beats mixed by more than this (a measurement's noise).
MARGIN = 1.05


@dataclass(frozen=True)
class Choice:
    schedule: str  # mixed | phased
    reason: str
    bps: float = 0.0  # the record's aggregate for a step's half-read, half-written traffic
                      # under this schedule: the ring's where measured (0: not measured)
    burst: int = 0  # phased: bytes of one direction per turn, the probe's best (0: default)


def record(directory: str, storage: dict) -> str:
    """Writes the probe's storage figures of ``directory`` (``StorageLimit`` as a dict, and
    the host's figures ``smartinf.planning.twins`` reads) to its record, atomically; returns the
    record's path."""
    path = os.path.join(directory, RECORD)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(storage, f, indent=1)
    os.replace(tmp, path)
    return path


def from_figures(storage: dict) -> Choice:
    """The schedule the record favours: where it holds what the ring drew under each
    (``probe --record``), phased where its turns beat the mix by more than ``MARGIN``;
    else the same test on the probe's mix curve (its best burst against both directions
    at once). Phased runs in the curve's best burst either way."""
    mixed = storage.get("mixed_bps") or 0.0
    burst, phased = max(_curve(storage), key=lambda figure: figure[1], default=(0, 0.0))
    ring_mixed, ring_phased = _ring(storage)
    if ring_mixed and ring_phased:
        figures = (f"the ring drew phased {ring_phased / 1e9:.2f} GB/s"
                   + (f" in {burst >> 20} MiB turns" if burst else "")
                   + f", mixed {ring_mixed / 1e9:.2f} GB/s")
        if ring_phased > MARGIN * ring_mixed:
            return Choice("phased", figures, ring_phased, burst)
        return Choice("mixed", figures, ring_mixed)
    if not mixed or not phased:
        return Choice("mixed", "the record has no mix curve", mixed)
    figures = (f"phased {phased / 1e9:.2f} GB/s in {burst >> 20} MiB turns, "
               f"mixed {mixed / 1e9:.2f} GB/s")
    if phased > MARGIN * mixed:
        return Choice("phased", f"the probe measured {figures}", phased, burst)
    return Choice("mixed", f"the probe measured {figures}", mixed)


def drawn_bps(storage: dict, schedule: str) -> float:
    """The record's aggregate for a step's half-read, half-written traffic under
    ``schedule``: what the ring drew where the probe timed it, else the mix curve's (its
    best burst for phased); 0 where the record has neither."""
    ring = dict(zip(("mixed", "phased"), _ring(storage)))[schedule]
    if ring:
        return ring
    if schedule == "mixed":
        return float(storage.get("mixed_bps") or 0.0)
    return max((bps for _, bps in _curve(storage)), default=0.0)


def _curve(storage: dict) -> list[tuple[int, float]]:
    """The probe's phased curve: (burst bytes, aggregate bps) pairs."""
    curve = [(int(b), float(bps)) for b, bps in storage.get("phased_bps") or ()]
    if any(b <= 0 or bps < 0 for b, bps in curve):
        raise ValueError(f"phased_bps holds a burst or a bandwidth out of range: {curve}")
    return curve


def _ring(storage: dict) -> tuple[float, float]:
    """What the ring drew, mixed and phased (0: not timed)."""
    ring_mixed, ring_phased = (float(storage.get(k) or 0.0) for k in ("ring_mixed_bps", "ring_phased_bps"))
    if not (ring_mixed >= 0 and ring_phased >= 0):  # NaN too
        raise ValueError(f"the ring's figures are out of range: mixed {ring_mixed}, phased {ring_phased}")
    return ring_mixed, ring_phased


def find_record(directory: str) -> str | None:
    """The record of ``directory``, else of the nearest directory above it on the same file
    system; None when there is none."""
    here = os.path.abspath(directory)
    device = os.stat(here).st_dev
    while True:
        path = os.path.join(here, RECORD)
        if os.path.exists(path):
            return path
        parent = os.path.dirname(here)
        if parent == here or os.stat(parent).st_dev != device:
            return None
        here = parent


def choose(setting: str, directory: str) -> Choice:
    """The schedule for a device in ``directory`` under ``setting`` (auto, mixed, phased)."""
    if setting != "auto":
        return Choice(setting, "as requested")
    path = find_record(directory)
    if path is None:
        return Choice("mixed", f"no probe record in {directory} or above it (python -m "
                               f"smartinf.probe {directory} --record measures one)")
    instead = "pass io_schedule='mixed' or 'phased'"
    figures = load_record(path, instead)
    try:
        return from_figures(figures)
    except (ValueError, TypeError, AttributeError) as e:
        raise not_a_record(path, e, instead) from e


def load_record(path: str, instead: str) -> dict:
    """The figures of the record at ``path``; where it is not one, a ValueError naming it
    and what to do (``instead``: how to go without it)."""
    try:
        with open(path) as f:
            figures = json.load(f)
    except (OSError, ValueError) as e:
        raise not_a_record(path, e, instead) from e
    if not isinstance(figures, dict):
        raise not_a_record(path, f"a JSON {type(figures).__name__}, not an object", instead)
    return figures


def not_a_record(path: str, why: object, instead: str) -> ValueError:
    return ValueError(f"{path} is not a probe record ({why}): run python -m smartinf.probe "
                      f"{os.path.dirname(path)} --record again, or {instead}")
