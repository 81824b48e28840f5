"""Shared fixtures of the benchmark suite.

Every benchmark runs on one directory (``SMARTINF_BENCH_DIR``, default the system temp
dir), so the step's ratio is taken against the raw bandwidth measured in the same run.
At session end the collected numbers go to ``bench/results/summary.json`` and a PNG.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import pytest

import smartinf._native as native

RESULTS = os.path.join(os.path.dirname(__file__), "results")
GiB = 1 << 30
logger = logging.getLogger("smartinf.bench")


def env_int(name: str, default: int) -> int:
    """An integer from the environment; accepts ``256e6``-style and ``0x`` values."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw, 0)
    except ValueError:
        return int(float(raw))


def require_disk(path: str, nbytes: int, what: str) -> None:
    """Skips the test when ``path`` lacks ``nbytes`` (+ 1 GiB margin) of free space."""
    free = shutil.disk_usage(path).free
    if free < nbytes + GiB:
        pytest.skip(f"{what} needs {(nbytes + GiB) / 1e9:.1f} GB free in {path}, "
                    f"only {free / 1e9:.1f} GB there (set SMARTINF_BENCH_DIR or a smaller size)")


def pytest_configure(config: pytest.Config) -> None:
    # --benchmark-json=bench/results/bench.json needs the folder before the session ends.
    os.makedirs(RESULTS, exist_ok=True)


def pytest_collection_modifyitems(items: list) -> None:
    # Bandwidth and step first: the memory test's tens of GB of I/O come last.
    items.sort(key=lambda item: "test_memory" in item.nodeid)


