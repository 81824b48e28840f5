"""What watching for edits between steps (smartinf/edits.py) costs a smartinf.optim step.

The step whose extra reads show most: every state resident in RAM (no storage to hide
behind), fp32 params (4 B each digested twice a step: when put, and at the next step).
Same run: two optimizers over two copies of the model, one without the watch, stepped in
turns; medians compared. ``SMARTINF_BENCH_EDIT_PARAMS`` sets the size (64 Mi params:
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
    runs = {}
    for on in (True, False):  # two optimizers of two models, stepped in turns
        torch.manual_seed(0)
        model = torch.nn.Linear(PARAMS // rows, rows, bias=False)
        opt = so.AdamW(model.parameters(), lr=1e-3, devices=[f"{bench_dir}/edits-{on}"],
                       memory_budget=16 * PARAMS + (64 << 20), if_exists="overwrite")
        if not on:
            opt._watch = None  # no digests taken or compared
        model.weight.grad = torch.randn_like(model.weight) * 1e-3
        opt.step()  # the states' first touch
        runs[on] = opt
    seconds: dict[bool, list[float]] = {True: [], False: []}

    def step(on: bool) -> None:
        start = time.perf_counter()
        runs[on].step()
        seconds[on].append(time.perf_counter() - start)

    order = [(True, False), (False, True)]  # which goes first, in turns
    benchmark.pedantic(lambda: [step(on) for on in order[len(seconds[True]) % 2]], rounds=STEPS,
                       iterations=1)
    assert runs[True].pipeline.step_count == runs[False].pipeline.step_count  # no edit seen
    for opt in runs.values():
        opt.close()
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    benchmark.extra_info.update(params=PARAMS, step_with_watch_s=on, step_without_s=off,
                                ratio=on / off, rounds_with=seconds[True],
                                rounds_without=seconds[False])
    print(f"\n{PARAMS / 2**20:.0f} Mi fp32 params, resident: step {on:.3f} s watching for "
          f"edits, {off:.3f} s without: {on / off:.3f}x")
