"""Whether a device's budget holds its resident sub-groups with their twins, and why.

A durable commit writes every resident sub-group's states. In the background (``overlap``,
the default) later steps go on meanwhile: a sub-group whose copy is being written is
updated in its twin, a second copy in the same budget. One without a twin waits for its
own write. Twins are given from what is left of a budget at a commit; a device that keeps
twins (``twins=True``) places a sub-group resident only with room for both, so no commit
ever holds an update, at the price of half the resident capacity.

For a GPU the price is small: a sub-group its budget cannot take is updated in host memory
instead. ``twins=None`` (a ``CudaDevice``'s default) lets the model weigh the two with the
probe's figures (``python -m smartinf.probe DIR --record`` on the GPU's machine): where the
caller says which sub-groups will come (``Pipeline(subgroup_sizes=...)``, as the front-ends
do) and the record has the GPU's and the host's figures, by ``placement.predict_placed`` of the
whole placement with twins and without (``placement.twins_win``: none only where faster by
more than ``placement.TWINS_TIE``; where the host's part or the disk bounds the step after a
commit anyway, the GPU's wait costs nothing and twins only capacity); else per byte of budget by ``placement.twins_pay`` (the
host's update rate against the disk's write rate). It keeps twins where there is no record.
Host memory (a ``CpuDevice``) keeps no twins by default: a sub-group its budget cannot take
streams from storage every step, which costs more than one write per commit interval.
A GPU's budget may instead have a host twin (``CudaDevice(twins="host")``): page-locked
host memory as large as the budget, into which a durable commit copies the resident states
and from which it writes them, so that no update waits and the budget keeps its whole
capacity. ``twins=None`` takes it wherever the host's available memory holds it
(``host_twin_fits``), before weighing twins in the budget.
Neither choice changes a bit of the results, only where states are held and when a step
waits for a write.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from smartinf import defaults
from smartinf.planning import io_schedule, model, placement, space


# How to go without a record that is not one.
INSTEAD = "pass twins=True or False"


@dataclass(frozen=True)
class Choice:
    twins: bool
    reason: str
    host: bool = False  # a host twin of a GPU's budget (CudaDevice twins="host")


def host_twin_fits(budget: int, other_host_bytes: float = 0) -> tuple[bool, str]:
    """Whether the host's available memory holds a host twin of a GPU budget of ``budget``
    bytes for every rank of this machine (``defaults.local_ranks``, each as large), beside the
    pipeline's ``other_host_bytes`` of host budgets (each rank's), with
    ``defaults.HOST_TWIN_SPARE_SHARE`` of the machine's memory left; and why."""
    ranks = defaults.local_ranks()
    need = int((budget + other_host_bytes) * ranks)
    spare = int(defaults.HOST_TWIN_SPARE_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    available = space.available_memory()
    fits = need + spare <= available
    return fits, (f"{'a' if fits else 'no'} host twin: {ranks} rank(s)' GPU budgets and other "
                  f"host budgets take {need / 1e9:.1f} GB of host memory with their twins, "
                  f"{available / 1e9:.1f} GB is available, {spare / 1e9:.1f} GB to be left spare")


def choose(device, state_dtype: str, master: str, commit_every: int, overlap: bool,
           subgroup_sizes: Sequence[int] = (), ram_budget: float = 0,
           schedule: Optional[str] = None) -> Choice:
    """The choice for ``device`` (a CpuDevice, XrtDevice or CudaDevice) in a pipeline of
    these settings; ``subgroup_sizes``: the sub-groups to come, in order, where known,
    ``ram_budget`` the host memory that takes those the device does not, and ``schedule``
    the I/O schedule its ring runs (None: the one the record favours)."""
    asked = getattr(device, "twins", False)
    if asked == "host":
        return Choice(False, "as requested: a host twin of the GPU's budget", host=True)
    if asked is not None:
        return Choice(bool(asked), "as requested" if asked else "the default: twins from what "
                      "is left of the budget at a commit")
    if not device.memory_budget:
        return Choice(False, "no memory budget: nothing resident")
    if not overlap:
        return Choice(False, "overlap=False: a durable commit is written before commit() returns")
    if getattr(device, "memory", "host") == "gpu":
        fits, why = host_twin_fits(device.memory_budget, ram_budget)
        if fits:
            return Choice(False, why, host=True)
    path = io_schedule.find_record(device.path)
    figures = io_schedule.load_record(path, INSTEAD) if path else None
    if figures is not None and subgroup_sizes:
        whole = _by_placement(path, figures, device.memory_budget, subgroup_sizes, ram_budget,
                              state_dtype, master, commit_every, schedule)
        if whole is not None:
            return whole
    rates = _recorded_rates(path, figures, state_dtype, master) if figures is not None else None
    if rates is None:
        return Choice(True, f"no probe record with the host's update rate in {device.path} or "
                            f"above it (python -m smartinf.probe DIR --record): twins, so that "
                            f"a durable commit's write never holds the GPU's updates")
    host_pps, write_bps = rates
    state = model.state_bytes_per_param(state_dtype, master)
    pays = placement.twins_pay(state, commit_every, host_pps, write_bps)
    return Choice(pays, f"{path}: the host updates {host_pps / 1e9:.2f} G params/s, the disk "
                        f"writes {write_bps / 1e9:.2f} GB/s; with commit_every={commit_every} "
                        + ("a twin costs less than its sub-group's wait for its write" if pays
                           else "a sub-group's wait for its write costs less than its twin"))


def _by_placement(path: str, figures: dict, gpu_budget: int, sizes: Sequence[int],
                  ram_budget: float, state_dtype: str, master: str,
                  commit_every: int, schedule: Optional[str] = None) -> Choice | None:
    """The whole placement the model prefers (``placement.twins_win``), from the record's
    ``figures``; None where it lacks the GPU's, the host's or the disk's figures."""
    if figures.get("gpu") is None:  # a record without them: the rule per byte
        return None
    try:
        rates = placement.recorded_rates(figures, state_dtype, master, schedule)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise io_schedule.not_a_record(path, f"its figures: {e!r}", INSTEAD) from e
    if rates is None:  # no triad or kernel timed on the usable cores: the rule per byte
        return None
    state = model.state_bytes_per_param(state_dtype, master)
    step = {t: placement.predict_placed(placement.place_sizes(sizes, state, gpu_budget, ram_budget, t),
                                    **rates, state_bytes=state, commit_every=commit_every,
                                    twins=t).step_s
            for t in (False, True)}
    return Choice(placement.twins_win(step[True], step[False]),
                  f"{path}: over its {len(sizes)} sub-groups the model's mean step with twins "
                  f"{step[True]:.3f} s, without {step[False]:.3f} s (commit_every={commit_every}; "
                  f"without only where more than {placement.TWINS_TIE:.0%} shorter)")


def _recorded_rates(path: str, figures: dict, state_dtype: str,
                    master: str) -> tuple[float, float] | None:
    """The host's update rate on its usable cores and the disk's write rate from the record's
    ``figures`` (beside the host's update where the probe measured it: the GPU's wait for its
    write runs beside the host's part of the step); None where it holds no kernel rates
    (probes before they were recorded)."""
    try:
        host_pps = placement.host_update_pps(figures, state_dtype, master)
    except ValueError:  # no kernel timed on the usable cores
        return None
    except (KeyError, TypeError, AttributeError) as e:
        raise io_schedule.not_a_record(path, f"its kernel rates: {e!r}", INSTEAD) from e
    name = "write_beside_update_bps" if figures.get("write_beside_update_bps") is not None else "write_bps"
    write_bps = figures.get(name)
    _check_rates(path, {"params_per_s": host_pps, name: write_bps})
    return float(host_pps), float(write_bps)


def _check_rates(path: str, rates: dict) -> None:
    """``placement.check_rates``; a bad rate refuses the record, naming it."""
    try:
        placement.check_rates(rates)
    except ValueError as e:
        raise io_schedule.not_a_record(path, e, INSTEAD) from e
