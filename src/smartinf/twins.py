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

import math
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
    rates = _recorded_rates(path, state_dtype, master) if path else None
    if rates is None:
        return Choice(True, f"no probe record with the host's update rate in {device.path} or "
                            f"above it (python -m smartinf.probe DIR --record): twins, so that "
                            f"a durable commit's write never holds the GPU's updates")
    from . import model  # not at import: `python -m smartinf.model` runs it as __main__
    host_pps, write_bps = rates
    state = model.state_bytes_per_param(state_dtype, master)
    pays = model.twins_pay(state, commit_every, host_pps, write_bps)
    return Choice(pays, f"{path}: the host updates {host_pps / 1e9:.2f} G params/s, the disk "
                        f"writes {write_bps / 1e9:.2f} GB/s; with commit_every={commit_every} "
                        + ("a twin costs less than its sub-group's wait for its write" if pays
                           else "a sub-group's wait for its write costs less than its twin"))


def _recorded_rates(path: str, state_dtype: str, master: str) -> tuple[float, float] | None:
    """The host's update rate on its usable cores and the disk's write rate from the record
    at ``path``; None where it holds no kernel rates (probes before they were recorded)."""
    from . import model
    instead = "pass twins=True or False"
    figures = io_schedule.load_record(path, instead)
    try:
        host_pps = model.host_update_pps(figures, state_dtype, master)
    except ValueError:  # no kernel timed on the usable cores
        return None
    except (KeyError, TypeError, AttributeError) as e:
        raise io_schedule.not_a_record(path, f"its kernel rates: {e!r}", instead) from e
    write_bps = figures.get("write_bps")
    for name, rate in (("params_per_s", host_pps), ("write_bps", write_bps)):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise io_schedule.not_a_record(path, f"{name} {rate!r} is not a positive rate", instead)
    return float(host_pps), float(write_bps)
