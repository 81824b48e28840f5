"""1, 2 and 4 devices: measured step time against ``smartinf.planning.model``'s prediction.

Two series, each fed by the raw bandwidth of the bench directory measured in this run:

- ``own disks`` (or ``shared disk``): N plain emulated devices, one directory each. With
  ``SMARTINF_BENCH_DIRS=/a,/b,/c,/d`` (one per disk) every device has its own drive and
  the model expects N-fold scaling; with the default single bench directory the devices
  share one disk, and the model (and the machine) give none.
- ``emulated CSDs``: the same devices, each with its storage capped at
  ``SMARTINF_BENCH_CSD_GBPS`` (0.3) like a CSD's internal SSD, behind a host link capped at
  ``SMARTINF_BENCH_LINK_GBPS`` (0.15, each way): T_opt,n of the paper on one machine:
  storage-bound while N is small, host-link-bound once N devices outrun the link.

Results: ``bench/results/scaling.json`` and ``scaling.png`` (measured vs predicted).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import smartinf
import smartinf._native as native
from smartinf.planning import model
from smartinf.step.staging import depth_for, pipelined
from conftest import RESULTS, env_int, require_disk

DEVICES = [1, 2, 4]
# Enough params that the disk series outlasts the VM disk's caches; the emulated CSDs at
# 0.3 GB/s need fewer for steps of seconds.
DISK_PARAMS = env_int("SMARTINF_BENCH_SCALING_PARAMS", 128 << 20)
CSD_PARAMS = env_int("SMARTINF_BENCH_CSD_PARAMS", 32 << 20)
SUBGROUP = 4 << 20
ROUNDS = env_int("SMARTINF_BENCH_ROUNDS", 3)
CSD_GBPS = float(os.environ.get("SMARTINF_BENCH_CSD_GBPS", "0.3"))
LINK_GBPS = float(os.environ.get("SMARTINF_BENCH_LINK_GBPS", "0.15"))
MIXED_BYTES = env_int("SMARTINF_BENCH_MIXED_BYTES", 1 << 30)  # per stream
GRAD_BYTES, PARAM_BYTES = 4, 2  # fp32 gradients in, fp16 params out


def device_dirs(bench_dir: str, n: int) -> list[str]:
    roots = [d for d in os.environ.get("SMARTINF_BENCH_DIRS", "").split(",") if d]
    roots = roots or [bench_dir]
    return [os.path.join(roots[i % len(roots)], f"scaling-{n}-{i}") for i in range(n)]


def mixed_bandwidth(dirs: list[str], nbytes: int) -> float:
    """Bytes/s the disk(s) under ``dirs`` move with one raw O_DIRECT reader and one writer
    per directory at once (the project's engine, 1 MiB pieces, 16 in flight each): the
    I/O pattern N devices' rings make, without their compute. On a shared disk this, not
    the single-stream figure, is the limit N devices share."""
    reads = [os.path.join(d, "mixed-read.bin") for d in dirs]
    writes = [os.path.join(d, "mixed-write.bin") for d in dirs]
    for d, path in zip(dirs, reads):
        os.makedirs(d, exist_ok=True)
        native.time_storage(path, nbytes, True, "auto", 1 << 20, 16)
    jobs = [(path, False) for path in reads] + [(path, True) for path in writes]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda job: native.time_storage(job[0], nbytes, job[1], "auto", 1 << 20, 16),
                      jobs))
    elapsed = time.perf_counter() - start
    for path in reads + writes:
        os.remove(path)
    return len(jobs) * nbytes / elapsed


def measure(dirs: list[str], params: int, storage_gbps: float | None,
            link_gbps: float | None) -> dict:
    """Median step time over ROUNDS steps of ``params`` params on ``dirs`` (after one
    warm-up step), with per-device counters of the last one."""
    devices = [smartinf.CpuDevice(d, storage_gbps=storage_gbps) for d in dirs]
    sizes = [min(SUBGROUP, params - i) for i in range(0, params, SUBGROUP)]
    depth = depth_for(len(devices))
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(SUBGROUP, dtype=np.float32) * 1e-3 for _ in range(depth)]
    outs = [np.empty(SUBGROUP, np.float16) for _ in range(depth)]
    try:
        with smartinf.Pipeline(devices, smartinf.AdamW(lr=1e-4), host_link_gbps=link_gbps) as pipe:
            sgs = [pipe.add_subgroup(n) for n in sizes]
            times = []
            for _ in range(ROUNDS + 1):
                before = pipe.device_stats
                start = time.perf_counter()
                with pipe.step():
                    pipelined(sgs, lambda sg, b: pipe.update(sg, grads[b][:sizes[sg]],
                                                             outs[b][:sizes[sg]]),
                              lambda sg, future, b: future.wait(), depth)
                times.append(time.perf_counter() - start)
            after = pipe.device_stats
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    per_device = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]
    for d, a in zip(per_device, after):
        d["numel"] = a["numel"]
    return {"step_s": statistics.median(times[1:]), "rounds_s": times[1:],
            "warmup_s": times[0], "devices": per_device}


@pytest.mark.parametrize("series", ["disks", "emulated CSDs"])
def test_scaling_against_the_model(bench_dir, storage_limits, series):
    capped = series == "emulated CSDs"
    params = CSD_PARAMS if capped else DISK_PARAMS
    require_disk(bench_dir, params * 24 + (1 << 30), "the scaling benchmark")
    read, write = storage_limits.read_bw, storage_limits.write_bw  # this run's disk
    own_disks = len({os.path.dirname(d) for d in device_dirs(bench_dir, max(DEVICES))}) > 1
    label = series if capped else ("own disks" if own_disks else "shared disk")
    rows = []
    for n in DEVICES:
        # The limit N devices share on one disk: its throughput under their I/O pattern.
        mixed = None if own_disks else mixed_bandwidth(device_dirs(bench_dir, n), MIXED_BYTES)
        shared = dict(shared_read_bps=mixed, shared_write_bps=mixed)
        if capped:
            hw = model.Hardware(CSD_GBPS * 1e9, CSD_GBPS * 1e9, host_link_bps=LINK_GBPS * 1e9,
                                **shared)
        else:
            hw = model.Hardware(read, write, **shared)
        p = model.predict(params, n, hw, "smartupdate", GRAD_BYTES, PARAM_BYTES)
        m = measure(device_dirs(bench_dir, n), params, CSD_GBPS if capped else None,
                    LINK_GBPS if capped else None)
        rows.append({"n": n, "hardware": dict(vars(hw)), "mixed_bps": mixed,
                     "predicted_s": p.step_s, "bound": p.bound, "storage_s": p.storage_s,
                     "link_s": p.link_s, **m, "measured_over_predicted": m["step_s"] / p.step_s})
    result = {"series": label, "params": params, "subgroup": SUBGROUP, "rounds": ROUNDS,
              "disk_read_bps": read, "disk_write_bps": write,
              "csd_gbps": CSD_GBPS if capped else None, "link_gbps": LINK_GBPS if capped else None,
              "rows": rows}
    _save(label, result)
    for r in rows:
        print(f"{label:>14} n={r['n']}: measured {r['step_s']:.3f} s, predicted {r['predicted_s']:.3f} s "
              f"({r['bound']}), ratio {r['measured_over_predicted']:.2f}")


def _save(label: str, result: dict) -> None:
    path = os.path.join(RESULTS, "scaling.json")
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[label] = result
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], sorted(data.items())):
        n = [row["n"] for row in r["rows"]]
        ax.plot(n, [row["predicted_s"] for row in r["rows"]], marker="o", label="model")
        ax.plot(n, [row["step_s"] for row in r["rows"]], marker="s", label="measured (median)")
        for row in r["rows"]:
            ax.annotate(f"{row['measured_over_predicted']:.2f}", (row["n"], row["step_s"]),
                        textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax.set(xlabel="devices", ylabel="optimizer step (s)", xticks=n,
               title=f"{name}: {r['params'] / 1e6:.0f} M params")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "scaling.png"), dpi=110)
    plt.close(fig)
