"""The update kernels' speed per state format, as a ratio to the fp32 kernel's on the same
cores in the same run: Adam on bf16 params and gradients (the DeepSpeed path's dtypes), on
one thread and on the pipeline's default threads, each format timed in turns with fp32
(best of three updates each, ``probe.measure_kernel``), the best of ``ROUNDS`` rounds kept.

The fp32 kernel is the bound the quantized ones are held to: they run its element (adam.h)
on decoded moments, so on a core where it is bound by its own arithmetic (two divisions
and a square root an element, on the one divider) a quantized update costs that plus its
decoding and coding, and reaches fp32's params/s only where fp32 waits on memory (many
threads on few memory channels): the ratio on all threads is the one that counts.
Results: ``bench/results/kernels.json``."""
from __future__ import annotations

import json
import os

import torch

import smartinf._native as native
from conftest import RESULTS, env_int
from smartinf.planning import probe

NUMEL = env_int("SMARTINF_BENCH_KERNEL_NUMEL", 1 << 23)
ROUNDS = env_int("SMARTINF_BENCH_ROUNDS", 3)
FORMATS = [("int8", "fp32"), ("int8", "split"), ("int4", "fp32"), ("int4", "split")]


def rates(threads: int) -> dict[str, float]:
    """Params/s per format, the best of ROUNDS rounds, fp32 timed before each format."""
    numel = NUMEL * max(1, threads)
    best: dict[str, float] = {}
    for _ in range(ROUNDS):
        for state_dtype, master in FORMATS:
            for sd, m in (("fp32", "fp32"), (state_dtype, master)):
                k = probe.measure_kernel(numel, "bfloat16", "bfloat16", sd, threads, m)
                name = sd if m == "fp32" else f"{sd}+split"
                best[name] = max(best.get(name, 0.0), k.params_per_s)
    return best


def test_quantized_kernels_against_fp32(benchmark):
    threads_all = native.default_compute_threads()
    record = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "numel_per_thread": NUMEL,
              "threads": {}}
    for threads in sorted({1, threads_all}):
        r = rates(threads)
        record["threads"][str(threads)] = {
            name: {"params_per_s": v, "vs_fp32": v / r["fp32"]} for name, v in r.items()}
        print(f"\n{threads} thread(s), {record['cpu_capability']}: " + ", ".join(
            f"{name} {v / 1e6:.0f} Mparams/s ({v / r['fp32']:.2f}x fp32)" for name, v in r.items()))
    benchmark.extra_info.update(record)
    # What pytest-benchmark times: one int4 + split update on all threads.
    benchmark.pedantic(probe.measure_kernel, args=(NUMEL * threads_all, "bfloat16", "bfloat16",
                                                   "int4", threads_all, "split"), rounds=1)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "kernels.json"), "w") as f:
        json.dump(record, f, indent=1)
    for per_format in record["threads"].values():
        assert all(v["params_per_s"] > 0 for v in per_format.values())
