"""States in host memory updated on the GPU (CudaDevice(memory="host")) against the same
states updated by the host's cores (a CpuDevice's memory_budget), on a machine with a CUDA
GPU (the lent H100: `python bench/gpu_host_states.py DIR --out F.json`).

For each format, `--params` params in sub-groups of `--subgroup`, every state resident in
host memory, commits not durable within the timed steps; the GPU's gradients and params are
bf16 CUDA tensors updated in place (its states cross PCIe each way), the cores' are pinned
host buffers (what the front-ends pass them). Reported: the median step of `--steps` (the
first dropped) and params/s, the GPU's as a ratio to the cores' measured in the same run,
beside the pinned copy rates each way and both at once that bound the GPU's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

import smartinf
from smartinf.planning import model

FORMATS = {"fp32": ("fp32", "fp32"), "int8+split": ("int8", "split"), "int4+split": ("int4", "split")}


def copy_rates(nbytes: int = 1 << 30) -> dict:
    """Pinned host <-> GPU copies: GB/s each way alone, and both at once (two streams)."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    gpu = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def timed(pairs) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for (dst, src), s in zip(pairs, streams):
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best
    return {"to_gpu_gbps": nbytes / timed([(gpu[0], host[0])]) / 1e9,
            "to_host_gbps": nbytes / timed([(host[0], gpu[0])]) / 1e9,
            "both_gbps_each": nbytes / timed([(gpu[0], host[0]), (host[1], gpu[1])]) / 1e9}


def run(directory: str, where: str, state_dtype: str, master: str, params: int, subgroup: int,
        steps: int) -> dict:
    budget = int(params * model.state_bytes_per_param(state_dtype, master) * 1.05) + (256 << 20)
    sizes = [min(subgroup, params - lo) for lo in range(0, params, subgroup)]
    path = os.path.join(directory, f"{where}-{state_dtype}-{master}")
    shutil.rmtree(path, ignore_errors=True)
    if where == "gpu":
        devices, settings = smartinf.CudaDevice(path, memory_budget=budget, memory="host"), {}
    else:
        devices, settings = smartinf.CpuDevice(path), {"memory_budget": budget}
    pipe = smartinf.Pipeline(devices, smartinf.AdamW(lr=1e-4, weight_decay=0.01),
                             state_dtype=state_dtype, master=master, commit_every=10_000,
                             chunk=smartinf.defaults.GPU_CHUNK, if_exists="overwrite", **settings)
    try:
        for n in sizes:
            pipe.add_subgroup(n, None)
        assert all(pipe.resident(sg) for sg in range(len(sizes)))
        on = "cuda" if where == "gpu" else "cpu"
        pin = where != "gpu"
        grads = [torch.full((n,), 1e-3, dtype=torch.bfloat16, device=on, pin_memory=pin) for n in sizes]
        out = [torch.zeros(n, dtype=torch.bfloat16, device=on, pin_memory=pin) for n in sizes]
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            with pipe.step():
                for f in [pipe.update(sg, grads[sg], out[sg]) for sg in range(len(sizes))]:
                    f.wait()
            times.append(time.perf_counter() - t)
        stats = pipe.stats
    finally:
        pipe.close()
        shutil.rmtree(path, ignore_errors=True)
    step = statistics.median(times[1:])
    return {"where": where, "step_s": step, "params_per_s": params / step, "times": times,
            "host_to_device_bytes": stats.get("host_to_device", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--params", type=float, default=2e9)
    p.add_argument("--subgroup", type=float, default=1e8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--out")
    args = p.parse_args()
    record = {"gpu": torch.cuda.get_device_name(), "cores": len(os.sched_getaffinity(0)),
              "params": int(args.params), "copies": copy_rates(), "formats": {}}
    print(json.dumps(record["copies"]), flush=True)
    for name in args.formats.split(","):
        state_dtype, master = FORMATS[name]
        pair = {}
        for where in ("gpu", "cores"):  # alternating would need twice the memory held
            pair[where] = run(args.directory, where, state_dtype, master, int(args.params),
                              int(args.subgroup), args.steps)
        pair["gpu_over_cores"] = pair["cores"]["step_s"] / pair["gpu"]["step_s"]
        record["formats"][name] = pair
        print(name, {w: round(pair[w]["step_s"], 3) for w in ("gpu", "cores")},
              f"GPU {pair['gpu_over_cores']:.2f}x the cores", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
