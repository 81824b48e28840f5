"""The GPU, host memory and storage placement against smartinf.planning.model's prediction, on a
machine with a CUDA GPU (the lent H100: `python bench/gpu_placement.py DIR --out F.json`).

The probe measures the GPU's update and PCIe rates, the host's kernel on the usable cores,
its memory and DIR's disk; then, for each GPU budget (a fraction of the states' bytes), a
Pipeline of a CudaDevice with that budget in front of a CpuDevice whose memory holds the
rest (with room for twins) trains `--params` (GPT-2 XL's 1.56 B by default) in sub-groups of `--subgroup`: bf16
gradients and params in the GPU's memory, as in training; the host's sub-groups' gradients
are copied to pinned host buffers and their params back (what the front-ends do). The step
is timed whole, beside `placement.predict_placed` for the placement the pipeline made (checked
against `placement.place`): with a durable commit every `--commit-every` steps, the GPU's
sub-groups placed with their twins or without (`--twins off,on`), the mean over the steps
of the second commit interval (from the step after the first durable commit: its writes,
without twins the GPU's wait for them, and the second commit's wait for the first's
writes among them) and the median.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time

import torch

import smartinf
from smartinf.planning import io_schedule, model, placement, probe


def run(directory: str, params: int, subgroup: int, gpu_fraction: float, commit_every: int,
        twins: bool, state_dtype: str, figures: dict) -> dict:
    state = model.state_bytes_per_param(state_dtype)
    gpu_budget = int(params * state * gpu_fraction)
    ram_budget = int(params * state * 2) + (256 << 20)  # all the states and their twins
    sizes = [min(subgroup, params - lo) for lo in range(0, params, subgroup)]
    tag = f"{gpu_fraction:g}-{state_dtype}-{twins}"
    pipe = smartinf.Pipeline(
        [smartinf.CudaDevice(os.path.join(directory, tag, "gpu"), memory_budget=gpu_budget,
                             twins=twins),
         smartinf.CpuDevice(os.path.join(directory, tag, "cpu"))],
        smartinf.AdamW(lr=1e-4, weight_decay=0.01), state_dtype=state_dtype,
        memory_budget=ram_budget, commit_every=commit_every, if_exists="overwrite")
    try:
        for n in sizes:
            pipe.add_subgroup(n, None)
        on_gpu = [pipe.gpu_of(sg) is not None for sg in range(len(sizes))]
        grads = [torch.full((n,), 1e-3, dtype=torch.bfloat16, device="cuda") for n in sizes]
        params_ = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
        host = {sg: (torch.empty(n, dtype=torch.bfloat16, pin_memory=True),
                     torch.empty(n, dtype=torch.bfloat16, pin_memory=True))
                for sg, n in enumerate(sizes) if not on_gpu[sg]}
        placed = placement.Placement(
            gpu=float(sum(n for n, g in zip(sizes, on_gpu) if g)),
            ram=float(sum(n for sg, n in enumerate(sizes) if not on_gpu[sg] and pipe.resident(sg))),
            streamed=float(sum(n for sg, n in enumerate(sizes) if not on_gpu[sg] and not pipe.resident(sg))))
        times = []
        for _ in range(1 + 2 * commit_every):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with pipe.step():
                copied = {}
                for sg, (g, _) in host.items():  # the gradients leave the GPU first
                    g.copy_(grads[sg], non_blocking=True)
                    copied[sg] = torch.cuda.Event()
                    copied[sg].record()
                futures = [pipe.update(sg, grads[sg], params_[sg]) for sg in range(len(sizes)) if on_gpu[sg]]
                for sg, (g, p) in host.items():
                    copied[sg].synchronize()
                    futures.append((sg, pipe.update(sg, g, p)))
                for f in futures:
                    if isinstance(f, tuple):
                        f[1].wait()
                        params_[f[0]].copy_(host[f[0]][1], non_blocking=True)
                    else:
                        f.wait()
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        stats = pipe.stats
    finally:
        pipe.close()
        shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)  # ~2 x 12 B/param
    expected = placement.place(params, state, gpu_budget, ram_budget, subgroup, twins)
    gpu = figures["gpu"]
    storage = figures["storage"][0]
    host_pps = placement.host_update_pps(figures, state_dtype, "fp32")
    p = placement.predict_placed(placed, gpu["update_pps"][state_dtype], host_pps,
                             figures["triad"]["bps"], storage["read_bps"], storage["write_bps"],
                             gpu["host_to_gpu_bps"], gpu["gpu_to_host_bps"], state,
                             commit_every=commit_every, twins=twins,
                             commit_write_bps=storage.get("write_beside_update_bps"),
                             mix_bps=io_schedule.from_figures(storage).bps or None)
    # The second interval: its commit waits for the first's writes where they outlast it.
    interval = times[1 + commit_every:]
    measured = statistics.mean(interval)
    return {"gpu_fraction": gpu_fraction, "state_dtype": state_dtype, "twins": twins,
            "params": params, "subgroup": subgroup, "gpu_budget": gpu_budget,
            "ram_budget": ram_budget, "commit_every": commit_every,
            "placement": dataclasses.asdict(placed),
            "placement_as_model": placed == expected, "step_times": times,
            "step_mean_s": measured, "step_median_s": statistics.median(interval),
            "predicted": dict(dataclasses.asdict(p), bound=p.bound),
            "predicted_over_measured": p.step_s / measured,
            "twins_pay": placement.twins_pay(state, commit_every, host_pps, storage["write_bps"]),
            "wait_commit_s": stats.get("wait_commit"), "busy_compute_s": stats.get("busy_compute")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--params", type=float, default=1.5575e9)
    parser.add_argument("--subgroup", type=float, default=1e8)
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--state-dtypes", default="fp32")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--twins", default="off,on")
    parser.add_argument("--probe-mib", type=int, default=2048)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    figures = probe.probe([args.directory], args.probe_mib << 20)
    print(probe.format_report(figures), flush=True)
    rows = []
    for state_dtype in args.state_dtypes.split(","):
        for fraction in (float(f) for f in args.fractions.split(",")):
            for twins in (t == "on" for t in args.twins.split(",")):
                row = run(args.directory, int(args.params), int(args.subgroup), fraction,
                          args.commit_every, twins, state_dtype, figures)
                rows.append(row)
                print(f"GPU budget {fraction:.0%} of the {state_dtype} states, twins {twins}: "
                      f"step mean {row['step_mean_s']:.3f} s (median {row['step_median_s']:.3f}) "
                      f"measured, {row['predicted']['step_s']:.3f} s predicted "
                      f"({row['predicted_over_measured']:.2f}x; {row['predicted']['bound']}); "
                      f"placement as the model's: {row['placement_as_model']}; "
                      f"the model's choice: twins {row['twins_pay']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": figures, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
