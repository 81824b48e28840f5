"""What each torch op of the GPU's edit digest (smartinf/step/edits.py) costs, against the
bandwidth floor, on one sub-group of GPT-2 XL's fp32 params as smartinf.optim cuts them for
a GPU (128 Mi params in parts of the model's shapes): CUDA events, medians of ``--rounds``.
Candidate formulations beside the current one, to choose a cheaper digest by.

    python bench/gpu_digest_ops.py [--rounds 20] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

from smartinf.step import edits

D = 1600
SHAPES = [(3 * D, D), (3 * D,), (D, D), (D,), (4 * D, D), (4 * D,), (D, 4 * D), (D,), (D,), (D,),
          (D,), (D,)]  # one GPT-2 XL block's params


def timed(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    parts, numel = [], 0
    while numel < 128 << 20:
        for shape in SHAPES:
            t = torch.randn(shape, device="cuda")
            parts.append(t.view(-1))
            numel += t.numel()
    flat = torch.cat(parts)
    raw = [t.view(torch.uint8) for t in parts]
    b = flat.view(torch.uint8)
    words = b[:b.numel() // 8192 * 8192].view(torch.int64)  # (whole rows of 8 and of 1024)
    weights = edits.mm_weights(flat.device)  # (None: no torch._int_mm on this GPU)
    rows = b.numel() // edits.MM_ROW
    ops = {
        "fp32 sum (read floor)": lambda: flat.sum(),
        "copy (cat's traffic)": lambda: flat.clone(),
        "cat of the parts": lambda: torch.cat(raw),
        "digest of the parts (changed)": lambda: edits.digest(parts),
        "digest of flat (record)": lambda: edits.digest([flat]),
        "int64 words sum": lambda: words.sum(),
        "int64 rows-of-8 sums": lambda: words.view(-1, 8).sum(1),
        "int64 columns of 1024 sums": lambda: words.view(-1, 1024).sum(0),
        "int32 sum to int64": lambda: flat.view(torch.int32).sum(dtype=torch.int64),
        "int8 matmul 4096 x 8": lambda: torch._int_mm(
            b[:rows * edits.MM_ROW].view(torch.int8).view(rows, edits.MM_ROW), weights),
    }
    found = {"params": flat.numel(), "parts": len(parts), "device": torch.cuda.get_device_name()}
    for name, fn in ops.items():
        try:
            found[name] = timed(fn, a.rounds)
        except RuntimeError as e:  # (an op this torch or GPU lacks)
            found[name] = str(e).splitlines()[0]
    floor = found["fp32 sum (read floor)"]
    for name, s in found.items():
        if isinstance(s, float):
            print(f"{name:34s} {s * 1e3:8.3f} ms  {s / floor:6.1f}x the read")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
