"""Training quality with int8 (or int4) optimizer states on the demo GPT: final loss of
``smartinf.optim.AdamW(state_dtype=...)`` against fp32 states and torch.optim.AdamW.

    python bench/gpt_int8_accuracy.py [--steps 300] [--out bench/results/gpt_int8]
    python bench/gpt_int8_accuracy.py --state-dtype int8 --state-dtype int4 \\
        [--noise 1e-3] [--out bench/results/gpt_int4]

Same weights, same batches, same seed for every run; writes ``OUT.json`` and the loss
curves ``OUT.png``. The goal: the int8 (int4) final loss within 2 % of the fp32 one. With the
default ``--state-dtype int8`` the runs and the JSON are those of bench/measured/cpu-gpt-int8.
``--noise R`` adds fp32 states with the learning rate times 1 + R: how far apart two runs
whose arithmetic differs by that much drift (the per-step gap a quantized run is judged
against).
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
from smartinf.planning import compute_dtype  # noqa: E402


WINDOW = 20  # steps per moving mean: batches differ in difficulty by several percent


def deviations(losses: list[float], reference: list[float]) -> dict:
    """How far one loss curve is from another, step by step (|a - b| / b) and as moving
    means: two runs whose arithmetic differs drift apart, and per-batch losses then differ
    by what the batches' difficulty does to two slightly different models."""
    gaps = [abs(a - b) / b for a, b in zip(losses, reference)]
    over = [i for i, g in enumerate(gaps) if g > 0.01]

    def smooth(xs):
        return [sum(xs[i:i + WINDOW]) / WINDOW for i in range(len(xs) - WINDOW + 1)]

    smoothed = [abs(a - b) / b for a, b in zip(smooth(losses), smooth(reference))]
    return {"max": max(gaps), "max_step": gaps.index(max(gaps)) + 1,
            "within_1pct_until": over[0] if over else len(gaps),
            "max_smoothed": max(smoothed, default=0.0), "window": WINDOW}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--state-dtype", action="append", choices=["int8", "int4"],
                   help="quantized state dtypes to compare with fp32 (repeatable; default int8)")
    p.add_argument("--out", help="output path without extension (default "
                                 "bench/results/gpt_<dtypes>)")
    p.add_argument("--noise", type=float, action="append", default=[], metavar="R",
                   help="also fp32 states at lr x (1 + R), the noise floor (repeatable)")
    compute_dtype.add_argument(p)
    args = p.parse_args()
    dtypes = args.state_dtype or ["int8"]
    out = args.out or "bench/results/gpt_" + "_".join(dtypes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = compute_dtype.announce(device, args.dtype).dtype
    results = {}
    with tempfile.TemporaryDirectory() as d:
        runs = optimizers(5e-4, 0.1, d)
        for r in args.noise:
            runs[f"smartinf-lr+{r:g}"] = optimizers(5e-4 * (1 + r), 0.1,
                                                    os.path.join(d, f"lr+{r:g}"))["smartinf"]
        for name in ["torch", "smartinf"] + [f"smartinf-{t}" for t in dtypes] + \
                [f"smartinf-lr+{r:g}" for r in args.noise]:
            r = train(runs[name], args.steps, TrainConfig(), seed=0, device=device,
                      dtype=dtype, progress_desc=name)
            results[name] = dict(summarize(r), losses=r["losses"])
            print(f"{name:<14} final loss {results[name]['final_loss']:.4f}", flush=True)
    fp32 = results["smartinf"]["final_loss"]
    report = {"device": device, "dtype": str(dtype), "steps": args.steps}
    for r in args.noise:
        report[f"lr+{r:g}_vs_fp32_per_step"] = gaps = deviations(
            results[f"smartinf-lr+{r:g}"]["losses"], results["smartinf"]["losses"])
        print(f"fp32 states at lr x (1 + {r:g}): {gaps['max']:.2%} at most per step (step "
              f"{gaps['max_step']}), within 1 % up to step {gaps['within_1pct_until']}")
    for t in dtypes:
        rel = results[f"smartinf-{t}"]["final_loss"] / fp32 - 1
        report[f"{t}_vs_fp32"] = rel
        print(f"{t} states vs fp32 states: {rel:+.2%} final loss (goal: within 2 %)")
        report[f"{t}_vs_fp32_per_step"] = gaps = deviations(
            results[f"smartinf-{t}"]["losses"], results["smartinf"]["losses"])
        print(f"  per step: {gaps['max']:.2%} at most (step {gaps['max_step']}), within 1 % up to "
              f"step {gaps['within_1pct_until']}; moving means of {WINDOW} steps: "
              f"{gaps['max_smoothed']:.2%} at most")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(dict(report, runs=results), f)
    plot_losses({name: r["losses"] for name, r in results.items()}, out + ".png")


if __name__ == "__main__":
    main()
