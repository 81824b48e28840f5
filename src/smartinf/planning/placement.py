"""Placement and the placed step: sub-groups on a GPU's memory budget, a host memory budget
and storage (``place``, ``place_sizes``, ``fill``: the pipeline's placement), the step that
placement gives (``predict_placed``), whether the GPU's budget should hold its sub-groups with
twins (``twins_pay``), the rates from a directory's probe record (``recorded_rates``) and the
step of the placement a ``smartinf.Pipeline`` made (``predict_pipeline``). A durable commit's
resident writes run at the probe's write beside the host's update while it runs
(``model._disk_s``). The model of a step's bytes and its storage bound is ``model.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from smartinf import defaults
from smartinf.planning.io_schedule import drawn_bps, find_record, from_figures, load_record, not_a_record
from smartinf.planning.model import STATE_BYTES, _disk_s, predict_tiered, state_bytes_per_param


# -- a GPU, host memory and storage --------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Params per place: states resident in the GPU's memory, resident in host memory
    (the cpu device's budget), streamed from storage through the host, and resident in host
    memory but updated by the GPU (``CudaDevice(memory="host")``: they cross PCIe)."""

    gpu: float
    ram: float
    streamed: float
    gpu_host: float = 0.0


#: what each direction of PCIe keeps of its rate while the other runs too (pinned copies
#: on the lent H100: 54.4 GB/s alone, 42.3 GB/s each at once)
BOTH_WAYS_SHARE = 0.78


def place(params: float, state_bytes: float, gpu_budget: float, ram_budget: float,
          subgroup: float = 1e8, twins: bool = False) -> Placement:
    """Where ``Pipeline.add_subgroup`` puts sub-groups of ``subgroup`` params (the last one
    shorter): ``place_sizes`` of those sizes."""
    if params <= 0 or subgroup <= 0:
        raise ValueError("params, subgroup and state_bytes must be positive, budgets >= 0")
    sizes, done = [], 0.0
    while done < params:
        sizes.append(min(subgroup, params - done))
        done += sizes[-1]
    return place_sizes(sizes, state_bytes, gpu_budget, ram_budget, twins)


def place_sizes(sizes, state_bytes: float, gpu_budget: float, ram_budget: float,
                twins: bool = False) -> Placement:
    """Where ``Pipeline.add_subgroup`` puts sub-groups of these ``sizes``, in order: each in
    the GPU's budget while its states (and with ``twins`` their twin) fit there (a GPU
    updates resident states ~50x faster than the host's cores: with a budget below the
    balance point that ``predict_placed`` reports, every param moved there shortens the
    step), then in host memory while they fit, then streamed."""
    if state_bytes <= 0 or gpu_budget < 0 or ram_budget < 0 or any(n <= 0 for n in sizes):
        bad = next((n for n in sizes if n <= 0), None)
        raise ValueError(f"sub-group sizes and state_bytes must be positive, budgets >= 0; got "
                         f"state_bytes {state_bytes}, budgets {gpu_budget} and {ram_budget}"
                         + ("" if bad is None else f", a sub-group of {bad}"))
    placed = {"gpu": 0.0, "ram": 0.0, "streamed": 0.0}
    tiers = fill([n * state_bytes for n in sizes], {"gpu": gpu_budget, "ram": ram_budget},
                 {"gpu": 2 if twins else 1})
    for n, where in zip(sizes, tiers):
        placed[where] += n
    return Placement(**placed)


def fill(sizes_bytes, budgets: dict, copies: Optional[dict] = None) -> list:
    """The tier each sub-group goes to, in order, as ``Pipeline.add_subgroup`` places them
    (its resident memory is given out first come, first served): the first of ``budgets``
    (name: bytes, in order) with room for its states (``sizes_bytes``, one copy; times the
    tier's ``copies``, 2 with twins), else ``"streamed"``."""
    left = {k: float(b) for k, b in budgets.items()}
    copies = copies or {}
    tiers = []
    for size in sizes_bytes:
        where = next((k for k in left if size * copies.get(k, 1) <= left[k]), "streamed")
        if where != "streamed":
            left[where] -= size * copies.get(where, 1)
        tiers.append(where)
    return tiers


# Twins unless the mean without them is shorter by more than this: what the model cannot
# tell apart is a tie, and a tie keeps twins, so no durable commit holds an update (on the
# H100 at a quarter budget, where it predicted one, the mean over iterations 3-12 was 20 %
# shorter with twins on one host and 8 % longer on another).
TWINS_TIE = 0.01


