"""One rank of an FSDP2 run (gloo, on the CPU) for tests/test_fsdp.py: a small MLP with
``fully_shard`` on each Linear and the root, trained by ``smartinf.optim`` or by torch's own
optimizer on the same batches; rank 0 writes every step's loss and full params.

    spawn(run, args=(world, port, config), nprocs=world)

``config``: ``optim`` ("smartinf" or "torch"; "both": smartinf, and torch's AdamW on a copy
fed smartinf's gradients, recorded as ``torch_params``), ``dir`` (smartinf's devices), ``out`` (rank
0's record), ``steps``, ``first`` (the step to start at), ``clip`` (smartinf:
``max_grad_norm``; torch: ``clip_grad_norm_`` on the DTensor gradients), ``nan_at`` (a step
whose loss is NaN: skipped), ``kw`` (smartinf's options), ``mixed`` (MixedPrecisionPolicy
bf16 compute, fp32 reduce), ``save`` / ``load`` (a DCP checkpoint directory written after
the last step / read before the first), ``bf16`` (bf16 params), ``if_exists``, ``edit_at`` (a step before which rank 0 halves its
shard of the first param), ``first="resume"`` (start at the step the reopened directories
hold), ``started`` / ``sleep`` (a file rank 0 makes after each step from the third, then sleeps: a test
kills the ranks meanwhile), ``tail`` (SMARTINF_STEP_TAIL_ON_CPU=1: the step finishes while the
next forward runs, each update slowed and recorded in the order sent; the params are then
recorded after the last step only, so that the next forward's all-gathers are what waits
for them). Unless ``unsharded``, the root's group holds a param of its own (``WithGain``):
the model's last, used first.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import smartinf.optim as so

LR, WEIGHT_DECAY = 1e-2, 1e-2
BATCH = 16


def model(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)  # 9 output rows: uneven shards, and an empty one at world 4
    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 9))
    if config.get("bf16"):  # bf16 sharded params (and gradients)
        m = m.to(torch.bfloat16)
    if config.get("unsharded"):  # sharded by a framework (tests/fsdp_frameworks.py)
        return m
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if config.get("mixed") else MixedPrecisionPolicy()
    gain = torch.nn.Module()
    gain.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 24, dtype=m[0].weight.dtype))
    m = WithGain(*m, gain)
    for layer in (m[0], m[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(m, mp_policy=policy)
    return m


class WithGain(torch.nn.Sequential):
    """The layers, the input scaled first by the last module's ``weight``: a param of the
    root's group, the model's last, used first (as a transformer's root group holds its
    embedding, used first, and its output layer, the model's last params)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *layers, gain = self
        x = x * gain.weight
        for layer in layers:
            x = layer(x)
        return x


def optimizer(m: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    if config["optim"] == "torch":
        return torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    # "hosts": each rank's root as on a host of its own (its disk), by rank
    root = config["hosts"][dist.get_rank()] if config.get("hosts") else config["dir"]
    return so.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, devices=[root],
                    max_grad_norm=config.get("clip"), subgroup_size=300, chunk=128,
                    if_exists=config.get("if_exists", "error"), **config.get("kw", {}))


def run(rank: int, world: int, port: int, config: dict) -> None:
    os.environ.setdefault("SMARTINF_SPECULATE_ON_CPU", "1")
    if config.get("tail"):
        os.environ["SMARTINF_STEP_TAIL_ON_CPU"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    m = model(config)
    opt = optimizer(m, dict(config, optim="smartinf" if config["optim"] == "both" else config["optim"]))
    sent = []  # (the step's count, sub-group) of each update step() sent
    if config.get("tail"):  # each update sent later, so that the next forward really waits
        send = opt._driver.send
        opt._driver.send = lambda *a, **k: (
            k.get("speculative") or sent.append((opt.pipeline.step_count, a[0])),
            time.sleep(0.02), send(*a, **k))[2]
    ref = model(config) if config["optim"] == "both" else None
    ref_opt = optimizer(ref, dict(config, optim="torch")) if ref is not None else None
    if config.get("load"):
        state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
        dcp.load(state, checkpoint_id=config["load"])
        set_model_state_dict(m, state["model"])
        set_optimizer_state_dict(m, opt, state["optim"])
    first = config.get("first", 0)
    if first == "resume":  # where the reopened directories are (every rank at one step)
        first = opt.pipeline.step_count
    record = {"loss": [], "params": [], "skipped": [], "torch_params": [], "first": first}
    for step in range(first, config["steps"]):
        g = torch.Generator().manual_seed(100 + step)
        if step == config.get("reset_at"):  # both moments reset through opt.state, as users do
            for o in (opt, ref_opt) if ref_opt is not None else (opt,):
                for p in m.parameters() if o is opt else ref.parameters():
                    s = o.state[p]
                    s["exp_avg"].zero_()
                    s["exp_avg_sq"].zero_()
        if step == config.get("edit_at") and rank == 0:  # one rank's shard edited between steps
            with torch.no_grad():
                next(m.parameters())._local_tensor.mul_(0.5)
        rows = BATCH // world  # each rank's part of one global batch, whatever the world size
        x = torch.randn(BATCH, 24, generator=g)[rows * rank:rows * (rank + 1)]
        x = x.to(torch.bfloat16) if config.get("bf16") else x
        loss = m(x).float().pow(2).mean()
        if step == config.get("nan_at"):
            loss = loss * float("nan")
        loss.backward()
        if config["optim"] == "torch":
            grads = [p.grad for p in m.parameters()]
            finite = all(bool(torch.isfinite(g.full_tensor()).all()) for g in grads)
            if config.get("clip"):
                torch.nn.utils.clip_grad_norm_(m.parameters(), config["clip"])
            if finite:  # (smartinf skips a step with inf/NaN gradients itself)
                opt.step()
            record["skipped"].append(not finite)
        else:
            if ref is not None:  # the same gradients, bit for bit
                for p, q in zip(m.parameters(), ref.parameters()):
                    q.grad = p.grad.clone()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                record["torch_params"].append([q.full_tensor().detach().clone() for q in ref.parameters()])
            opt.step()
            record["skipped"].append(opt.last_step_skipped)
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        record["loss"].append(float(total) / world)
        if not config.get("tail") or step == config["steps"] - 1:
            record["params"].append([p.full_tensor().detach().clone() for p in m.parameters()])
        if config.get("started") and rank == 0 and step >= 2:  # (killed from step 3 on:
            # step 1's background commit has landed, so the ranks reopen past it)
            open(config["started"], "a").close()
            time.sleep(config.get("sleep", 0))
    if config.get("save"):
        dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
                 checkpoint_id=config["save"])
    if config["optim"] != "torch":
        record["counts"] = opt._speculation and dict(vars(opt._speculation.counts))
        record["tail"] = opt._tail and {"deferred": opt._tail.deferred, "waits": opt._tail.waits,
                                        "sent": sent, "root": opt._subgroups_of([m[-1].weight])}
        steps = torch.tensor([float(opt.pipeline.step_count), -float(opt.pipeline.step_count)])
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        record["step_counts_agree"] = steps[0].item() == -steps[1].item()
        opt.close()
    if rank == 0:
        torch.save(record, config["out"])
    dist.destroy_process_group()
