"""The README's optimizer on the CPU against torch's fused AdamW, alternated in one process.

    .venv/bin/python -m pytest bench/test_cpu_step.py -s [--benchmark-disable]
    SMARTINF_BENCH_CPU_PARAMS=23e6,200e6 SMARTINF_BENCH_CPU_STEPS=20 (the defaults)

``smartinf.optim.AdamW(params, devices=[dir])`` as the README writes it (states in host memory,
the planner's default; no clipping, no loss scaling) and ``torch.optim.AdamW(fused=True)``,
each on its own copy of an fp32 model of ``d x d`` linear layers fed the same gradients,
step after step in turns (the order swapped every round, so that neither always follows the
other); medians of each one's step times after two warm-up steps, their ratio (issue 89's
acceptance: at most 1.0 at 23 M) and of their fastest steps (on a shared VM, what each does
when others leave it the cores), torch's default (foreach) AdamW beside them, smartinf's
phases (``last_step_phases``) and the machine's load average, since on a shared 2-core VM
other processes' threads move every number. The two runs' params are compared at the end:
the same steps taken. Results: ``bench/results/cpu_step.json``. And the first step
(``-k first``): the optimizer made and its first step taken, against torch's fused AdamW's
first step (``bench/results/cpu_first_step.json``).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch

import smartinf.optim
from conftest import RESULTS, env_int

SIZES = [int(float(s)) for s in os.environ.get("SMARTINF_BENCH_CPU_PARAMS", "23e6,200e6").split(",")
         if s.strip()]
STEPS = env_int("SMARTINF_BENCH_CPU_STEPS", 20)
#: torch's default (foreach) AdamW beside them up to this many params (1.7 s a 23 M step at
#: load 9 here: at 200 M it would take most of the run)
FOREACH_UP_TO = env_int("SMARTINF_BENCH_CPU_FOREACH_UP_TO", 64 << 20)
WARMUP = 2
WIDTH = 1024


def model_params(numel: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """fp32 params of ``numel // (WIDTH * WIDTH)`` linear layers (weights and biases)."""
    torch.manual_seed(seed)
    layers = max(1, numel // (WIDTH * WIDTH))
    return [p for _ in range(layers) for p in torch.nn.Linear(WIDTH, WIDTH).parameters()]


def record(name: str, numel: int, result: dict) -> None:
    """``result`` under its size's key in ``bench/results/<name>`` (the other sizes kept)."""
    path = os.path.join(RESULTS, name)
    recorded = json.load(open(path)) if os.path.exists(path) else {}
    recorded[f"{numel / 1e6:.0f}M"] = result
    with open(path, "w") as f:
        json.dump(recorded, f, indent=2, sort_keys=True)


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


@pytest.mark.parametrize("numel", SIZES, ids=[f"{n / 1e6:.0f}M" for n in SIZES])
def test_cpu_step_against_torch_fused(benchmark, tmp_path, numel):
    ours_params = model_params(numel)
    fused_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    foreach_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params] \
        if numel <= FOREACH_UP_TO else []
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator) * 1e-3 for p in ours_params]
    for params in (ours_params, fused_params, foreach_params):
        for p, g in zip(params, grads):
            p.grad = g  # (one gradient each, shared: none of the three writes it)
    ours = smartinf.optim.AdamW(ours_params, lr=1e-4, devices=[str(tmp_path / "states")])
    runs = {"smartinf": ours, "torch_fused": torch.optim.AdamW(fused_params, lr=1e-4, fused=True)}
    if numel <= FOREACH_UP_TO:
        runs["torch_foreach"] = torch.optim.AdamW(foreach_params, lr=1e-4)
    times: dict[str, list[float]] = {name: [] for name in runs}
    phases: list[dict] = []
    load = [os.getloadavg()[0]]

    def round_(i: int) -> None:
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            t0 = time.perf_counter()
            runs[name].step()
            seconds = time.perf_counter() - t0
            if WARMUP <= i < WARMUP + STEPS:
                times[name].append(seconds)
                if name == "smartinf":
                    phases.append(dict(ours.last_step_phases))

    for i in range(WARMUP + STEPS):
        round_(i)
    # (pytest-benchmark's table: one more round of both, out of the medians)
    benchmark.pedantic(lambda: round_(WARMUP + STEPS), rounds=1, iterations=1)
    load.append(os.getloadavg()[0])
    ours.close()
    for a, b in zip(ours_params, fused_params):  # the same steps taken (fp32 tolerance)
        torch.testing.assert_close(a.detach(), b.detach())

    medians = {name: median_ms(t) for name, t in times.items()}
    least = {name: min(t) * 1e3 for name, t in times.items()}
    ratio = medians["smartinf"] / medians["torch_fused"]
    result = {"params": sum(p.numel() for p in ours_params), "steps": STEPS,
              "median_ms": medians, "ratio_to_torch_fused": ratio,
              # (the fastest steps: what each does with the machine to itself, near enough)
              "min_ms": least, "ratio_of_minima": least["smartinf"] / least["torch_fused"],
              "ratio_to_torch_foreach": medians["smartinf"] / medians["torch_foreach"]
              if "torch_foreach" in medians else None,
              "smartinf_phases_median_ms": {k: median_ms([p[k] for p in phases])
                                            for k in phases[0]},
              "all_ms": {name: [round(s * 1e3, 1) for s in t] for name, t in times.items()},
              "load_average_1min": load, "cpus": len(os.sched_getaffinity(0)),
              "torch_threads": torch.get_num_threads(), "placement": str(ours.placement)}
    benchmark.extra_info.update(result)
    record("cpu_step.json", numel, result)
    print(f"\n{result['params'] / 1e6:.1f} M fp32 params, {STEPS} steps each, alternated "
          f"(load average {load[0]:.1f} -> {load[1]:.1f} on {result['cpus']} CPUs): median step "
          + ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items())
          + f"; smartinf / torch fused {ratio:.2f}x (of their fastest steps, "
          f"{least['smartinf']:.1f} / {least['torch_fused']:.1f} ms, "
          f"{result['ratio_of_minima']:.2f}x); smartinf's phases "
          + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in result["smartinf_phases_median_ms"].items())
          + " ms")


