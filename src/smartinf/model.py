"""Traffic and scaling model of near-storage optimizer updates (pure Python; no I/O but
reading a probe record).

- ``traffic_per_param``: bytes moved per parameter per optimizer step on each link, for
  ZeRO-Infinity, SmartUpdate and SmartComp (Table I of the Smart-Infinity paper).
- ``storage_bound_seconds`` / ``storage_bound_from_bytes``: the time a step cannot beat
  on a storage device of given read and write bandwidth (the denominator of the
  "step time / storage limit" ratio the demo and the benchmarks report).
- ``scaled_step_time``: the optimizer-step time on ``n`` near-storage devices,
  T_opt,n = max(T_opt / n, T_param_swap / min(n, B_PCIe / B_SSD)).
- ``Hardware`` + ``predict`` / ``scaling_table``: those two applied to a machine (from a
  probe JSON or explicit bandwidths), against ZeRO-Infinity on a RAID0 of the same drives.
- ``predict_tiered`` / ``budget_for``: one device's step with a memory budget (a fraction
  of the states resident in memory) and a commit interval, and the budget a step time needs.
- ``place`` / ``predict_placed``: sub-groups on a GPU's memory budget, a host memory budget
  and storage (the pipeline's placement), and the step that placement gives; ``twins_pay``:
  whether the GPU's budget should hold its sub-groups with twins (``smartinf.twins``);
  ``recorded_rates`` / ``predict_pipeline``: the rates from a directory's probe record, and
  the step of the placement a ``smartinf.Pipeline`` made. A durable commit's resident
  writes run at the probe's write beside the host's update while it runs (``_disk_s``).

Bandwidths are bytes per second, times are seconds. The command line
(``python -m smartinf.model``, its tables and plots) is ``model_cli.py``: the library that
places sub-groups imports neither argparse nor matplotlib.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .io_schedule import drawn_bps, find_record, from_figures, load_record, not_a_record
from .settings import MASTERS, STATE_DTYPES

#: fp32 master weight + Adam exp_avg + exp_avg_sq, bytes per parameter on storage.
STATE_BYTES = 12
_LAYOUT_NUMEL = 1 << 20  # a default chunk: the per-chunk scales and padding, per param


def state_bytes_per_param(state_dtype: str = "fp32", master: str = "fp32") -> float:
    """Bytes per parameter of Adam's states on storage, as ``store/layout.h`` lays a chunk
    out: ``state_dtype`` fp32 (12 B with an fp32 master), int8 (~6.03) or int4 (~5.09) moments;
    ``master`` fp32 (4 B) or split (2 B: the low halves of bf16 params' masters)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
    if master not in MASTERS:
        raise ValueError(f"master must be one of {', '.join(MASTERS)}, got {master!r}")
    from . import _native  # the layout's owner
    return _native.state_bytes(state_dtype, master, _LAYOUT_NUMEL) / _LAYOUT_NUMEL
SCHEMES = ("zero-infinity", "smartupdate", "smartcomp")
#: SmartComp sends each kept gradient element as an int32 position and its value.
INDEX_BYTES = 4


def traffic_per_param(scheme: str, grad_bytes: int = 2, param_bytes: int = 2,
                      state_bytes: float = STATE_BYTES, ratio: float = 0.01,
                      split: bool = False) -> dict[str, float]:
    """Bytes per parameter per step on each link (Table I of the Smart-Infinity paper).

    ``"zero-infinity"``: the host updates the params, so all optimizer states cross the
    host/storage interconnect twice (read ``state_bytes``, write ``state_bytes``), and the
    gradients, upcast to fp32, are offloaded to storage and read back (write 4 + read 4):
    32 B/param over the host link with Adam. ``grad_bytes`` and ``param_bytes`` do not
    change it (ZeRO-Infinity always swaps fp32 gradients).

    ``"smartupdate"``: the states go storage <-> compute inside the device (read
    ``state_bytes`` + write ``state_bytes`` = 24 B/param that never touch the host link);
    the host link carries only the gradient in (``grad_bytes``: 4 for fp32, 2 for
    fp16/bf16) and the updated low-precision params out (``param_bytes``).

    ``"smartcomp"``: SmartUpdate with top-k gradients: the host link carries ``ratio`` of
    the elements as (int32 position, value of ``grad_bytes``) pairs, ``ratio * (4 +
    grad_bytes)`` B/param in, and the params out.

    ``split`` (a split master, SmartUpdate and SmartComp): the device is also sent the
    params, ``param_bytes`` more per param host -> device, for 2 B less of master on storage
    each way: free on the ``cpu`` device (memory copies), a trade-off on a real CSD whose
    host link is slower than its storage.

    Keys: ``storage_read``, ``storage_write`` (bytes at the storage media),
    ``host_to_device``, ``device_to_host`` (bytes over the host/storage interconnect),
    ``host_link_total`` and ``storage_total``.
    """
    for name, value in (("grad_bytes", grad_bytes), ("param_bytes", param_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(state_bytes, bool) or not isinstance(state_bytes, (int, float)) or not state_bytes > 0:
        raise ValueError(f"state_bytes must be a positive number, got {state_bytes!r}")
    fp32_grad = 4
    if scheme == "zero-infinity":
        # Host writes grads + updated states to storage, reads states + grads back.
        read = state_bytes + fp32_grad
        write = state_bytes + fp32_grad
        h2d, d2h = write, read
    elif scheme in ("smartupdate", "smartcomp"):
        read = write = state_bytes
        h2d, d2h = grad_bytes, param_bytes
        if scheme == "smartcomp":
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
                raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
            h2d = ratio * (INDEX_BYTES + grad_bytes)
        if split:
            h2d += param_bytes
    else:
        raise ValueError(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    return {
        "storage_read": read,
        "storage_write": write,
        "storage_total": read + write,
        "host_to_device": h2d,
        "device_to_host": d2h,
        "host_link_total": h2d + d2h,
    }


def storage_bound_from_bytes(bytes_read: float, bytes_written: float,
                             read_bps: float, write_bps: float,
                             mix_bps: Optional[float] = None) -> float:
    """Seconds to read ``bytes_read`` and write ``bytes_written`` at the raw bandwidths,
    one after the other (the device's reads and writes share it): a step's storage limit.
    With ``mix_bps`` (the probe's aggregate with half read and half written, under the
    ring's I/O schedule) the balanced part goes at that rate and only the excess of one
    direction at its own."""
    if read_bps <= 0 or write_bps <= 0 or (mix_bps is not None and mix_bps <= 0):
        raise ValueError(f"bandwidths must be positive, got read={read_bps!r} write={write_bps!r}"
                         f" mix={mix_bps!r}")
    if bytes_read < 0 or bytes_written < 0:
        raise ValueError("byte counts must not be negative")
    if mix_bps is None:
        return bytes_read / read_bps + bytes_written / write_bps
    both = min(bytes_read, bytes_written)
    return 2 * both / mix_bps + (bytes_read - both) / read_bps + (bytes_written - both) / write_bps


def storage_bound_seconds(numel: int, read_bps: float, write_bps: float,
                          state_bytes: int = STATE_BYTES) -> float:
    """The storage limit of one optimizer step over ``numel`` params: every state is read
    once and written once, ``numel * state_bytes / read_bps + numel * state_bytes / write_bps``."""
    if numel < 0:
        raise ValueError(f"numel must not be negative, got {numel}")
    nbytes = numel * state_bytes
    return storage_bound_from_bytes(nbytes, nbytes, read_bps, write_bps)


def scaled_step_time(t_opt: float, t_param_swap: float, n: int,
                     b_pcie: float, b_ssd: float) -> float:
    """Optimizer-step time on ``n`` near-storage devices (the paper's scaling model).

    ``T_opt,n = max(T_opt / n, T_param_swap / min(n, B_PCIe / B_SSD))``: the update work
    (``t_opt`` on one device) divides over the devices, while the parameter swap over the
    shared host link (``t_param_swap`` at one device's storage bandwidth) speeds up only
    until the devices' aggregate bandwidth ``n * b_ssd`` fills the link ``b_pcie``.
    The whole training step is ``T_opt,n + T_fwd + T_bwd``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if b_pcie <= 0 or b_ssd <= 0:
        raise ValueError(f"bandwidths must be positive, got b_pcie={b_pcie!r} b_ssd={b_ssd!r}")
    if t_opt < 0 or t_param_swap < 0:
        raise ValueError("times must not be negative")
    return max(t_opt / n, t_param_swap / min(n, b_pcie / b_ssd))


# -- a machine, and the step time on it ------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Bandwidths of a machine with identical drives / computational storage devices.

    ``read_bps`` / ``write_bps``: one device's storage (a SmartSSD: SSD <-> FPGA peer to
    peer; an emulated one: its directory's disk, or its ``storage_gbps`` cap).
    ``host_link_bps``: the link all devices share to the host (PCIe switch or root port),
    each direction; ``inf`` for none. ``device_link_bps``: one device's own link to the
    host, each direction (the paper's B_SSD; default ``read_bps``). ``shared_read_bps`` /
    ``shared_write_bps``: where the devices' directories share disks (emulation on one
    machine), what those disks do together; ``None``: every device has its own drive.
    ``update_pps``: params per second one device's update kernel runs (``inf``: hidden).
    ``host_update_pps``: params per second the host's CPU Adam runs, for ZeRO-Infinity.
    ``mix_bps``: one device's aggregate bandwidth for a step's half-read, half-written
    traffic under the I/O schedule ``io_schedule="auto"`` picks from the probe's mix curve
    (both directions in flight, or bursts of one); ``None``: they take turns.
    ZeRO-Infinity's swapper reads, then writes: its storage time always takes turns.
    ``commit_write_bps``: one device's write bandwidth while the host's update runs (the
    probe's ``write_beside_update_bps``): a durable commit's background write beside the
    next steps (``predict_tiered``, ``predict_placed``); ``None``: ``write_bps``.

    The host link is full duplex (PCIe): gradients in and params out each have
    ``host_link_bps``; a drive's reads and writes share its bandwidth, one after the other.
    """

    read_bps: float
    write_bps: float
    host_link_bps: float = math.inf
    device_link_bps: Optional[float] = None
    shared_read_bps: Optional[float] = None
    shared_write_bps: Optional[float] = None
    update_pps: float = math.inf
    host_update_pps: float = math.inf
    mix_bps: Optional[float] = None
    commit_write_bps: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("read_bps", "write_bps", "host_link_bps", "device_link_bps",
                     "shared_read_bps", "shared_write_bps", "update_pps", "host_update_pps",
                     "mix_bps", "commit_write_bps"):
            value = getattr(self, name)
            if value is None and name in ("device_link_bps", "shared_read_bps", "shared_write_bps",
                                          "mix_bps", "commit_write_bps"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of bytes/s, got {value!r}")
        if (self.shared_read_bps is None) != (self.shared_write_bps is None):
            raise ValueError("give both shared_read_bps and shared_write_bps, or neither")

    @property
    def link_bps(self) -> float:
        return self.read_bps if self.device_link_bps is None else self.device_link_bps

    @classmethod
    def from_probe(cls, result: dict, **overrides: Any) -> "Hardware":
        """From ``python -m smartinf.probe --json`` output: the SmartSSDs' peer-to-peer and
        host<->FPGA figures when it found any, else its directories' raw storage (the
        slowest of them: a step waits for its slowest device). ``overrides`` win."""
        cards = result.get("smartssd") or []
        if cards:
            figures = dict(read_bps=min(c["p2p_read_bps"] for c in cards),
                           write_bps=min(c["p2p_write_bps"] for c in cards),
                           device_link_bps=min(min(c["host_to_fpga_bps"], c["fpga_to_host_bps"])
                                               for c in cards))
        else:
            storage = result.get("storage") or []
            if not storage:
                raise ValueError("the probe result has no storage figures: run "
                                 "`python -m smartinf.probe DIR --json` on a device directory")
            figures = dict(read_bps=min(s["read_bps"] for s in storage),
                           write_bps=min(s["write_bps"] for s in storage))
            if all(s.get("mixed_bps") for s in storage):  # the probe measured the mix curve
                figures["mix_bps"] = min(from_figures(s).bps for s in storage)
            if all(s.get("write_beside_update_bps") for s in storage):
                figures["commit_write_bps"] = min(s["write_beside_update_bps"] for s in storage)
        figures.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**figures)


@dataclass(frozen=True)
class Prediction:
    """One optimizer step over ``params`` on ``n`` devices (or drives, for ZeRO-Infinity)."""

    scheme: str
    n: int
    step_s: float
    storage_s: float  # the devices' storage traffic alone
    link_s: float     # the host link alone (the busier direction)
    update_s: float   # the update kernels alone
    traffic: dict     # bytes per param on each link (traffic_per_param)

    @property
    def bound(self) -> str:
        """What the step waits for: ``storage``, ``host link`` or ``update``."""
        return max((self.storage_s, "storage"), (self.link_s, "host link"),
                   (self.update_s, "update"))[1]


def predict(params: float, n: int, hw: Hardware, scheme: str = "smartupdate",
            grad_bytes: int = 2, param_bytes: int = 2, ratio: float = 0.01,
            state_bytes: float = STATE_BYTES, split: bool = False) -> Prediction:
    """The step time of ``scheme`` on ``n`` devices.

    SmartUpdate / SmartComp: ``scaled_step_time`` with T_opt the storage limit of all
    ``params`` on one device and T_param_swap their host-link bytes (the busier
    direction) at one device's link; never faster than shared disks allow, nor than the
    update kernels run. ZeRO-Infinity: the host reads and writes states and fp32 grads
    on a RAID0 of the ``n`` drives (``n`` times one drive's bandwidth) over the same
    host link, its CPU Adam at ``hw.host_update_pps``.
    """
    if isinstance(params, bool) or not isinstance(params, (int, float)) or not params > 0:
        raise ValueError(f"params must be a positive number, got {params!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    traffic = traffic_per_param(scheme, grad_bytes, param_bytes, state_bytes, ratio,
                                split and scheme != "zero-infinity")
    read, written = params * traffic["storage_read"], params * traffic["storage_write"]
    link_bytes = params * max(traffic["host_to_device"], traffic["device_to_host"])
    link = link_bytes / min(n * hw.link_bps, hw.host_link_bps)
    if scheme == "zero-infinity":
        storage = storage_bound_from_bytes(read, written, n * hw.read_bps, n * hw.write_bps)
        update = params / hw.host_update_pps
        step = max(storage, link, update)
    else:
        t_opt = storage_bound_from_bytes(read, written, hw.read_bps, hw.write_bps, hw.mix_bps)
        step = scaled_step_time(t_opt, link_bytes / hw.link_bps, n, hw.host_link_bps, hw.link_bps)
        storage = t_opt / n
        update = params / (n * hw.update_pps)
        step = max(step, update)
    if hw.shared_read_bps is not None:
        shared = storage_bound_from_bytes(read, written, hw.shared_read_bps, hw.shared_write_bps)
        storage = max(storage, shared)
        step = max(step, shared)
    return Prediction(scheme, n, step, storage, link, update, traffic)


def scaling_table(params: float, devices: Sequence[int], hw: Hardware, grad_bytes: int = 2,
                  param_bytes: int = 2, ratio: float = 0.01, state_dtype: str = "fp32",
                  master: str = "fp32") -> list[dict]:
    """Per device count: each scheme's predicted step, what bounds it, the host-link bytes
    per step, and the speedups over ZeRO-Infinity on a RAID0 of the same drives (whose
    states are fp32; ``state_dtype`` and ``master`` apply to SmartUpdate and SmartComp)."""
    ours = state_bytes_per_param(state_dtype, master)
    rows = []
    for n in devices:
        row: dict[str, Any] = {"n": n}
        for scheme in SCHEMES:
            p = predict(params, n, hw, scheme, grad_bytes, param_bytes, ratio,
                        STATE_BYTES if scheme == "zero-infinity" else ours, master == "split")
            row[scheme] = {"step_s": p.step_s, "bound": p.bound,
                           "host_link_bytes": params * p.traffic["host_link_total"],
                           "storage_bytes": params * p.traffic["storage_total"]}
        base = row["zero-infinity"]["step_s"]
        for scheme in ("smartupdate", "smartcomp"):
            row[scheme]["speedup"] = base / row[scheme]["step_s"]
        rows.append(row)
    return rows


# -- the memory tier ----------------------------------------------------------------------
@dataclass(frozen=True)
class TieredPrediction:
    """One device's step over ``params`` with ``resident`` of its states in memory,
    averaged over a commit interval of ``commit_every`` steps."""

    params: float
    resident: float      # fraction of the states resident in memory
    commit_every: int
    step_s: float
    storage_s: float     # streamed states read + written, resident ones written once per interval
    memory_s: float      # the kernel's memory traffic at memory bandwidth
    update_s: float      # the kernel's own rate (parallel update)

    @property
    def bound(self) -> str:
        return max((self.storage_s, "storage"), (self.memory_s, "memory"), (self.update_s, "update"))[1]


def _disk_s(streamed_bytes: float, resident_bytes: float, busy_s: float, read_bps: float,
            write_bps: float, commit_write_bps: Optional[float] = None,
            mix_bps: Optional[float] = None) -> float:
    """Seconds of one step's storage traffic: the streamed states read and written back (at
    ``mix_bps``, what the ring draws under its I/O schedule, where known: else one direction
    after the other), and ``resident_bytes`` of resident states written (a durable commit's
    share of the step), in the background while the update runs: for ``busy_s`` at
    ``commit_write_bps`` (the probe's write beside the host's update; None: ``write_bps``),
    the rest at ``write_bps``."""
    beside = commit_write_bps or write_bps
    if resident_bytes <= busy_s * beside:
        resident_s = resident_bytes / beside
    else:
        resident_s = busy_s + (resident_bytes - busy_s * beside) / write_bps
    return storage_bound_from_bytes(streamed_bytes, streamed_bytes, read_bps, write_bps,
                                    mix_bps) + resident_s


def _tier_storage_s(params: float, resident: float, commit_every: int, state_bytes: float,
                    read_bps: float, write_bps: float, busy_s: float = 0.0,
                    commit_write_bps: Optional[float] = None,
                    mix_bps: Optional[float] = None) -> float:
    return _disk_s(params * (1 - resident) * state_bytes, params * resident * state_bytes / commit_every,
                   busy_s, read_bps, write_bps, commit_write_bps, mix_bps)


def predict_tiered(params: float, resident: float, read_bps: float, write_bps: float,
                   memory_bps: float, commit_every: int = 1, state_bytes: float = STATE_BYTES,
                   grad_bytes: int = 2, param_bytes: int = 2,
                   update_pps: float = math.inf,
                   commit_write_bps: Optional[float] = None,
                   mix_bps: Optional[float] = None) -> TieredPrediction:
    """The step of one device whose budget holds ``resident`` (0..1) of the states: the
    streamed part is read and written every step, the resident part written once per
    ``commit_every`` steps (its durable commit) and never read; every param's states,
    gradient and updated param cross memory (``memory_bps``, e.g. the probe's STREAM
    triad) once each way. Storage, memory and the kernel overlap: the step is the largest
    (the resident write runs in the background with ``overlap``, the default; without it
    the commit's step takes it whole, and with twin copies the first step after a commit
    makes one more pass over the resident states: neither is in this mean). The resident
    write shares the disk with the streamed traffic and, while the kernel runs, the memory
    and cores with it: ``commit_write_bps`` (the probe's write beside the update) for that
    part. ``mix_bps``: what the ring draws from the disk for the streamed states' reads and
    write-backs together under its I/O schedule (the probe's record); None: one direction
    after the other at ``read_bps`` and ``write_bps``."""
    if not 0 <= resident <= 1:
        raise ValueError(f"resident must be a fraction in [0, 1], got {resident!r}")
    if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
        raise ValueError(f"commit_every must be a positive int, got {commit_every!r}")
    memory = params * (2 * state_bytes + grad_bytes + param_bytes) / memory_bps
    update = params / update_pps
    storage = _tier_storage_s(params, resident, commit_every, state_bytes, read_bps, write_bps,
                              max(memory, update), commit_write_bps, mix_bps)
    return TieredPrediction(params, resident, commit_every, max(storage, memory, update),
                            storage, memory, update)


def budget_for(step_s: float, params: float, read_bps: float, write_bps: float,
               commit_every: int = 1, state_bytes: float = STATE_BYTES) -> float:
    """Bytes of memory budget one device needs for its storage traffic to fit in
    ``step_s`` (0: none needed); ``inf`` when even all states resident do not fit (their
    write-back per interval alone takes longer)."""
    none = _tier_storage_s(params, 0.0, commit_every, state_bytes, read_bps, write_bps)
    full = _tier_storage_s(params, 1.0, commit_every, state_bytes, read_bps, write_bps)
    if step_s >= none:
        return 0.0
    if step_s < full:
        return math.inf
    return (none - step_s) / (none - full) * params * state_bytes


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
    """Whether a GPU budget should hold its sub-groups with their twins (``smartinf.twins``),
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
    smartinf.probe DIR --record``: its storage figures, what the ring drew there under the
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
    its memory, cores and disk (``rank_share``; None: ``LOCAL_WORLD_SIZE``, else 1)."""
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
    rates = rank_share(rates, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks is None else ranks)
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


if __name__ == "__main__":  # python -m smartinf.model
    from smartinf.model_cli import main
    sys.exit(main())
