"""How far int8/int4 states leave small tensors from fp32 AdamW, with and without their
moments kept in fp32 (``SMARTINF_SMALL_TENSOR``, lpmm's 4096 elements by default).

    python bench/small_tensor_error.py [--out bench/measured/cpu-small-tensors.json]

A 256 x 256 weight beside a 256-element bias, a 256 x 7 weight and a 7-element bias; 20
AdamW steps on the same gradients as torch.optim.AdamW; per param, the distance of its net
change from torch's, relative to torch's net change.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

import smartinf.optim as so


def net_change_errors(state_dtype: str, steps: int = 20) -> dict:
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 7))
    theirs = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 7))
    theirs.load_state_dict(ours.state_dict())
    start = [p.detach().clone() for p in ours.parameters()]
    with tempfile.TemporaryDirectory() as d:
        opt = so.AdamW(ours.parameters(), lr=1e-3, devices=[d], state_dtype=state_dtype)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
        for step in range(steps):
            torch.manual_seed(100 + step)
            ours(torch.randn(32, 256)).pow(2).mean().backward()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            ref.step()
            opt.zero_grad()
        opt.close()
    return {f"{n} {tuple(p.shape)}": float((p - q).detach().norm() / (q - p0).detach().norm())
            for (n, p), q, p0 in zip(ours.named_parameters(), theirs.parameters(), start)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    results = {}
    for threshold in ("0", "4096"):
        os.environ["SMARTINF_SMALL_TENSOR"] = threshold
        for state_dtype in ("int8", "int4"):
            results[f"{state_dtype}, small_tensor={threshold}"] = net_change_errors(state_dtype)
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
