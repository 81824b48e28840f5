"""torch.amp's GradScaler loop with ``smartinf.optim`` on a GPU at GPT-2 XL's param count
(issue 60): how far its params are from torch's AdamW, and what checking the gradients'
digests costs the step.

A GPT-2 XL-shaped stack (48 blocks of d=1600: attention's 4 d^2 and the MLP's 8 d^2 as
Linear layers, LayerNorm, GELU; the 50257 x 1600 embedding as the head; 1.56 B fp32 params),
fp16 autocast, ``GradScaler("cuda")``, AdamW lr 1e-4, all states resident in host memory
(``memory_budget``, durable every 10 steps), updates started during backward. Three comparisons:

- ``same-grads``: torch's AdamW (its CUDA default, foreach) on a copy of the params fed
  smartinf's own scaled gradients under its own GradScaler: the optimizers' difference alone;
- ``own-loop``: torch's AdamW training its own copy (its own forward and backward): that
  difference after fp16 autocast's forward has amplified it;
- the step timed with the digests checked and without, alternated each iteration (one
  optimizer), medians of iterations 2+ of each.

    python bench/gpu_amp_step.py [--steps 8] [--tokens 2048] [--unscale clip] > out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import smartinf.optim as so

D, LAYERS, VOCAB = 1600, 48, 50257
# every state resident in host memory, durable every 10 steps (the README's resident row)
RESIDENT = dict(memory_budget=64 << 30, commit_every=10, subgroup_size=100_000_000,
                if_exists="overwrite")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.up, self.down = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        x = x + self.proj(torch.tanh(q) * torch.sigmoid(k) * v)  # the projections' shapes
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(LAYERS)], torch.nn.LayerNorm(D),
                                torch.nn.Linear(D, VOCAB, bias=False))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    return model.cuda()


def backward(model: torch.nn.Module, scaler: torch.amp.GradScaler, step: int, tokens: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(tokens, D, device="cuda", generator=g)
    target = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), target)
    scaler.scale(loss).backward()
    return float(loss.detach())


def step(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, model: torch.nn.Module,
         unscale: str) -> None:
    if unscale:
        scaler.unscale_(opt)
        if unscale == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def relative(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """||a - b|| / ||b|| over all params."""
    num = sum(float((p.detach().double() - q.detach().double()).pow(2).sum())
              for p, q in zip(a.parameters(), b.parameters()))
    den = sum(float(q.detach().double().pow(2).sum()) for q in b.parameters())
    return (num / den) ** 0.5


def accuracy(args: argparse.Namespace, directory: str) -> dict:
    ours, fed, own = make_model(), make_model(), make_model()
    opt = so.AdamW(ours.parameters(), lr=1e-4, devices=[directory], **RESIDENT)
    fed_opt = torch.optim.AdamW(fed.parameters(), lr=1e-4)
    own_opt = torch.optim.AdamW(own.parameters(), lr=1e-4)
    scalers = [torch.amp.GradScaler("cuda") for _ in range(3)]
    rows = []
    for i in range(args.steps):
        loss = backward(ours, scalers[0], i, args.tokens)
        own_loss = backward(own, scalers[2], i, args.tokens)
        scalers[1].scale(torch.ones((), device="cuda"))  # its scale made, as on first use
        for p, q in zip(ours.parameters(), fed.parameters()):
            q.grad = p.grad.clone()
        step(scalers[0], opt, ours, args.unscale)
        step(scalers[1], fed_opt, fed, args.unscale)
        step(scalers[2], own_opt, own, args.unscale)
        rows.append({"step": i + 1, "loss": loss, "own_loop_loss": own_loss,
                     "scale": scalers[0].get_scale(), "torch_scale": scalers[1].get_scale(),
                     "same_grads_rel": relative(ours, fed), "own_loop_rel": relative(ours, own)})
        print(json.dumps(rows[-1]), flush=True)
    counts = opt._speculation.counts
    opt.close()
    del ours, fed, own, opt, fed_opt, own_opt
    torch.cuda.empty_cache()
    return {"rows": rows, "kept": counts.kept, "retracted": counts.retracted,
            "reasons": counts.reasons}


def cost(args: argparse.Namespace, root: str) -> dict:
    """The step with the digests checked and without, alternated each iteration (one
    optimizer: ``check_digests`` is read as each update starts)."""
    model = make_model()
    opt = so.AdamW(model.parameters(), lr=1e-4, devices=[f"{root}/cost"], **RESIDENT)
    scaler = torch.amp.GradScaler("cuda")
    times: dict = {"digests": [], "no-digests": []}
    kept = {name: 0 for name in times}
    for i in range(2 * args.timed + 2):
        name = list(times)[i % 2]
        opt._speculation.check_digests = name == "digests"
        before = opt._speculation.counts.kept
        torch.cuda.synchronize()
        start = time.perf_counter()
        backward(model, scaler, i, args.tokens)
        torch.cuda.synchronize()
        mid = time.perf_counter()
        step(scaler, opt, model, "")
        torch.cuda.synchronize()
        end = time.perf_counter()
        kept[name] += opt._speculation.counts.kept - before
        if i >= 2:  # iterations 2+ of each
            times[name].append({"backward_s": mid - start, "step_s": end - mid,
                                "iteration_s": end - start})
    out: dict = {}
    for name, rows in times.items():
        out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[name]["kept"] = kept[name]
    opt.close()
    out["step_ratio"] = out["digests"]["step_s"] / out["no-digests"]["step_s"]
    out["iteration_ratio"] = out["digests"]["iteration_s"] / out["no-digests"]["iteration_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timed", type=int, default=8, help="iterations of each, alternated")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--unscale", default="", choices=["", "unscale", "clip"])
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "params": sum(
        p.numel() for p in make_model().parameters()), "args": vars(a)}
    torch.cuda.empty_cache()
    if a.steps:
        with tempfile.TemporaryDirectory(dir=a.dir) as d:  # (each run's two copies: 37 GB)
            result["accuracy"] = accuracy(a, d)
    if a.timed:
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            result["cost"] = cost(a, d)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
