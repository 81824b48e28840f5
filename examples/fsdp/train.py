"""Trains the compact GPT sharded with FSDP2 (``fully_shard``), the optimizer step on smartinf
devices: built on the meta device, sharded block by block, materialised as shards.

    torchrun --nproc_per_node=2 examples/fsdp/train.py --dir /nvme/run [--steps 20]
    torchrun --nproc_per_node=1 examples/fsdp/train.py --mode cpu-offload --dir /tmp/x

``--mode smartinf`` (the default): ``smartinf.optim.AdamW`` over the sharded params, each
rank's states in ``DIR/smartinf/rank<R>``; ``--dtype bf16`` shards bf16 params (the fp32
masters, or their low halves with ``--split-master``, in smartinf's states). The peers run
FSDP2 with torch's AdamW on the same model, data and weights: ``fsdp`` (no offload, fused
AdamW on the GPU: the floor) and ``cpu-offload`` (``CPUOffloadPolicy``: params, gradients and
states in host memory, torch's fused AdamW on the host's cores); they shard fp32 params and,
with ``--dtype bf16``, compute in bf16 (``MixedPrecisionPolicy``), as torch's AdamW needs fp32
params. Each rank reads its own batches (examples/deepspeed's, so the losses compare with
its modes). Per step the script prints the loss (mean over ranks) and the forward /
backward / optimizer-step seconds; ``--json`` writes them (rank 0). Without a GPU: gloo, fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

if __package__ in (None, ""):  # run as a script: make `examples.gpt` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import smartinf.optim  # noqa: E402
from examples.gpt import gpu  # noqa: E402
from examples.gpt.counters import counters, difference  # noqa: E402
from examples.gpt.data import Language, made_ahead  # noqa: E402
from examples.gpt.profiled import Profiled  # noqa: E402
from examples.gpt.model import GPT, MODELS, GPTConfig  # noqa: E402

MODES = ("smartinf", "fsdp", "cpu-offload")


def sharded_model(args: argparse.Namespace, vocab: int, device: torch.device) -> GPT:
    """The GPT built on the meta device, ``fully_shard`` on each block and the root, then each
    rank's shards made and initialised: GPT.initial's values (the DeepSpeed example's
    ``--zero-init`` weights on a GPU), each param's whole value made on ``device`` and this
    rank's rows of it kept (FSDP2 shards dim 0 as torch.chunk does)."""
    d_model, n_layer, n_head, _ = MODELS[args.model]
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab, args.seq, d_model, n_layer, n_head),
                    checkpoint=args.checkpoint_activations)
    bf16 = args.dtype == "bf16"
    if bf16 and args.mode == "smartinf":
        model = model.to(torch.bfloat16)  # bf16 shards; smartinf keeps the masters
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32 if bf16 and args.mode != "smartinf" else None)
    offload = {"offload_policy": CPUOffloadPolicy()} if args.mode == "cpu-offload" else {}
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, **offload)
    fully_shard(model, mp_policy=policy, **offload)
    model.to_empty(device="cpu" if offload else device)
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            rows = torch.chunk(model.initial(i, name, p.shape, device, seed=0), world)
            if rank < len(rows):
                p.to_local().copy_(rows[rank])
    return model


