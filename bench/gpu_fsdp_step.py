"""FSDP2 (``fully_shard``, NCCL) with ``smartinf.optim`` on a GPU, against FSDP2 with torch's
AdamW and no offload (its floor), in one process each, one after the other: GPT-2 XL's param
count (bench/gpu_amp_step.py's stack of 48 blocks of d=1600 and a 50257-row head, 1.56 B fp32
params), ``fully_shard`` on each block and the root, MixedPrecisionPolicy (bf16 compute, fp32
reduce), clip 1.0; smartinf's states resident in host memory, durable every 10 steps.
Medians of iterations 2+, and the losses of both, step by step.

    torchrun --nproc_per_node=1 bench/gpu_fsdp_step.py --mode smartinf|torch [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from gpu_amp_step import D, LAYERS, RESIDENT, VOCAB, make_model  # noqa: E402

import smartinf.optim as so  # noqa: E402


def timed_step(step: int, mode: str, loss_of: Callable[[], torch.Tensor], opt: Any,
               params: Any) -> dict:
    """One iteration, timed: forward (``loss_of()``) and backward, then the step (with torch's
    optimizer, after ``clip_grad_norm_``: smartinf's clips itself). The training stream's
    work waited for, not the device's: smartinf's step may finish on streams of its own
    while the next forward runs (what that forward waits for is timed there)."""
    torch.cuda.current_stream().synchronize()
    start = time.perf_counter()
    loss = loss_of()
    loss.backward()
    torch.cuda.current_stream().synchronize()
    mid = time.perf_counter()
    if mode == "torch":
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().synchronize()
    end = time.perf_counter()
    return {"step": step, "loss": float(loss.detach()), "fwd_bwd_s": mid - start,
            "step_s": end - mid, "iteration_s": end - start}


def summary(mode: str, rows: list, model: torch.nn.Module) -> dict:
    """The run's record: medians of iterations 2+, every loss, the GPU's peak."""
    later = rows[1:]
    return {"mode": mode, "device": torch.cuda.get_device_name(),
            "params": sum(p.numel() for p in model.parameters()),
            "median": {k: statistics.median(r[k] for r in later)
                       for k in ("fwd_bwd_s", "step_s", "iteration_s")},
            "losses": [r["loss"] for r in rows],
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["smartinf", "torch"], required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in list(model)[:LAYERS]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if a.mode == "smartinf":
        opt = so.AdamW(model.parameters(), lr=1e-4, max_grad_norm=1.0,
                       devices=[os.path.join(a.dir, "fsdp-states")], **RESIDENT)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rows = []
    for i in range(a.steps):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(a.tokens, D, device="cuda", generator=g)
        target = torch.randint(0, VOCAB, (a.tokens,), device="cuda", generator=g)
        rows.append(timed_step(i + 1, a.mode, lambda: torch.nn.functional.cross_entropy(
            model(x).float(), target), opt, model.parameters()))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    result = dict(summary(a.mode, rows, model), tokens=a.tokens)
    if a.mode == "smartinf":
        result["kept"] = opt._speculation.counts.kept if opt._speculation else 0
        opt.close()
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
