"""The performance model's command line (``python -m smartinf.model``; the formulas and the
placement are ``model.py``).

``python -m smartinf.model --params 8e9 --devices 1-10 [--probe probe.json] [--plot out.png]``
prints the table and draws it; with ``--gpu-budget BYTES --memory-budget BYTES`` and a probe
that measured a GPU, the placement and its step; with ``--tiers`` (and ``--memory-gbps`` or a
probe with a triad), one device's step per resident fraction, and with ``--step-time S`` the
budget S needs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Optional, Sequence

from smartinf.planning.model import (Hardware, budget_for, predict_tiered, scaling_table,
                                     state_bytes_per_param)
from smartinf.planning.placement import (PlacedPrediction, host_update_pps, place, predict_placed,
                                         twins_win)
from smartinf.pipeline.settings import MASTERS, STATE_DTYPES

def parse_devices(text: str) -> list[int]:
    """``"1-10"``, ``"4"`` or ``"1,2,4,8"`` -> device counts."""
    counts: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            counts += list(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"--devices {text!r}: expected N, A-B or a comma list of them") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--devices {text!r}: device counts must be >= 1")
    return counts


def format_table(params: float, hw: Hardware, rows: list[dict], ratio: float) -> str:
    gb = 1e9
    lines = [
        f"{params:.3g} params; per device: storage read {hw.read_bps / gb:.2f} / write "
        f"{hw.write_bps / gb:.2f} GB/s, link {hw.link_bps / gb:.2f} GB/s; shared host link "
        + ("none" if math.isinf(hw.host_link_bps) else f"{hw.host_link_bps / gb:.2f} GB/s each way"),
        f"{'n':>3} | {'ZeRO-Inf (RAID0) s':>18} {'bound':>9} | {'SmartUpdate s':>13} {'x':>6} {'bound':>9} "
        f"| {f'SmartComp {ratio:.0%} s':>16} {'x':>6} | host link GB/step: ZI / SU / SC",
    ]
    for r in rows:
        z, u, c = r["zero-infinity"], r["smartupdate"], r["smartcomp"]
        lines.append(
            f"{r['n']:>3} | {z['step_s']:>18.3f} {z['bound']:>9} | {u['step_s']:>13.3f} {u['speedup']:>5.2f}x "
            f"{u['bound']:>9} | {c['step_s']:>16.3f} {c['speedup']:>5.2f}x | "
            f"{z['host_link_bytes'] / gb:.1f} / {u['host_link_bytes'] / gb:.1f} / "
            f"{c['host_link_bytes'] / gb:.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'smartinf[bench]'") from None
    n = [r["n"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for scheme, label in (("zero-infinity", "ZeRO-Infinity, RAID0"), ("smartupdate", "SmartUpdate"),
                          ("smartcomp", "SmartComp")):
        left.plot(n, [r[scheme]["step_s"] for r in rows], marker="o", label=label)
    for scheme, label in (("smartupdate", "SmartUpdate"), ("smartcomp", "SmartComp")):
        right.plot(n, [r[scheme]["speedup"] for r in rows], marker="o", label=label)
    left.set(xlabel="devices", ylabel="optimizer step (s)", title=title)
    right.set(xlabel="devices", ylabel="speedup over ZeRO-Infinity (RAID0)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m smartinf.model",
        description="Predicted optimizer-step time on 1..N near-storage devices (Smart-Infinity's "
                    "model) against ZeRO-Infinity on a RAID0 of the same drives.")
    parser.add_argument("--params", type=float, required=True, help="model parameters, e.g. 8e9")
    parser.add_argument("--devices", default="1-10", help="device counts: N, A-B or a list (1-10)")
    parser.add_argument("--probe", help="JSON from `python -m smartinf.probe DIR --json`")
    parser.add_argument("--read-gbps", type=float, help="one device's storage read, GB/s")
    parser.add_argument("--write-gbps", type=float, help="one device's storage write, GB/s")
    parser.add_argument("--device-link-gbps", type=float,
                        help="one device's own link to the host, GB/s each way (default: read)")
    parser.add_argument("--host-link-gbps", type=float, default=16.0,
                        help="the host link the devices share, GB/s each way (16: PCIe 3.0 x16)")
    parser.add_argument("--host-update-gpps", type=float,
                        help="ZeRO-Infinity's CPU Adam, G params/s (default: hidden)")
    parser.add_argument("--grad-bytes", type=int, default=2, help="gradient element size (2)")
    parser.add_argument("--param-bytes", type=int, default=2, help="param element size (2)")
    parser.add_argument("--ratio", type=float, default=0.01, help="SmartComp kept fraction (0.01)")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                        help="smartinf's Adam moments: fp32 (8 B/param), int8 (~2) or int4 (~1.1)")
    parser.add_argument("--master", choices=MASTERS, default="fp32",
                        help="smartinf's masters: fp32 (4 B/param) or split (2 B; bf16 params, "
                             "sent to the device with the gradient)")
    parser.add_argument("--tiers", action="store_true",
                        help="one device's step per fraction of states resident in memory")
    parser.add_argument("--memory-gbps", type=float,
                        help="host memory bandwidth, GB/s (default: the probe's STREAM triad)")
    parser.add_argument("--commit-every", type=int, default=1, help="steps per durable commit (1)")
    parser.add_argument("--step-time", type=float, help="--tiers: the memory budget this step time needs")
    parser.add_argument("--gpu-budget",
                        help="the GPU's memory budget for states (bytes, or e.g. 8GiB): print "
                             "where sub-groups go and the step (needs a probe that measured a GPU)")
    parser.add_argument("--memory-budget", default="0",
                        help="--gpu-budget: host memory for states (bytes or e.g. 40GiB; 0)")
    parser.add_argument("--subgroup", type=float, default=1e8,
                        help="--gpu-budget: params per sub-group (1e8)")
    parser.add_argument("--twins", choices=("auto", "on", "off"), default="auto",
                        help="--gpu-budget: the GPU's sub-groups placed with room for their "
                             "twin (auto: where twins_pay says so, as CudaDevice(twins=None))")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", help="write a PNG of step time and speedup per device count")
    args = parser.parse_args(argv)
    try:
        gb = 1e9
        overrides = {"read_bps": args.read_gbps and args.read_gbps * gb,
                     "write_bps": args.write_gbps and args.write_gbps * gb,
                     "device_link_bps": args.device_link_gbps and args.device_link_gbps * gb,
                     "host_link_bps": args.host_link_gbps * gb,
                     "host_update_pps": args.host_update_gpps and args.host_update_gpps * gb}
        probe_triad = None
        if args.probe:
            with open(args.probe) as f:
                result = json.load(f)
            hw = Hardware.from_probe(result, **overrides)
            probe_triad = (result.get("triad") or {}).get("bps")
        elif args.read_gbps and args.write_gbps:
            hw = Hardware(**{k: v for k, v in overrides.items() if v is not None})
        else:
            parser.error("give --probe probe.json (from `python -m smartinf.probe DIR --json`) "
                         "or both --read-gbps and --write-gbps")
        if args.tiers:
            return _print_tiers(args, hw, probe_triad)
        if args.gpu_budget is not None:
            return _print_placed(args, hw, result if args.probe else {})
        rows = scaling_table(args.params, parse_devices(args.devices), hw, args.grad_bytes,
                             args.param_bytes, args.ratio, args.state_dtype, args.master)
        if args.plot:
            plot(rows, args.plot, f"{args.params:.3g} params")
    except (OSError, ValueError, KeyError, ImportError) as e:
        print(f"smartinf.planning.model: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"params": args.params, "hardware": dataclasses.asdict(hw), "rows": rows},
                     indent=1) if args.json else format_table(args.params, hw, rows, args.ratio))
    return 0


def _print_tiers(args: argparse.Namespace, hw: Hardware, probe_triad: Optional[float]) -> int:
    memory = args.memory_gbps * 1e9 if args.memory_gbps else probe_triad
    if not memory:
        raise ValueError("--tiers needs --memory-gbps or a probe JSON with a triad "
                         "(python -m smartinf.probe DIR --json)")
    state = state_bytes_per_param(args.state_dtype, args.master)
    rows = [dataclasses.asdict(predict_tiered(args.params, f, hw.read_bps, hw.write_bps, memory,
                                              args.commit_every, state, args.grad_bytes,
                                              args.param_bytes, commit_write_bps=hw.commit_write_bps,
                                              mix_bps=hw.mix_bps))
            for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
    budget = None if args.step_time is None else budget_for(
        args.step_time, args.params, hw.read_bps, hw.write_bps, args.commit_every, state)
    if args.json:
        print(json.dumps({"params": args.params, "rows": rows, "step_time": args.step_time,
                          "budget_bytes": budget}, indent=1))
        return 0
    print(f"{args.params:.3g} params on one device, {args.state_dtype} moments, {args.master} "
          f"masters ({state:.2f} B/param), commit_every="
          f"{args.commit_every}: storage {hw.read_bps / 1e9:.2f} / {hw.write_bps / 1e9:.2f} GB/s"
          + ("" if hw.commit_write_bps is None else
             f" ({hw.commit_write_bps / 1e9:.2f} written beside the update)")
          + f", memory {memory / 1e9:.1f} GB/s")
    for r in rows:
        print(f"  {r['resident']:4.0%} resident: step {r['step_s']:8.2f} s  (storage "
              f"{r['storage_s']:.2f} s, memory {r['memory_s']:.2f} s)")
    if budget is not None:
        print(f"a {args.step_time:g} s step needs a memory budget of " +
              ("more than all the states (the durable commit alone is longer)" if math.isinf(budget)
               else f"{budget / 2**30:.1f} GiB"))
    return 0


def _print_placed(args: argparse.Namespace, hw: Hardware, result: dict) -> int:
    from smartinf import defaults  # noqa: PLC0415
    gpu = result.get("gpu")
    triad = (result.get("triad") or {}).get("bps")
    if not gpu or not triad:
        raise ValueError("--gpu-budget needs a probe JSON that measured a GPU and the host "
                         "(python -m smartinf.probe DIR --json on the GPU's machine)")
    state = state_bytes_per_param(args.state_dtype, args.master)
    host_pps = host_update_pps(result, args.state_dtype, args.master)
    def predicted(twins: bool) -> PlacedPrediction:
        placement = place(args.params, state, defaults.parse_bytes(args.gpu_budget, "--gpu-budget"),
                          defaults.parse_bytes(args.memory_budget, "--memory-budget"),
                          args.subgroup, twins)
        return predict_placed(placement, gpu["update_pps"][args.state_dtype], host_pps, triad,
                              hw.read_bps, hw.write_bps, gpu["host_to_gpu_bps"],
                              gpu["gpu_to_host_bps"], state, args.commit_every, args.grad_bytes,
                              args.param_bytes, twins, hw.commit_write_bps, hw.mix_bps)

    # auto: the whole placement with and without twins, as smartinf.planning.twins chooses where the
    # sub-groups are known
    if args.twins == "auto":
        with_twins, without = predicted(True), predicted(False)
        p = with_twins if twins_win(with_twins.step_s, without.step_s) else without
    else:
        p = predicted(args.twins == "on")
    placement, twins = p.placement, p.twins
    if args.json:
        print(json.dumps(dict(dataclasses.asdict(p), bound=p.bound), indent=1))
        return 0
    print(f"{args.params:.3g} params, {args.state_dtype} moments, {args.master} masters "
          f"({state:.2f} B/param), sub-groups of {args.subgroup:.3g}: GPU {placement.gpu:.3g} "
          f"params ({'with' if twins else 'without'} twins), host memory {placement.ram:.3g}, "
          f"streamed {placement.streamed:.3g}")
    print(f"step {p.step_s:.3f} s ({p.bound}): GPU {p.gpu_s:.3f} s, host {p.host_s:.3f} s, "
          f"PCIe {p.link_s:.3f} s, disk {p.disk_s:.3f} s, the GPU's wait for its commit adds {p.commit_s:.3f} s; "
          f"after backward {p.exposed_s:.3f} s a step" + ("" if placement.gpu <= p.balance_gpu_params else
                                      f"; the GPU's budget is past the balance point "
                                      f"({p.balance_gpu_params:.3g} params): a smaller one "
                                      f"would leave the host its share"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
