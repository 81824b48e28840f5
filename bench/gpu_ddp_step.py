"""DDP (NCCL) with ``smartinf.optim`` as the README writes it (only ``devices`` and
``max_grad_norm``: the planner's placement) against DDP with torch's fused AdamW and
``clip_grad_norm_`` (the floor), one process each, one after the other: GPT-2 XL's shape
(examples/gpt's model, 1.56 B fp32 params on the GPU), bf16 autocast, batch 8 x 1024, clip 1.0.
Medians of iterations 2+, and the losses of both, step by step.

    torchrun --nproc_per_node=1 bench/gpu_ddp_step.py --mode smartinf|torch --dir D [--steps 12]
        [--json F [--profile-step N]] [--subgroup-size N]

``--profile-step N``: torch.profiler's and cProfile's tables of iterations N and N + 1 (a step
and the forward and backward after it), to F's ``.prof.txt``. Each smartinf row also holds
the step's host seconds by phase (``last_step_phases``). ``--subgroup-size``: smartinf's
``subgroup_size`` (params; left out, the planner's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from examples.gpt.model import GPT, MODELS, GPTConfig  # noqa: E402
from examples.gpt.profiled import Profiled  # noqa: E402
from gpu_fsdp_step import summary, timed_step  # noqa: E402

import smartinf.optim as so  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["smartinf", "torch"], required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dir", required=True)
    p.add_argument("--json")
    p.add_argument("--profile-step", type=int, default=0)
    p.add_argument("--subgroup-size", type=int, default=None)
    a = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    d, n_layer, n_head, vocab = MODELS["gpt2-xl"]
    with torch.device("cuda"):
        model = GPT(GPTConfig(vocab, a.seq, d, n_layer, n_head), seed=0)
    ddp = DDP(model)
    if a.mode == "smartinf":
        opt = so.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.1,
                       devices=[os.path.join(a.dir, "ddp-states")], max_grad_norm=1.0,
                       if_exists="overwrite", subgroup_size=a.subgroup_size)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    rows, profiled = [], None
    for i in range(a.steps):
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        x = torch.randint(0, vocab, (a.batch, a.seq), device="cuda", generator=g)

        def loss_of() -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(x)
            return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten())
        if a.profile_step == i + 1 and rank == 0 and a.json:
            profiled = Profiled(True)
        rows.append(timed_step(i + 1, a.mode, loss_of, opt, ddp.parameters()))
        if a.mode == "smartinf":
            rows[-1]["phases"] = dict(opt.last_step_phases)
        if profiled is not None and i == a.profile_step:  # (iteration N + 1 done)
            profiled.stop(Path(a.json).with_suffix(".prof.txt"))
            profiled = None
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    result = dict(summary(a.mode, rows, model), rows=rows)
    if a.mode == "smartinf":
        result["placement"] = opt.placement and opt.placement.report()
        opt.close()
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
