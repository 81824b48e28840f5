"""What watching for edits between steps (smartinf/edits.py) costs a smartinf.optim step.

The step whose extra reads show most: every state resident in RAM (no storage to hide
behind), fp32 params (4 B each digested twice a step: when put, and at the next step).
Same optimizer, same run: steps alternate with the watch on and off (taken away for the
step), medians compared. ``SMARTINF_BENCH_EDIT_PARAMS`` sets the size (64 Mi params:
1 GiB of states).

    SMARTINF_BENCH_DIR=/work .venv/bin/python -m pytest -s bench/test_edits.py
"""
from __future__ import annotations

import statistics
import time

import torch

import smartinf.optim as so
from conftest import env_int

PARAMS = env_int("SMARTINF_BENCH_EDIT_PARAMS", 64 << 20)
STEPS = env_int("SMARTINF_BENCH_EDIT_STEPS", 8)


def test_watching_for_edits_costs_a_step(benchmark, bench_dir):
    rows = 4096
    model = torch.nn.Linear(PARAMS // rows, rows, bias=False)
    opt = so.AdamW(model.parameters(), lr=1e-3, devices=[f"{bench_dir}/edits"],
                   memory_budget=16 * PARAMS + (64 << 20), if_exists="overwrite")
    model.weight.grad = torch.randn_like(model.weight) * 1e-3
    watch = opt._watch
    seconds: dict[bool, list[float]] = {True: [], False: []}

    def step(on: bool) -> None:
        opt._watch = watch if on else None
        start = time.perf_counter()
        opt.step()
        seconds[on].append(time.perf_counter() - start)

    opt.step()  # the states' first touch
    benchmark.pedantic(lambda: [step(on) for on in (True, False)], rounds=STEPS, iterations=1)
    opt._watch = watch
    opt.close()
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    benchmark.extra_info.update(params=PARAMS, step_with_watch_s=on, step_without_s=off,
                                ratio=on / off, rounds_with=seconds[True],
                                rounds_without=seconds[False])
    print(f"\n{PARAMS / 2**20:.0f} Mi fp32 params, resident: step {on:.3f} s watching for "
          f"edits, {off:.3f} s without: {on / off:.3f}x")