def optimizer(args: argparse.Namespace, model: GPT) -> torch.optim.Optimizer:
    if args.mode != "smartinf":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                                 betas=(0.9, 0.95), eps=1e-8, fused=True)
    kw = {k: getattr(args, k) for k in ("memory_budget", "commit_every", "copies")
          if getattr(args, k) is not None}
    if args.gpu_memory_budget:
        kw["gpu_memory_budget"] = args.gpu_memory_budget
    if args.split_master:
        kw["master"] = "split"
    if args.gpu_host_states != "auto":
        kw["gpu_host_states"] = {"on": True, "off": False}.get(args.gpu_host_states, args.gpu_host_states)
    return smartinf.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
        devices=[os.path.join(args.dir, "smartinf")], max_grad_norm=args.clip or None,
        state_dtype=args.state_dtype, overlap=not args.no_overlap, if_exists=args.if_exists, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="smartinf")
    p.add_argument("--dir", required=True, help="storage directory (smartinf's states)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--state-dtype", choices=["fp32", "int8", "int4", "auto"], default="fp32",
                   help="smartinf: Adam moments' format; auto: what smartinf.planning.plan picks")
    p.add_argument("--split-master", action="store_true", help="smartinf, bf16: master='split'")
    p.add_argument("--memory-budget", help="smartinf: bytes of states resident in host memory")
    p.add_argument("--gpu-memory-budget", help="smartinf: bytes of the GPU's memory for states "
                   "updated there, or auto: what the first iteration leaves")
    p.add_argument("--gpu-host-states", default="auto",
                   type=lambda v: v if v in ("auto", "on", "off") else float(v),
                   help="smartinf: the states kept in host memory updated on the GPU, crossing "
                        "PCIe: on, off, auto, or a share from 0 to 1 (that share on the GPU, "
                        "the rest on the host's cores, at once)")
    p.add_argument("--commit-every", type=int, help="smartinf: steps per durable commit")
    p.add_argument("--copies", type=int, choices=(1, 2), help="smartinf: copies on disk")
    p.add_argument("--no-overlap", action="store_true", help="smartinf: overlap=False")
    p.add_argument("--if-exists", choices=("error", "resume", "overwrite"), default="error")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward")
    p.add_argument("--zero-init", action="store_true", help="(always: built on the meta "
                   "device and materialised as shards; taken for examples/deepspeed's flags)")
    p.add_argument("--gpu-memory", help="emulate a GPU with this much memory (e.g. 80GiB) on a "
                   "larger one, as examples/deepspeed/train.py's flag does")
    p.add_argument("--profile-step", type=int, default=0,
                   help="write torch.profiler's tables of this step's opt.step() and the next "
                        "iteration's forward and backward (a step finished meanwhile) to "
                        "--json's .prof.txt")
    p.add_argument("--json", help="write the per-step record here (rank 0)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if args.mode == "cpu-offload" and not cuda:
        p.error("--mode cpu-offload is FSDP2's CPUOffloadPolicy, which needs a CUDA GPU")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    held_back = gpu.hold_back(args.gpu_memory, device)  # noqa: F841 (kept until the end)
    lang = Language()
    vocab = MODELS[args.model][3] or lang.vocab_size
    model = sharded_model(args, vocab, device)
    opt = optimizer(args, model)
    data = made_ahead(lang, args.batch, args.seq, 1000 + rank, args.steps, device)

    def sync() -> float:
        # The training stream's work done (as the DeepSpeed example's settle_stream): a
        # device-wide synchronize would also wait for the optimizer's own streams, a step
        # finishing while the next forward runs, and so time the two one after the other.
        if cuda:
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()

    records, profiler = [], None
    before = counters(opt)  # (smartinf's pipeline, once opened: its counters per step)
    for step in range(args.steps):
        x, y = next(data)
        t0 = sync()
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        t1 = sync()
        loss.backward()
        t2 = sync()
        if args.mode != "smartinf" and args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if profiler is not None:  # (the iteration after the profiled step: done)
            profiler.stop(Path(args.json).with_suffix(".prof.txt"))
            profiler = None
        if args.profile_step == step + 1 and rank == 0 and args.json:
            profiler = Profiled(cuda)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = sync()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        # (start_s: a step finished in the background runs on past t3 too; the starts'
        # differences are the iterations' whole wall time)
        now = counters(opt)
        records.append({"step": step + 1, "loss": mean.item() / world, "fwd_s": t1 - t0,
                        "bwd_s": t2 - t1, "step_s": t3 - t2, "start_s": t0,
                        "pipeline": difference(now, before)})
        before = now
        if rank == 0:
            r = records[-1]
            print(f"step {r['step']:4d}  loss {r['loss']:.6f}  fwd {r['fwd_s']:.3f}s  "
                  f"bwd {r['bwd_s']:.3f}s  step {r['step_s']:.3f}s", flush=True)
    if profiler is not None:  # (the last step profiled: no iteration after it)
        profiler.stop(Path(args.json).with_suffix(".prof.txt"))
    if args.json and rank == 0:
        Path(args.json).write_text(json.dumps({
            "mode": args.mode, "model": args.model, "world_size": world, "dtype": args.dtype,
            "num_params": sum(p.numel() for p in model.parameters()),
            "optimizer": repr(opt), "placement": getattr(opt, "placement", None) and opt.placement.report(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "steps": records}, indent=1))
    if args.mode == "smartinf":
        opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