def twins_win(with_twins_s: float, without_s: float) -> bool:
    """The choice between two whole placements' predicted steps (``predict_placed``)."""
    return not without_s < (1 - TWINS_TIE) * with_twins_s


def twins_pay(state_bytes: float, commit_every: int, host_pps: float, write_bps: float) -> bool:
    """Whether a GPU budget should hold its sub-groups with their twins (``smartinf.planning.twins``),
    where the sub-groups it then cannot take are updated in host memory. Per byte of the
    budget, over a commit interval of ``commit_every`` steps: without twins it holds
    1 / ``state_bytes`` params, whose first updates after a durable commit wait for their
    states' write, 1 / ``write_bps`` s (at least: the host's resident writes share the disk);
    with twins half of them are updated by the host instead, 1 / (2 ``state_bytes``
    ``host_pps``) s per step (at most: the host's part of a step may hide behind backward)."""
    if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
        raise ValueError(f"commit_every must be a positive int, got {commit_every!r}")
    if state_bytes <= 0 or host_pps <= 0 or write_bps <= 0:
        raise ValueError("state_bytes, host_pps and write_bps must be positive")
    return commit_every / (2 * state_bytes * host_pps) < 1 / write_bps


@dataclass(frozen=True)
class PlacedPrediction:
    """One step of ``placement``: the GPU's part and the host's run at once (their own
    rings), so the step is the longer. ``host_s``: the host's kernel, memory and storage
    (``predict_tiered``); ``link_s``: its sub-groups' gradients to the host and params back
    over PCIe (full duplex: the busier direction), overlapped with its updates.
    ``balance_gpu_params``: the GPU's share at which both parts take as long (a budget
    beyond it would gain from leaving the rest on the host). ``step_s`` is the mean over a
    commit interval: the GPU's resident states are written once per interval, in the
    background with ``twins``, else its first updates after the commit wait for the write;
    either way the disk writes them (``disk_s``: all its traffic, per step)."""

    placement: Placement
    step_s: float
    gpu_s: float
    host_s: float
    link_s: float
    balance_gpu_params: float
    commit_s: float = 0.0  # what the GPU's wait for its states' write adds to the mean
    twins: bool = False
    disk_s: float = 0.0
    exposed_s: float = 0.0  # what must follow backward each step (iteration_s)

    @property
    def bound(self) -> str:
        return max((self.gpu_s, "gpu"), (self.host_s, "host"), (self.link_s, "pcie"),
                   (self.disk_s, "storage"))[1]

    def iteration_s(self, fwd_bwd_s: float) -> float:
        return iteration_s(self.step_s, self.exposed_s, fwd_bwd_s)


def iteration_s(step_s: float, exposed_s: float, fwd_bwd_s: float) -> float:
    """The mean iteration over a commit interval of a pipeline whose step the model puts at
    ``step_s`` (``PlacedPrediction``), where forward and backward take ``fwd_bwd_s`` on
    their own: a step's updates and its streamed states' traffic follow its backward
    (``exposed_s``: their gradients come last), while the resident states' background
    writes also run beside forward and backward, so the disk bounds the iteration only
    where its traffic takes longer than all of it."""
    return max(fwd_bwd_s + exposed_s, step_s)