@pytest.mark.parametrize("numel", SIZES, ids=[f"{n / 1e6:.0f}M" for n in SIZES])
def test_first_step_against_torch_fused(tmp_path, numel):
    """The README's optimizer made and its first step taken, against torch's fused AdamW's
    (whose states are made by that step), each on its own copy of the model, in one process
    (issue 89: the first step in seconds, no state written before the first durable commit):
    seconds of each, smartinf's first step by phase (its ``open_*`` parts), and the bytes
    it wrote to storage by then (none: the states are written by the first commit, step
    10). Results: ``bench/results/cpu_first_step.json``."""
    ours_params = model_params(numel)
    fused_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    generator = torch.Generator().manual_seed(1)
    for p, q in zip(ours_params, fused_params):
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        q.grad = p.grad
    seconds = {}
    t0 = time.perf_counter()
    torch_opt = torch.optim.AdamW(fused_params, lr=1e-4, fused=True)
    torch_opt.step()
    seconds["torch_fused"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = smartinf.optim.AdamW(ours_params, lr=1e-4, devices=[str(tmp_path / "states")])
    seconds["smartinf_made"] = time.perf_counter() - t0
    ours.step()
    seconds["smartinf"] = time.perf_counter() - t0
    written = ours.pipeline.stats["storage_write"]
    phases = dict(ours.last_step_phases)
    ours.close()
    for a, b in zip(ours_params, fused_params):  # the same step taken (fp32 tolerance)
        torch.testing.assert_close(a.detach(), b.detach())
    result = {"params": sum(p.numel() for p in ours_params), "seconds": seconds,
              "ratio_to_torch_fused": seconds["smartinf"] / seconds["torch_fused"],
              "first_step_phases_s": phases, "storage_written_by_step_1": written,
              "load_average_1min": os.getloadavg()[0], "cpus": len(os.sched_getaffinity(0))}
    record("cpu_first_step.json", numel, result)
    print(f"\n{result['params'] / 1e6:.1f} M fp32 params: smartinf made in "
          f"{seconds['smartinf_made']:.2f} s, to the end of its first step "
          f"{seconds['smartinf']:.2f} s, torch fused {seconds['torch_fused']:.2f} s "
          f"({result['ratio_to_torch_fused']:.1f}x); {written / 1e6:.1f} MB written by step 1")
