"""``python -m smartinf.probe``'s command line: the probe run (``probe.probe``) and recorded,
and its report printed. The measurements are ``probe.py``'s (and ``probe_devices.py``'s).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from typing import Optional, Sequence

from smartinf import defaults
from smartinf.planning import io_schedule
from smartinf.planning.probe import GiB, MiB, probe


def format_report(result: dict) -> str:
    """The probe result as a readable table."""
    build = result["build"]
    lines = [f"smartinf build: io_uring={build['io_uring']} xrt={build['xrt']}; "
             f"engine requested: {result['engine_requested']}", "",
             f"{'directory':<40} {'engine':<8} {'size':>8} {'write GB/s':>11} {'read GB/s':>10}"]
    if result.get("repeats", 1) > 1:
        lines[-1] += f"   (best of {result['repeats']})"
    for s in result["storage"]:
        lines.append(f"{s['directory']:<40} {s['engine']:<8} {s['nbytes'] // MiB:>5} MiB "
                     f"{s['write_bps'] / 1e9:>11.2f} {s['read_bps'] / 1e9:>10.2f}"
                     + ("" if s["direct"] else "   buffered: no O_DIRECT here"))
        if s.get("mixed_bps"):
            bursts = ", ".join(f"{b // MiB} MiB bursts {bps / 1e9:.2f}" for b, bps in s["phased_bps"])
            lines.append(f"  half read + half written, GB/s: together {s['mixed_bps'] / 1e9:.2f}, "
                         f"{bursts}")
        if s.get("write_beside_update_bps"):
            lines.append(f"  written while the host's update runs: {s['write_beside_update_bps'] / 1e9:.2f} GB/s")
        if s.get("ring_mixed_bps"):
            lines.append(f"  the ring's streamed step, GB/s: mixed {s['ring_mixed_bps'] / 1e9:.2f}, "
                         f"phased {s['ring_phased_bps'] / 1e9:.2f}")
    hc = result["host_copy"]
    lines += ["", f"host memory copy: {hc['bps'] / 1e9:.2f} GB/s "
                  f"(np.copyto {hc['nbytes'] // MiB} MiB, best of {hc['repeats']})", "",
              f"{'Adam kernel grad/param':<34} {'Mparams/s':>10} {'state GB/s':>11}"]
    for k in result["kernel"]:
        name = (k["grad"] + "/" + k["param"]
                + (f", {k['state_dtype']} states" if k["state_dtype"] != "fp32" else "")
                + (", split master" if k.get("master", "fp32") == "split" else "")
                + (f", {k['threads']} threads" if k.get("threads", 1) > 1 else ""))
        lines.append(f"{name:<34} {k['params_per_s'] / 1e6:>10.0f} {k['state_bps'] / 1e9:>11.2f}")
    if "triad" in result:
        t = result["triad"]
        lines.append(f"STREAM triad, {t['threads']} threads: {t['bps'] / 1e9:.2f} GB/s")
    lines.append("(state GB/s: states read+written per param, 24 B fp32, ~12 B int8, ~8 B int8 + split "
                 "master, ~6 B int4 + split; vs storage above)")
    gpu = result.get("gpu")
    if gpu:
        rates = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in gpu["update_pps"].items())
        lines += ["", f"GPU {gpu['name']}: AdamW on states in its memory, G params/s: {rates}; "
                      f"PCIe host->GPU {gpu['host_to_gpu_bps'] / 1e9:.1f} GB/s, GPU->host "
                      f"{gpu['gpu_to_host_bps'] / 1e9:.1f} GB/s"]
    cards = result.get("smartssd", [])
    lines += ["", "SmartSSDs: " + ("none found (XRT build, XILINX_XRT set, FPGA and NVMe behind "
                                   "one switch, drive mounted)" if not cards else "")]
    for c in cards:
        lines.append(f"  FPGA {c['fpga']} on {c['directory']}: P2P read "
                     f"{c['p2p_read_bps'] / 1e9:.2f} GB/s, P2P write {c['p2p_write_bps'] / 1e9:.2f} "
                     f"GB/s, host->FPGA {c['host_to_fpga_bps'] / 1e9:.2f} GB/s, FPGA->host "
                     f"{c['fpga_to_host_bps'] / 1e9:.2f} GB/s"
                     + (f"  [{c['emulation']} emulation]" if c["emulation"] else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m smartinf.probe",
        description="Raw O_DIRECT storage bandwidth per directory, host copy bandwidth and "
                    "Adam kernel throughput: the limits smartinf steps are measured against.")
    parser.add_argument("dirs", nargs="*", metavar="DIR",
                        help=f"directories to measure (default: {tempfile.gettempdir()})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size-mib", type=int, default=GiB // MiB, metavar="N",
                        help="test file size per directory in MiB (default: %(default)s)")
    parser.add_argument("--engine", choices=defaults.IO_ENGINES, default="auto",
                        help="storage engine (default: %(default)s)")
    parser.add_argument("--record", action="store_true",
                        help="record each directory's storage figures (with what the ring "
                             "draws there under each schedule, which takes --size-mib of "
                             "states and twice that free) and the host's "
                             f"kernel rates in DIR/{io_schedule.RECORD}, where "
                             "io_schedule='auto' and a CudaDevice's twins=None read them")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="repeat the storage write+read R times, keep the best "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.size_mib <= 0 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = probe(args.dirs, args.size_mib * MiB, args.engine, args.repeats, ring=args.record)
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    if args.record:
        host = {k: result[k] for k in ("kernel", "triad", "gpu") if k in result}
        for storage in result["storage"]:
            path = io_schedule.record(storage["directory"], {**storage, **host})
            choice = io_schedule.from_figures(storage)
            print(f"recorded {path}: io_schedule='auto' runs {choice.schedule} there ({choice.reason})",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
