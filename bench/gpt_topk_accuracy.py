"""Top-k accuracy on the demo GPT: final loss per ratio, with and without error feedback.

    python bench/gpt_topk_accuracy.py [--steps 250] [--out bench/results/gpt_topk.json]

Runs on CUDA when present (the numbers behind smartinf.pipeline.compress's defaults were taken on
an H100), else on the CPU (~3 min per run here). Every run sees the same weights and
batches; the dense smartinf run is the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import smartinf.optim  # noqa: E402
from smartinf.planning import compute_dtype  # noqa: E402
from examples.gpt.train import TrainConfig, summarize, train  # noqa: E402
from smartinf.pipeline.compress import TopK  # noqa: E402

SETTINGS = [(None, False), (0.1, False), (0.1, True), (0.05, True), (0.02, True),
            (0.01, False), (0.01, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--out", default="bench/results/gpt_topk.json")
    compute_dtype.add_argument(p)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = compute_dtype.announce(device, args.dtype).dtype
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for ratio, ef in SETTINGS:
            name = "dense" if ratio is None else f"topk{ratio:g}{'-ef' if ef else ''}"
            compress = None if ratio is None else TopK(ratio, error_feedback=ef)
            r = train(lambda params: smartinf.optim.AdamW(
                params, lr=5e-4, weight_decay=0.1, devices=[os.path.join(d, name)],
                compress=compress), args.steps, TrainConfig(), seed=0, device=device,
                dtype=dtype, progress_desc=name)
            results[name] = dict(summarize(r), losses=r["losses"])
            print(f"{name:<12} final loss {results[name]['final_loss']:.3f}", flush=True)
    dense = results["dense"]["final_loss"]
    for name, r in results.items():
        r["vs_dense"] = r["final_loss"] / dense - 1
        print(f"{name:<12} {r['final_loss']:.3f} ({r['vs_dense']:+.1%} vs dense)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": device, "steps": args.steps, "runs": results}, f)


if __name__ == "__main__":
    main()
