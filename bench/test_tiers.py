"""The memory tier on this machine: the step against the fraction of states resident in
memory (0, 25, 50, 100 %), on one directory in one run, beside ``smartinf.planning.model``'s
prediction from the bandwidths measured in the same run; and the parallel update's rate
against a STREAM triad over the same threads (goal >= 0.7).

Each round opens the directory once per fraction (the budget is fixed at creation), in
alternating order, and times two steps after a warm-up; medians over the rounds. Results:
``bench/results/tiers.json`` and ``.png`` (copied to ``bench/measured/`` by hand).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time

import pytest
import torch

import smartinf
from smartinf.planning import model, probe
from conftest import RESULTS, env_int, require_disk

SUBGROUP = 16 << 20
PARAMS = env_int("SMARTINF_BENCH_PARAMS", 256 << 20)
ROUNDS = env_int("SMARTINF_BENCH_ROUNDS", 5)
FRACTIONS = (0.0, 0.25, 0.5, 1.0)
STATE_BYTES = 12  # fp32 AdamW, one copy
KERNEL_BYTES = 2 * STATE_BYTES + 2 + 2  # states in and out, bf16 gradient in, bf16 param out


def open_pipe(directory: str, fraction: float, commit_every: int = 1) -> tuple:
    pipe = smartinf.Pipeline(directory, smartinf.AdamW(lr=1e-4), chunk=1 << 20,
                             memory_budget=int(fraction * PARAMS * STATE_BYTES) + (1 << 20),
                             commit_every=commit_every)
    sizes = [min(SUBGROUP, PARAMS - i) for i in range(0, PARAMS, SUBGROUP)]
    for n in sizes:
        pipe.add_subgroup(n)
    return pipe, sizes


def one_step(pipe, sizes, grads, outs) -> tuple[float, dict]:
    before = pipe.stats
    start = time.perf_counter()
    futures = [None, None]
    with pipe.step():
        for sg, n in enumerate(sizes):
            k = sg % 2
            if futures[k] is not None:
                futures[k].wait()
            futures[k] = pipe.update(sg, grads[k][:n], outs[k][:n])
    elapsed = time.perf_counter() - start
    after = pipe.stats
    return elapsed, {k: after[k] - before[k] for k in after}


def prepare(bench_dir: str, name: str, storage_limits) -> tuple:
    """A directory holding the states (created, not timed), after the disk's bandwidth is
    measured, and two bf16 gradient / param buffer pairs, as in bf16 training."""
    directory = os.path.join(bench_dir, name)
    require_disk(bench_dir, PARAMS * 2 * STATE_BYTES, f"the {name} benchmark")
    os.makedirs(directory, exist_ok=True)
    grads = [torch.randn(SUBGROUP, generator=torch.Generator().manual_seed(k)).mul_(1e-3).bfloat16()
             for k in range(2)]
    outs = [torch.empty(SUBGROUP, dtype=torch.bfloat16) for _ in range(2)]
    storage_limits.read_bw  # the disk's bandwidth before the steps
    pipe, _ = open_pipe(directory, 0.0)
    pipe.close()
    return directory, grads, outs


def test_step_against_the_resident_fraction(bench_dir, storage_limits, summary):
    directory, grads, outs = prepare(bench_dir, "tiers", storage_limits)
    measured: dict = {f: [] for f in FRACTIONS}
    for r in range(ROUNDS):
        for fraction in (FRACTIONS if r % 2 == 0 else FRACTIONS[::-1]):
            pipe, sizes = open_pipe(directory, fraction)
            try:
                one_step(pipe, sizes, grads, outs)  # warm-up
                measured[fraction] += [one_step(pipe, sizes, grads, outs) for _ in range(2)]
            finally:
                pipe.close()
    for _ in range(2):
        storage_limits.record("write", [storage_limits.time(True)])
        storage_limits.record("read", [storage_limits.time(False)])
    storage_limits.remove()
    triad = probe.measure_triad()
    kernel = probe.measure_kernel(SUBGROUP, "bfloat16", "bfloat16", threads=0)
    read_bw, write_bw = storage_limits.read_bw, storage_limits.write_bw
    rows = []
    for fraction, runs in measured.items():
        step_s = statistics.median(s for s, _ in runs)
        delta = runs[0][1]
        predicted = model.predict_tiered(PARAMS, fraction, read_bw, write_bw, triad.bps,
                                         update_pps=kernel.params_per_s)
        rows.append({"resident": fraction, "step_s": step_s, "steps_s": [s for s, _ in runs],
                     "predicted_s": predicted.step_s, "bound": predicted.bound,
                     "ratio_to_prediction": step_s / predicted.step_s,
                     "storage_read": delta["storage_read"], "storage_write": delta["storage_write"],
                     "memory_read": delta["memory_read"], "memory_write": delta["memory_write"]})
    result = {"params": PARAMS, "read_bw": read_bw, "write_bw": write_bw, "triad_bps": triad.bps,
              "threads": triad.threads, "kernel_params_per_s": kernel.params_per_s,
              "kernel_bps": kernel.params_per_s * KERNEL_BYTES,
              "kernel_to_triad": kernel.params_per_s * KERNEL_BYTES / triad.bps, "rows": rows}
    summary["tiers"] = result
    with open(os.path.join(RESULTS, "tiers.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(RESULTS, "tiers.png"))
    for row in rows:
        print(f"resident {row['resident']:4.0%}: step {row['step_s']:.2f} s, predicted "
              f"{row['predicted_s']:.2f} s ({row['bound']}), ratio {row['ratio_to_prediction']:.2f}")
    print(f"parallel update {result['kernel_bps'] / 1e9:.1f} GB/s on {triad.threads} threads, "
          f"STREAM triad {triad.bps / 1e9:.1f} GB/s: {result['kernel_to_triad']:.2f} (goal >= 0.7)")


def test_half_resident_with_a_commit_interval(bench_dir, storage_limits, summary):
    """Half the states resident and commit_every=10 against storage only: mean step over
    10 steps (one durable commit among them), twice each, alternating; goal about half."""
    directory, grads, outs = prepare(bench_dir, "interval", storage_limits)
    means: dict = {"storage only": [], "half resident, commit_every=10": []}
    for _ in range(2):
        for name, fraction, every in (("storage only", 0.0, 1),
                                      ("half resident, commit_every=10", 0.5, 10)):
            pipe, sizes = open_pipe(directory, fraction, every)
            try:
                while pipe.step_count % 10:  # start at an interval's first step
                    one_step(pipe, sizes, grads, outs)
                means[name].append(statistics.mean(one_step(pipe, sizes, grads, outs)[0]
                                                   for _ in range(10)))
            finally:
                pipe.close()
    read_bw, write_bw = storage_limits.read_bw, storage_limits.write_bw
    result = {name: {"mean_step_s": statistics.median(m), "rounds": m,
                     "predicted_s": model.predict_tiered(PARAMS, f, read_bw, write_bw, math.inf,
                                                         commit_every=k).step_s}
              for (name, m), f, k in zip(means.items(), (0.0, 0.5), (1, 10))}
    ratio = result["half resident, commit_every=10"]["mean_step_s"] / result["storage only"]["mean_step_s"]
    summary["tiers_interval"] = {**result, "ratio": ratio}
    with open(os.path.join(RESULTS, "tiers-interval.json"), "w") as f:
        json.dump({**result, "ratio": ratio, "params": PARAMS}, f, indent=1)
    for name, r in result.items():
        print(f"{name}: mean step {r['mean_step_s']:.2f} s (predicted {r['predicted_s']:.2f} s)")
    print(f"half resident with commit_every=10 / storage only: {ratio:.2f} (goal about 0.5)")


def test_background_commit_hides_the_durable_write(bench_dir, storage_limits, summary):
    """Every state resident (a budget for two copies), commit_every=10, with overlap (the
    durable commit's writes in the background) and without, alternating, twice each: the
    mean step over 20 steps (two durable commits among them) against the median step. The
    caller's forward and backward are stood in for by a sleep between steps (a GPU's; the
    cores stay free), SMARTINF_BENCH_GAP_S seconds (0.5). Goal: overlap's mean within 10 %
    of its median; without it the commit's write lands in one step."""
    directory, grads, outs = prepare(bench_dir, "overlap", storage_limits)
    gap = float(os.environ.get("SMARTINF_BENCH_GAP_S", "0.5"))
    runs: dict = {"overlap": [], "no overlap": []}
    for _ in range(2):
        for name in runs:
            pipe = smartinf.Pipeline(directory, smartinf.AdamW(lr=1e-4), chunk=1 << 20,
                                     memory_budget=2 * PARAMS * STATE_BYTES + (2 << 20),
                                     commit_every=10, overlap=name == "overlap")
            try:
                sizes = [min(SUBGROUP, PARAMS - i) for i in range(0, PARAMS, SUBGROUP)]
                for n in sizes:
                    pipe.add_subgroup(n)
                while pipe.step_count % 10:  # start at an interval's first step
                    one_step(pipe, sizes, grads, outs)
                steps = []
                for _ in range(20):
                    time.sleep(gap)
                    steps.append(one_step(pipe, sizes, grads, outs)[0])
                pipe.flush()
                stats = pipe.stats
                runs[name].append({"steps": steps, "mean_s": statistics.mean(steps),
                                   "median_s": statistics.median(steps),
                                   "busy_persist": stats["busy_persist"],
                                   "wait_commit": stats["wait_commit"]})
            finally:
                pipe.close()
    result = {name: {"mean_step_s": statistics.median(r["mean_s"] for r in rs),
                     "median_step_s": statistics.median(r["median_s"] for r in rs), "rounds": rs}
              for name, rs in runs.items()}
    for r in result.values():
        r["mean_over_median"] = r["mean_step_s"] / r["median_step_s"]
        # the iteration: the caller's gap and the step
        r["iteration_mean_over_median"] = (gap + r["mean_step_s"]) / (gap + r["median_step_s"])
    summary["background_commit"] = {k: {m: v for m, v in r.items() if m != "rounds"}
                                    for k, r in result.items()}
    with open(os.path.join(RESULTS, "background-commit.json"), "w") as f:
        json.dump({**result, "params": PARAMS, "gap_s": gap}, f, indent=1)
    for name, r in result.items():
        print(f"{name}: mean step {r['mean_step_s']:.3f} s, median {r['median_step_s']:.3f} s "
              f"({r['mean_over_median']:.2f}x; iterations with the {gap} s gap: "
              f"{r['iteration_mean_over_median']:.2f}x)")


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        pytest.skip("matplotlib is not installed")
    rows = result["rows"]
    x = [100 * r["resident"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["step_s"] for r in rows], "o-", label="measured (median)")
    ax.plot(x, [r["predicted_s"] for r in rows], "s--", label="smartinf.planning.model")
    ax.set_xlabel("states resident in memory (%)")
    ax.set_ylabel("optimizer step (s)")
    ax.set_title(f"{result['params'] / 1e6:.0f} M params, fp32 AdamW, one directory", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