def predict_placed(placement: Placement, gpu_pps: float, host_pps: float, memory_bps: float,
                   read_bps: float, write_bps: float, host_to_gpu_bps: float,
                   gpu_to_host_bps: float, state_bytes: float = STATE_BYTES,
                   commit_every: int = 1, grad_bytes: int = 2,
                   param_bytes: int = 2, twins: bool = False,
                   commit_write_bps: Optional[float] = None,
                   mix_bps: Optional[float] = None) -> PlacedPrediction:
    """The step of ``placement`` (``place``) with the GPU's update rate ``gpu_pps`` and
    PCIe's rates (the probe's ``gpu`` figures) and the host's (its kernel on the usable
    cores, its memory's triad, its storage), as the mean over a commit interval of k =
    ``commit_every`` steps. Compute (the GPU's update, the host's kernel and memory, PCIe)
    and the disk overlap: the interval takes the longer of k compute steps and the disk's
    traffic (the host's streamed states every step, every resident state once, written
    while the host's update runs at ``commit_write_bps``, the probe's write beside it, and
    at ``write_bps`` once it is done; the streamed states at ``mix_bps``, what the ring
    draws under its I/O schedule, where known). Without twins the step after a durable commit also
    waits for the GPU's states to be written (beside as many of the host's: written at
    once, at equal rates, as measured on the H100 host) before the GPU updates them; the
    host's updates run meanwhile and its streamed states' traffic after it (the same disk),
    so the wait costs only what it adds to both. ``exposed_s``: the mean of what follows
    backward (the updates, the streamed traffic, the wait), for ``iteration_s``. The GPU's
    states in host memory cross PCIe both ways each step (both directions at
    ``BOTH_WAYS_SHARE`` of their rates), beside the host's sub-groups' gradients and params,
    and are written at durable commits as the host memory's."""
    host_params = placement.ram + placement.streamed
    gpu_bytes = placement.gpu * state_bytes
    crossing = placement.gpu_host * state_bytes
    host_storage_s = host_compute_s = link_s = 0.0
    if host_params:
        host = predict_tiered(host_params, placement.ram / host_params, read_bps, write_bps,
                              memory_bps, commit_every, state_bytes, grad_bytes, param_bytes,
                              host_pps, commit_write_bps, mix_bps)
        host_storage_s, host_compute_s = host.storage_s, max(host.memory_s, host.update_s)
    if host_params or crossing:
        link_s = max((host_params * grad_bytes + crossing) / gpu_to_host_bps,
                     (host_params * param_bytes + crossing) / host_to_gpu_bps)
        link_s /= BOTH_WAYS_SHARE if crossing else 1.0
    gpu_s = (placement.gpu + placement.gpu_host) / gpu_pps
    compute_s = max(gpu_s, host_compute_s, link_s)
    # the host's update is what slows the resident writes (the GPU's own update does not
    # touch host memory)
    disk_s = _disk_s(placement.streamed * state_bytes,
                     (placement.ram * state_bytes + crossing + gpu_bytes) / commit_every, host_compute_s,
                     read_bps, write_bps, commit_write_bps, mix_bps)
    # what follows backward each step: the updates, and the streamed states' traffic
    streamed_s = _disk_s(placement.streamed * state_bytes, 0.0, 0.0, read_bps, write_bps,
                         mix_bps=mix_bps)
    exposed_s = max(compute_s, streamed_s)
    step_s = max(compute_s, disk_s)
    if not twins and gpu_bytes:
        wait_s = _disk_s(0.0, gpu_bytes + min(gpu_bytes, placement.ram * state_bytes),
                         host_compute_s, read_bps, write_bps, commit_write_bps)
        # the wait holds the disk: the streamed traffic comes after it, as the GPU's update
        first_s = max(exposed_s, wait_s + max(gpu_s, streamed_s))
        exposed_s = (first_s + (commit_every - 1) * exposed_s) / commit_every
        step_s = max(step_s, exposed_s)
    total = placement.gpu + placement.gpu_host + host_params
    host_rate = total / max(predict_tiered(total, 1.0, read_bps, write_bps, memory_bps,
                                           commit_every, state_bytes, grad_bytes, param_bytes,
                                           host_pps, commit_write_bps).step_s, 1e-12)
    balance = total if math.isinf(gpu_pps) else total * gpu_pps / (gpu_pps + host_rate)
    return PlacedPrediction(placement, step_s, gpu_s, max(host_compute_s, host_storage_s),
                            link_s, balance, step_s - max(compute_s, disk_s), twins, disk_s,
                            exposed_s)


def check_rates(rates: dict) -> None:
    """Each named rate a positive finite number (not a bool), else a ValueError naming it."""
    for name, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise ValueError(f"{name} {rate!r} is not a positive rate")


