"""What the extent checksums cost: XXH3-64 throughput on one core, and a step with
``verify=True`` (every load checked) against one without, on the same directory in the
same run. Write-back always computes the checksum, so both steps include that part;
its share is modelled from the throughput. Results: ``bench/results/checksum.json``."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time

import numpy as np

import smartinf
import smartinf._native as native
from conftest import RESULTS, env_int, require_disk

PARAMS = env_int("SMARTINF_BENCH_CHECKSUM_PARAMS", 64 << 20)
SUBGROUP = 16 << 20
ROUNDS = env_int("SMARTINF_BENCH_ROUNDS", 3)


def xxh3_bytes_per_s(nbytes: int = 256 << 20) -> float:
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    native.checksum(buf.ctypes.data, nbytes)  # warm the pages
    best = min(_timed(lambda: native.checksum(buf.ctypes.data, nbytes)) for _ in range(3))
    return nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_times(directory: str, verify: bool) -> list[float]:
    sizes = [min(SUBGROUP, PARAMS - i) for i in range(0, PARAMS, SUBGROUP)]
    grad = np.full(SUBGROUP, 1e-3, np.float32)
    outs = [np.empty(SUBGROUP, np.float16) for _ in range(2)]
    times = []
    with smartinf.Pipeline(directory, smartinf.AdamW(lr=1e-4), verify=verify) as pipe:
        sgs = [pipe.add_subgroup(n) for n in sizes]
        for _ in range(ROUNDS + 1):
            start = time.perf_counter()
            with pipe.step():
                futures = [None, None]
                for i, (sg, n) in enumerate(zip(sgs, sizes)):
                    if futures[i % 2] is not None:
                        futures[i % 2].wait()
                    futures[i % 2] = pipe.update(sg, grad[:n], outs[i % 2][:n])
            times.append(time.perf_counter() - start)
    return times[1:]


def test_checksum_cost(bench_dir):
    require_disk(bench_dir, PARAMS * 24 + (1 << 30), "the checksum benchmark")
    rate = xxh3_bytes_per_s()
    directory = os.path.join(bench_dir, "checksum")
    plain, verified = [], []
    try:
        for _ in range(2):  # alternate, so drift of the disk hits both alike
            plain += step_times(directory, verify=False)
            verified += step_times(directory, verify=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    t_plain, t_verify = statistics.median(plain), statistics.median(verified)
    state_bytes = PARAMS * 12
    result = {
        "params": PARAMS, "xxh3_bytes_per_s": rate,
        "step_s": t_plain, "step_verify_s": t_verify,
        "verify_over_plain": t_verify / t_plain,
        # Hashing work per step as a share of the step (one core): write-back always,
        # loads only with verify.
        "writeback_hash_fraction": state_bytes / rate / t_plain,
        "verify_hash_fraction": 2 * state_bytes / rate / t_verify,
        "rounds_plain_s": plain, "rounds_verify_s": verified,
    }
    with open(os.path.join(RESULTS, "checksum.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nXXH3 {rate / 1e9:.1f} GB/s; step {t_plain:.3f} s, with verify {t_verify:.3f} s "
          f"({t_verify / t_plain:.3f}x); hashing = {result['writeback_hash_fraction']:.1%} of a "
          f"step (write-back), {result['verify_hash_fraction']:.1%} with verify")
