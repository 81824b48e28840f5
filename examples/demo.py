"""smartinf demo: Adam(W) steps over a few hundred million parameters kept on disk.

    python examples/demo.py [--params 200000000] [--steps 4] [--dir /tmp]

The optimizer states (fp32 master weights + two Adam moments, 12 B/param) live in a
temporary directory on disk; each step sends gradients in and gets fp16 params out, while
the pipeline streams the states from storage, updates them and writes them back. The
step time is compared with the raw storage bandwidth measured in the same run, and the
traffic per link with what ZeRO-Infinity would move (Table I of the Smart-Infinity paper).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

import smartinf
from smartinf import model, probe  # (smartinf.planning.model and .probe, by their public names)

SUBGROUP = 16 << 20  # params per sub-group (DeepSpeed's sub_group_size)
CHUNK = 1 << 20  # params per pipeline chunk
STATE_BYTES = 24  # two shadow copies (A/B) of 12 B/param of fp32 states
MARGIN = 256 << 20  # free space we leave on the disk
MIN_PARAMS = 1 << 20


def plan_params(directory: str, wanted: int, probe_bytes: int) -> int:
    """The number of params that fits in ``directory`` next to the probe file."""
    free = shutil.disk_usage(directory).free - probe_bytes - MARGIN
    fits = max(0, free // STATE_BYTES) // CHUNK * CHUNK
    if fits >= wanted:
        return wanted
    if fits < MIN_PARAMS:
        raise OSError(f"{directory} has {shutil.disk_usage(directory).free / 1e9:.2f} GB free: "
                      f"not enough for the demo (use --dir on a larger disk)")
    print(f"note: {directory} has room for {fits / 1e6:.0f} M params only "
          f"({STATE_BYTES} B/param + {probe_bytes >> 20} MiB probe file): "
          f"scaling down from {wanted / 1e6:.0f} M", file=sys.stderr)
    return fits


def progress(total: int, desc: str) -> tqdm:
    # (a terminal's only: in a log, tqdm's carriage returns flood the file)
    return tqdm(total=total, desc=desc, unit="param", unit_scale=True, leave=False,
                disable=not sys.stderr.isatty())


def run_steps(pipe: smartinf.Pipeline, sizes: list[int], steps: int,
              limit: probe.StorageLimit) -> dict:
    """Runs ``steps`` optimizer steps over the sub-groups; returns the counter deltas."""
    rng = np.random.default_rng(0)
    # Two gradient buffers, alternated, instead of new random numbers every step; the
    # last (smaller) sub-group uses a prefix view. Real training would pass each
    # sub-group's own gradient.
    grads = [(rng.standard_normal(SUBGROUP, dtype=np.float32) * 1e-3) for _ in range(2)]
    # One fp16 output per in-flight update, reused: real training would keep the whole
    # model's fp16 weights and pass each sub-group's slice of them as ``out``.
    outs = [np.empty(SUBGROUP, np.float16) for _ in range(2)]
    numel = sum(sizes)
    start = pipe.stats
    # limit: the step's bytes read at the raw read bandwidth plus its bytes written at the
    # raw write bandwidth (probe above). It assumes reads and writes take turns; a disk
    # that overlaps them can beat it (time/limit < 1).
    print(f"{'step':>4} {'time s':>8} {'storage GB/s':>13} {'limit s':>8} {'time/limit':>11}")
    for step in range(steps):
        before = pipe.stats
        bar = progress(numel, f"step {step + 1}/{steps}")
        t0 = time.perf_counter()
        with pipe.step():
            # Two updates in flight: submit the next sub-group while the previous one
            # still runs; a buffer pair is reused only once its update is done.
            inflight = [None, None]  # (future, numel) per buffer pair
            for sg, n in enumerate(sizes):
                pair = sg % 2
                if inflight[pair] is not None:
                    inflight[pair][0].wait()
                    bar.update(inflight[pair][1])
                inflight[pair] = (pipe.update(sg, grads[pair][:n], outs[pair][:n]), n)
            for future, n in filter(None, inflight):
                future.wait()
                bar.update(n)
            # The step's exit commits: waits for every write-back, fsyncs, flips A/B.
        seconds = time.perf_counter() - t0
        bar.close()
        after = pipe.stats
        read = after["storage_read"] - before["storage_read"]
        written = after["storage_write"] - before["storage_write"]
        bound = model.storage_bound_from_bytes(read, written, limit.read_bps, limit.write_bps)
        print(f"{step + 1:>4} {seconds:>8.2f} {(read + written) / seconds / 1e9:>13.2f} "
              f"{bound:>8.2f} {seconds / bound:>11.2f}", flush=True)
    end = pipe.stats
    return {k: end[k] - start[k] for k in end}


def traffic_table(delta: dict, numel: int, steps: int, grad_bytes: int, param_bytes: int) -> str:
    """Measured bytes/param/step per link next to the SmartUpdate and ZeRO-Infinity models."""
    ours = model.traffic_per_param("smartupdate", grad_bytes, param_bytes)
    zero = model.traffic_per_param("zero-infinity", grad_bytes, param_bytes)
    per = numel * steps
    measured = {
        "host_to_device": delta["host_to_device"] / per,
        "device_to_host": delta["device_to_host"] / per,
        "storage_read": delta["storage_read"] / per,
        "storage_write": delta["storage_write"] / per,
    }
    measured["host_link_total"] = measured["host_to_device"] + measured["device_to_host"]
    rows = [("host -> device (host link)", "host_to_device"),
            ("device -> host (host link)", "device_to_host"),
            ("host link total", "host_link_total"),
            ("storage read", "storage_read"),
            ("storage write", "storage_write")]
    lines = [f"{'B/param/step':<28} {'measured':>9} {'SmartUpdate':>12} {'ZeRO-Inf.':>10}"
             f" {'GB/step here':>13} {'GB/step ZeRO':>13}"]
    for label, key in rows:
        lines.append(f"{label:<28} {measured[key]:>9.2f} {ours[key]:>12} {zero[key]:>10}"
                     f" {measured[key] * numel / 1e9:>13.2f} {zero[key] * numel / 1e9:>13.2f}")
    lines.append(f"ZeRO-Infinity moves all {zero['host_link_total']} B/param over the host link "
                 f"(states and fp32 grads to and from storage); here only "
                 f"{measured['host_link_total']:.0f} B/param cross it, the "
                 f"{ours['storage_total']} B/param of states stay inside the device.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=200e6,
                        help="model size in parameters (default: 200e6)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default: 4)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="directory on the disk to keep the states on (default: %(default)s)")
    parser.add_argument("--probe-mib", type=int, default=1024,
                        help="size of the storage bandwidth probe file (default: %(default)s)")
    args = parser.parse_args()
    if args.params < 1 or args.steps < 1 or args.probe_mib < 1:
        parser.error("--params, --steps and --probe-mib must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    workdir = None
    try:
        if not os.path.isdir(args.dir):
            raise FileNotFoundError(f"--dir {args.dir} is not an existing directory")
        probe_bytes = args.probe_mib << 20
        numel = plan_params(args.dir, int(args.params), probe_bytes)
        workdir = tempfile.mkdtemp(prefix="smartinf-demo-", dir=args.dir)
        print(f"smartinf {smartinf.__version__}, build {smartinf.build_info()}; "
              f"states in {workdir}")

        # Best of 2: a single pass can be slowed by background work on the disk (e.g.
        # discards of files just deleted), which would flatter the ratio below.
        limit = probe.measure_storage(workdir, probe_bytes, repeats=2, mix=False)  # read, write only
        print(f"raw storage ({limit.engine}, O_DIRECT, {limit.nbytes >> 20} MiB, best of 2): "
              f"write {limit.write_bps / 1e9:.2f} GB/s, read {limit.read_bps / 1e9:.2f} GB/s")

        sizes = [min(SUBGROUP, numel - start) for start in range(0, numel, SUBGROUP)]
        with smartinf.Pipeline(workdir, smartinf.AdamW(lr=1e-4), chunk=CHUNK, slots=4) as pipe:
            t0 = time.perf_counter()
            for n in sizes:
                pipe.add_subgroup(n)  # zeros: writes 12 B/param of initial states to disk
            print(f"model: {numel / 1e6:.0f} M params in {len(sizes)} sub-groups of "
                  f"<= {SUBGROUP >> 20} Mi, {numel * 12 / 1e9:.2f} GB of states; "
                  f"engine {pipe.engine}; initialized in {time.perf_counter() - t0:.1f} s")
            delta = run_steps(pipe, sizes, args.steps, limit)
            busy = ", ".join(f"{k[5:]} {delta[k]:.1f} s" for k in sorted(delta)
                             if k.startswith("busy_"))
            print(f"busy time per stage over {args.steps} steps: {busy}")
        print()
        print(traffic_table(delta, numel, args.steps, grad_bytes=4, param_bytes=2))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError, MemoryError) as e:
        print(f"\ndemo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
