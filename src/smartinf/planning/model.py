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
- placement on a GPU, host memory and storage, and the placed step: ``placement.py``.

Bandwidths are bytes per second, times are seconds. The command line
(``python -m smartinf.model``, its tables and plots) is ``model_cli.py``: the library that
places sub-groups imports neither argparse nor matplotlib.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from smartinf.planning.io_schedule import from_figures
from smartinf.pipeline.settings import MASTERS, STATE_DTYPES

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
    from smartinf import _native  # the layout's owner
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