def recorded_rates(figures: dict, state_dtype: str, master: str,
                   schedule: Optional[str] = None) -> Optional[dict]:
    """``predict_placed``'s rates (by keyword) from a directory's probe record (``python -m
    smartinf.planning.probe DIR --record``: its storage figures, what the ring drew there under the
    I/O ``schedule``, None: the one ``io_schedule="auto"`` picks, the host's kernel rates and
    triad, and the GPU's where it measured one; without them the GPU's rates are ``inf``,
    which a placement with nothing on a GPU never uses); None where it lacks the host's figures.
    Figures of the wrong shape raise KeyError or TypeError, a rate that is not a positive
    number ValueError: the caller names the record."""
    triad = (figures.get("triad") or {}).get("bps")
    if triad is None:
        return None
    try:
        host_pps = host_update_pps(figures, state_dtype, master)
    except ValueError:  # no kernel timed on the usable cores
        return None
    rates = {"host_pps": host_pps, "memory_bps": triad, "read_bps": figures["read_bps"],
             "write_bps": figures["write_bps"]}
    gpu = figures.get("gpu")
    if gpu is not None:
        rates.update(gpu_pps=gpu["update_pps"][state_dtype], host_to_gpu_bps=gpu["host_to_gpu_bps"],
                     gpu_to_host_bps=gpu["gpu_to_host_bps"])
    if figures.get("write_beside_update_bps") is not None:  # probes before it: the plain write
        rates["commit_write_bps"] = figures["write_beside_update_bps"]
    mix = drawn_bps(figures, schedule or from_figures(figures).schedule)
    if mix:  # records before the mix curve: one direction after the other
        rates["mix_bps"] = mix
    check_rates(rates)
    return {"gpu_pps": math.inf, "host_to_gpu_bps": math.inf, "gpu_to_host_bps": math.inf,
            "commit_write_bps": None, "mix_bps": None, **rates}


#: the rates a host's ranks share (its memory, cores and disk); each GPU and its link is a rank's own
SHARED_RATES = ("host_pps", "memory_bps", "read_bps", "write_bps", "commit_write_bps", "mix_bps")


def rank_share(rates: dict, ranks: int) -> dict:
    """``predict_placed``'s rates for one of ``ranks`` ranks of a host that run their steps at
    once (each its partition): the host's shared rates divided among them, each GPU's and
    its PCIe link's kept (the probe measured the host alone)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    return {k: v / ranks if k in SHARED_RATES and v is not None else v for k, v in rates.items()}


def predict_pipeline(pipe: Any, grad_bytes: int = 2, param_bytes: int = 2,
                     ranks: Optional[int] = None) -> Optional[PlacedPrediction]:
    """The model's step (the mean over a commit interval) for the sub-groups where the
    ``smartinf.Pipeline`` ``pipe`` placed them, with its settings and its GPU's twins choice,
    from the probe's record of its first device's directory or the nearest one above it;
    None where there is no record or it lacks the host's figures (or a GPU's, where the
    pipeline has sub-groups on one). ``ranks``: the host's ranks stepping at once, sharing
    its memory, cores and disk (``rank_share``; None: ``defaults.local_ranks``)."""
    path = find_record(pipe.devices[0].path)
    if path is None:
        return None
    settings = pipe.settings
    figures = load_record(path, "move it away")
    try:
        rates = recorded_rates(figures, settings.state_dtype, settings.master,
                               pipe.io_schedules[0].schedule)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise not_a_record(path, repr(e), "move it away") from e
    placed = {"gpu": 0.0, "ram": 0.0, "streamed": 0.0, "gpu_host": 0.0}
    for sg in range(pipe.num_subgroups):
        device = pipe.device_of(sg)
        where = "gpu_host" if getattr(device, "memory", "") == "host" else \
            "gpu" if pipe.gpu_of(sg) is not None else "ram" if pipe.resident(sg) else "streamed"
        placed[where] += pipe.numel(sg)
    if rates is None or (placed["gpu"] and math.isinf(rates["gpu_pps"])):
        return None
    rates = rank_share(rates, defaults.local_ranks() if ranks is None else ranks)
    twins = any(c.twins for c, d in zip(pipe.twins, pipe.devices) if d.kind == "cuda")
    state = state_bytes_per_param(settings.state_dtype, settings.master)
    return predict_placed(Placement(**placed), **rates, state_bytes=state,
                          commit_every=settings.commit_every, grad_bytes=grad_bytes,
                          param_bytes=param_bytes, twins=twins)


def host_update_pps(result: dict, state_dtype: str, master: str) -> float:
    """The probe's host kernel rate on the usable cores for bf16 gradients and params in
    ``state_dtype`` states with ``master`` masters (or the nearest format it timed)."""
    kernels = [k for k in result.get("kernel", []) if k.get("threads", 1) > 1
               and k["grad"] == k["param"] == "bfloat16"]
    def distance(k: dict) -> tuple:
        return (k["state_dtype"] != state_dtype, k.get("master", "fp32") != master)
    if not kernels:
        raise ValueError("the probe has no kernel timed on the usable cores: rerun "
                         "`python -m smartinf.probe DIR --json`")
    return min(kernels, key=distance)["params_per_s"]

