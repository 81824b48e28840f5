"""Whether a device's budget holds its resident sub-groups with their twins, and why.

A durable commit writes every resident sub-group's states. In the background (``overlap``,
the default) later steps go on meanwhile: a sub-group whose copy is being written is
updated in its twin, a second copy in the same budget. One without a twin waits for its
own write. Twins are given from what is left of a budget at a commit; a device that keeps
twins (``twins=True``) places a sub-group resident only with room for both, so no commit
ever holds an update, at the price of half the resident capacity.

For a GPU the price is small: a sub-group its budget cannot take is updated in host memory
instead. ``twins=None`` (a ``CudaDevice``'s default) lets ``smartinf.model.twins_pay``
weigh the two with the probe's figures (the host's update rate and the disk's write rate,
``python -m smartinf.probe DIR --record``), and keeps twins where there is no record.
Host memory (a ``CpuDevice``) keeps no twins by default: a sub-group its budget cannot take
streams from storage every step, which costs more than one write per commit interval.
Neither choice changes a bit of the results, only where states are held and when a step
waits for a write.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import io_schedule


@dataclass(frozen=True)
class Choice:
    twins: bool
    reason: str


def choose(device, state_dtype: str, master: str, commit_every: int, overlap: bool) -> Choice:
    """The choice for ``device`` (a CpuDevice, XrtDevice or CudaDevice) in a pipeline of
    these settings."""
    asked = getattr(device, "twins", False)
    if asked is not None:
        return Choice(bool(asked), "as requested" if asked else "the default: twins from what "
                      "is left of the budget at a commit")
    if not device.memory_budget:
        return Choice(False, "no memory budget: nothing resident")
    if not overlap:
        return Choice(False, "overlap=False: a durable commit is written before commit() returns")
    path = io_schedule.find_record(device.path)
    figures = _figures(path) if path else None
    if figures is None:
        return Choice(True, f"no probe record with the host's update rate in {device.path} or "
                            f"above it (python -m smartinf.probe DIR --record): twins, so that "
                            f"a durable commit's write never holds the GPU's updates")
    from . import model  # not at import: `python -m smartinf.model` runs it as __main__
    host_pps, write_bps = model.host_update_pps(figures, state_dtype, master), figures["write_bps"]
    state = model.state_bytes_per_param(state_dtype, master)
    pays = model.twins_pay(state, commit_every, host_pps, write_bps)
    return Choice(pays, f"{path}: the host updates {host_pps / 1e9:.2f} G params/s, the disk "
                        f"writes {write_bps / 1e9:.2f} GB/s; with commit_every={commit_every} "
                        + ("a twin costs less than its sub-group's wait for its write" if pays
                           else "a sub-group's wait for its write costs less than its twin"))


def _figures(path: str) -> dict | None:
    """The record's figures, if it holds the host's kernel rates (probes before these
    were recorded did not)."""
    try:
        with open(path) as f:
            figures = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a probe record ({e}): run python -m smartinf.probe "
                         f"DIR --record again, or pass twins=True or False") from e
    kernels = [k for k in figures.get("kernel", ()) if k.get("threads", 1) > 1]
    return figures if kernels and figures.get("write_bps") else None
