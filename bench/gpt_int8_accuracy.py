"""Training quality with int8 optimizer states on the demo GPT: final loss of
``smartinf.optim.AdamW(state_dtype="int8")`` against fp32 states and torch.optim.AdamW.

    python bench/gpt_int8_accuracy.py [--steps 300] [--out bench/results/gpt_int8]

Same weights, same batches, same seed for every run; writes ``OUT.json`` and the loss
curves ``OUT.png``. The goal: the int8 final loss within 2 % of the fp32 one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt.train import TrainConfig, optimizers, plot_losses, summarize, train  # noqa: E402

RUNS = ["torch", "smartinf", "smartinf-int8"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="bench/results/gpt_int8")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    with tempfile.TemporaryDirectory() as d:
        runs = optimizers(5e-4, 0.1, d)
        for name in RUNS:
            r = train(runs[name], args.steps, TrainConfig(), seed=0, device=device,
                      dtype=torch.bfloat16, progress_desc=name)
            results[name] = dict(summarize(r), losses=r["losses"])
            print(f"{name:<14} final loss {results[name]['final_loss']:.4f}", flush=True)
    fp32 = results["smartinf"]["final_loss"]
    int8_vs_fp32 = results["smartinf-int8"]["final_loss"] / fp32 - 1
    print(f"int8 states vs fp32 states: {int8_vs_fp32:+.2%} final loss (goal: within 2 %)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"device": device, "steps": args.steps, "int8_vs_fp32": int8_vs_fp32,
                   "runs": results}, f)
    plot_losses({name: r["losses"] for name, r in results.items()}, args.out + ".png")


if __name__ == "__main__":
    main()