@pytest.fixture(scope="session")
def bench_dir():
    base = os.environ.get("SMARTINF_BENCH_DIR") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    path = tempfile.mkdtemp(prefix="smartinf-bench-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class StorageLimits:
    """Raw O_DIRECT bandwidth of the bench dir through the project's engine (bytes/s).

    ``test_storage_*`` fill it with their benchmark rounds; when they are deselected,
    the first user measures it here. The best round is kept: the highest bandwidth gives
    the smallest limit time, so a step's ratio to it is never flattered.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "bandwidth.bin")
        self.nbytes = env_int("SMARTINF_BENCH_IO_BYTES", 2 * GiB)
        self.bw: dict[str, float] = {}

    def time(self, write: bool) -> float:
        return native.time_storage(self.path, self.nbytes, write, "auto", 1 << 20, 16)

    def record(self, kind: str, seconds: list[float]) -> float:
        self.bw[kind] = max(self.bw.get(kind, 0.0), self.nbytes / min(seconds))
        return self.bw[kind]

    def _ensure(self) -> None:
        if "write" not in self.bw or "read" not in self.bw:
            require_disk(self.directory, self.nbytes, "the bandwidth measurement")
            for _ in range(2):  # read right after each write, as test_storage_read does
                self.record("write", [self.time(True)])
                self.record("read", [self.time(False)])
            self.remove()

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)

    @property
    def read_bw(self) -> float:
        self._ensure()
        return self.bw["read"]

    @property
    def write_bw(self) -> float:
        self._ensure()
        return self.bw["write"]


@pytest.fixture(scope="session")
def storage_limits(bench_dir):
    limits = StorageLimits(bench_dir)
    yield limits
    limits.remove()


@pytest.fixture(scope="session")
def summary(bench_dir, storage_limits):
    """Dict the tests fill; written to results/summary.json (+ PNG) at session end."""
    data: dict = {"bench_dir": bench_dir, "build": _build_info()}
    yield data
    data["storage"] = {f"{k}_bytes_per_s": v for k, v in storage_limits.bw.items()}
    with open(os.path.join(RESULTS, "summary.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    _plot(data)
    _print_summary(data)


def _build_info() -> dict:
    import smartinf
    return {"smartinf": smartinf.__version__, **smartinf.build_info(), "cpus": os.cpu_count()}


def _print_summary(data: dict) -> None:
    lines = ["", "smartinf bench summary"]
    for k, v in sorted(data.get("storage", {}).items()):
        lines.append(f"  storage {k:<22} {v / 1e9:8.2f} GB/s")
    for name, s in sorted(data.get("steps", {}).items()):
        lines.append(
            f"  {name:<22} step {s['step_s']:6.3f} s  limit {s['limit_s']:6.3f} s  "
            f"ratio {s['ratio']:5.2f}  {s['achieved_GBps']:5.2f} GB/s  "
            f"B/param storage {s['bytes_per_param']['storage']:.1f} "
            f"h2d {s['bytes_per_param']['host_to_device']:.1f} "
            f"d2h {s['bytes_per_param']['device_to_host']:.1f}")
        lines.append("  " + " " * 22 + " busy/step: " + "  ".join(
            f"{k} {v:.2f}" for k, v in s["busy_fraction"].items()))
        if "compute_serial_s" in s:
            lines.append("  " + " " * 22 + f" Adam kernel alone, 1 thread: {s['compute_serial_s']:.3f} s"
                         f" ({s['kernel_params_per_s_1thread'] / 1e6:.0f} M params/s)")
    for name, t in sorted(data.get("topk", {}).items()):
        lines.append(f"  topk {name:<20} compress {t['compress_s_per_1e8'] * 1e3:7.1f} ms/1e8  "
                     f"link time saved {t['link_s_saved'] * 1e3:7.1f} ms "
                     f"({t['link_bytes_per_s'] / 1e9:.1f} GB/s)  saved/compress "
                     f"{t['saved_over_compress']:.2f}")
    for name in ("int8", "int8_split", "int4_split"):
        if f"{name}_vs_fp32_states" in data:
            lines.append(f"  fp32 / {name} states step time: {data[f'{name}_vs_fp32_states']:.2f}")
    if "engine_threads_vs_uring" in data:
        lines.append(f"  threads / uring step time: {data['engine_threads_vs_uring']:.2f}")
    for name, m in sorted(data.get("rss", {}).items()):
        lines.append(f"  rss {name:<18} peak {m['peak_rss_bytes'] / 2**20:7.1f} MiB  "
                     f"current {m['vm_rss_bytes'] / 2**20:7.1f} MiB  "
                     f"(after imports {m['baseline_rss_bytes'] / 2**20:7.1f} MiB)")
    if "rss_ratio_big_vs_small" in data:
        lines.append(f"  rss ratio big/small (peak): {data['rss_ratio_big_vs_small']:.3f}")
    ds = data.get("deepspeed")
    if ds:
        lines.append(f"  DeepSpeed ZeRO-3, {ds['params'] / 1e6:.0f} M params, per iteration (median):")
        for mode, m in ds["modes"].items():
            lines.append(f"    {mode:<14} fwd {m['fwd_s']:6.2f} s  bwd {m['bwd_s']:6.2f} s  step "
                         f"{m['step_s']:6.2f} s  (storage limit {m['storage_limit_s']:5.2f} s)  "
                         f"storage {m['storage_bytes_per_param']:5.1f} B/param")
        lines.append(f"    step speedup {ds['step_speedup']:.2f} (traffic bound "
                     f"{ds['traffic_bound']:.2f}), iteration speedup {ds['iteration_speedup']:.2f}")
        if "int8_step_speedup" in ds:
            lines.append(f"    int8 states: step {ds['int8_step_speedup_over_fp32']:.2f}x fp32 states, "
                         f"{ds['int8_step_speedup']:.2f}x ZeRO-Infinity (iteration "
                         f"{ds['int8_iteration_speedup']:.2f}x)")
    print("\n".join(lines))


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is missing (pip install smartinf[bench]): no PNG")
        return None
    return plt


def _plot(data: dict) -> None:
    plt = _pyplot()
    if plt is None:
        return
    if "deepspeed" in data:
        from deepspeed_report import plot
        plot(plt, data["deepspeed"], os.path.join(RESULTS, "deepspeed_head_to_head.png"))
    steps = data.get("steps", {})
    if not steps:
        return
    names = sorted(steps)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [steps[n]["step_s"] for n in names], 0.4, label="step")
    ax1.bar([i + 0.2 for i in x], [steps[n]["limit_s"] for n in names], 0.4,
            label="storage limit (read/bw_r + write/bw_w)")
    for i, n in enumerate(names):
        ax1.text(i, steps[n]["step_s"], f"{steps[n]['ratio']:.2f}x", ha="center", va="bottom")
    ax1.set_xticks(list(x), names, rotation=15)
    ax1.set_ylabel("seconds")
    ax1.set_title("step time vs storage limit")
    ax1.legend(fontsize=8)
    stages = list(steps[names[0]]["busy_s"])
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        ax2.bar([i + j * width for i in range(len(stages))], [steps[n]["busy_s"][s] for s in stages],
                width, label=n)
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(stages))],
                   [s.replace("busy_", "") for s in stages], rotation=15)
    ax2.set_ylabel("busy seconds per step")
    ax2.set_title("stage busy time per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "step_vs_limit.png"), dpi=100)
    plt.close(fig)

