"""Trains the compact GPT on generated text with one optimizer per run, and compares them.

    python -m examples.gpt.train [--steps 250] [--runs torch ...] [--out gpt_losses.png] [--dir DIR]
    python examples/gpt/train.py ...            (same, from the repository root or anywhere)

Every run starts from the same initial weights and sees the same batches, so the loss
curves differ only by the optimizer. Where forward and backward run in bf16, torch's and
smartinf's runs are made again in float32 (``--fp32-steps``, in the plot too) and the output
says where their curves part and why: the optimizers agree to rounding, which bf16 autocast
turns into different weights (in float32 the curves overlap: 9.5e-07 apart at most over
90 steps here, where in bf16 they parted from step 66).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Optional
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make `examples.gpt` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import smartinf.optim  # noqa: E402
from smartinf.planning import compute_dtype  # noqa: E402
from smartinf.compress import TopK  # noqa: E402

from examples.gpt.data import Language, batches  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
DEMO_RUNS = ["torch", "smartinf", "smartinf-topk1%"]
FINAL_WINDOW = 20  # steps averaged for the "final loss": one step's loss is noisy
# The smartinf runs keep their states in RAM (the memory tier) and make them durable in
# their directory every 10 steps: the same bits as states read from and written to the
# disk every step (tests/test_tiers.py), without a step bound by the disk here (the demo's
# first part shows that step). --states-on-disk streams them every step instead.
RESIDENT = dict(memory_budget="512MiB", commit_every=10)


@dataclass(frozen=True)
class TrainConfig:
    """Model and batch shape; the vocabulary size follows from ``n_topics``."""
    # ~23 M params, 256 tokens a step: ~0.33 s a step (torch AdamW) on one core here.
    batch_size: int = 4
    seq_len: int = 64
    d_model: int = 512
    n_layer: int = 7
    n_head: int = 8
    n_topics: int = 8  # ~180 words per topic, plus 256 names: a 1.7 k-word vocabulary

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, seq_len=self.seq_len, d_model=self.d_model,
                         n_layer=self.n_layer, n_head=self.n_head)


def _sync(device: torch.device) -> None:
    """Waits for queued kernels so that wall-clock times are per phase (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(make_optimizer: OptimizerFactory, steps: int, config: TrainConfig = TrainConfig(),
          seed: int = 0, device: str | torch.device = "cpu",
          dtype: torch.dtype | None = None, progress_desc: str = "train") -> dict:
    """Trains a fresh model for ``steps`` steps; same ``seed``, same weights and batches.

    ``dtype`` is the autocast dtype of forward and backward (``torch.float32``: no
    autocast; None: ``compute_dtype.choose(device)``, bf16 where the device runs it fast);
    parameters, gradients and optimizer states stay fp32.
    Returns per-step ``losses``, ``fwd_bwd_s`` and ``opt_s`` (step + zero_grad), the model
    size, and ``traffic`` (bytes per link during the steps) when the optimizer has a
    ``traffic()`` method. An optimizer with
    a ``close()`` method is closed at the end, since it does not outlive the run.
    """
    device = torch.device(device)
    dtype = compute_dtype.choose(device).dtype if dtype is None else dtype
    lang = Language(n_topics=config.n_topics)
    model = GPT(config.model_config(lang.vocab_size), seed=seed).to(device)
    data = batches(lang, config.batch_size, config.seq_len, seed)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    opt = make_optimizer(list(model.parameters()))
    result: dict = {"config": asdict(config), "dtype": str(dtype), "vocab_size": lang.vocab_size,
                    "params": model.num_params(),
                    "tokens_per_step": config.batch_size * config.seq_len,
                    "losses": [], "fwd_bwd_s": [], "opt_s": []}
    traffic = getattr(opt, "traffic", None)
    start = traffic() if callable(traffic) else {}  # leaves out the initial state write
    try:
        # a bar on a terminal; in a log (a job's output file), a line every tenth of the run
        tty = sys.stderr.isatty()
        bar = tqdm(range(steps), desc=progress_desc, unit="step", dynamic_ncols=True, disable=not tty)
        every = max(1, steps // 10)
        for i in bar:
            inputs, targets = (t.to(device) for t in next(data))
            t0 = time.perf_counter()
            with autocast:
                logits = model(inputs)
            # fp32 loss: a bf16 log-softmax over thousands of words loses precision.
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            _sync(device)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            t2 = time.perf_counter()
            result["losses"].append(loss.item())
            result["fwd_bwd_s"].append(t1 - t0)
            result["opt_s"].append(t2 - t1)
            bar.set_postfix(loss=f"{loss.item():.3f}", step_ms=f"{(t2 - t0) * 1e3:.0f}",
                            opt_ms=f"{(t2 - t1) * 1e3:.0f}")
            if not tty and ((i + 1) % every == 0 or i + 1 == steps):
                print(f"{progress_desc}: step {i + 1}/{steps}, loss {loss.item():.3f}, "
                      f"{(t2 - t0) * 1e3:.0f} ms (optimizer {(t2 - t1) * 1e3:.0f} ms)",
                      file=sys.stderr, flush=True)
        bar.close()
        if callable(traffic):
            result["traffic"] = {k: v - start[k] for k, v in traffic().items()}
    finally:
        close = getattr(opt, "close", None)
        if callable(close):
            close()
    return result


def summarize(result: dict) -> dict[str, float]:
    """Final loss (mean of the last steps) and mean step times.

    The first step is left out of the times: it allocates the optimizer's state.
    """
    last = result["losses"][-FINAL_WINDOW:]
    fwd_bwd = result["fwd_bwd_s"][1:] or result["fwd_bwd_s"]
    opt = result["opt_s"][1:] or result["opt_s"]
    return {"final_loss": sum(last) / len(last),
            "step_s": (sum(fwd_bwd) + sum(opt)) / len(opt),
            "opt_s": sum(opt) / len(opt)}


def plot_losses(results: dict[str, list[float]], path: str | os.PathLike) -> None:
    """One labelled loss curve per run: raw (faint) and a moving average (bold)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state or GUI backend

    fig = Figure(figsize=(8, 5), layout="tight")
    ax = fig.add_subplot()
    window = 10
    for i, (name, losses) in enumerate(results.items()):
        color = f"C{i}"
        ax.plot(range(1, len(losses) + 1), losses, color=color, alpha=0.25, linewidth=0.8)
        if len(losses) >= window:
            smooth = [sum(losses[j - window:j]) / window for j in range(window, len(losses) + 1)]
            ax.plot(range(window, len(losses) + 1), smooth, color=color, linewidth=2, label=name)
        else:
            ax.lines[-1].set(alpha=1, label=name)
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="GPT training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def optimizers(lr: float, weight_decay: float, state_dir: str,
               storage: Optional[dict] = None) -> dict[str, OptimizerFactory]:
    """The runs, by name: each makes an optimizer for the model's params; ``storage``: the
    smartinf runs' pipeline settings (default ``RESIDENT``)."""
    storage = RESIDENT if storage is None else storage
    def run_dir(name: str) -> str:  # a fresh directory per run for on-disk states
        path = os.path.join(state_dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    runs: dict[str, OptimizerFactory] = {
        "torch": lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
    }
    def smartinf_adamw(name: str, compress: TopK | None = None,
                       state_dtype: str = "fp32") -> OptimizerFactory:
        return lambda params: smartinf.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, devices=[run_dir(name)], compress=compress,
            state_dtype=state_dtype, **storage)

    runs["smartinf"] = smartinf_adamw("smartinf")
    runs["smartinf-topk1%"] = smartinf_adamw("smartinf-topk1%", TopK(0.01))
    # Not in the default demo: the error-feedback variant of the accuracy measurement.
    runs["smartinf-topk1%-ef"] = smartinf_adamw("smartinf-topk1%-ef", TopK(0.01, error_feedback=True))
    # Not in the default demo either: Adam's moments 8-bit block-wise on the device.
    runs["smartinf-int8"] = smartinf_adamw("smartinf-int8", state_dtype="int8")
    # Nor this: 4-bit moments (Li et al. 2023), kernels/quant4.h.
    runs["smartinf-int4"] = smartinf_adamw("smartinf-int4", state_dtype="int4")
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--runs", nargs="+", metavar="NAME", help="runs to do (default: all)")
    p.add_argument("--out", default="gpt_losses.png", help="loss-curve PNG")
    p.add_argument("--dir", help="directory for on-disk optimizer states (default: a temporary one)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--states-on-disk", action="store_true",
                   help="smartinf runs read and write their states on disk every step "
                        "(default: in RAM, made durable every 10 steps)")
    compute_dtype.add_argument(p)
    p.add_argument("--fp32-steps", type=int, default=100,
                   help="where forward/backward run in bf16: torch's and smartinf's runs again "
                        "this many steps in float32, to show why their curves part (0: not)")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's choice, one per core); use fewer "
                        "when other processes keep cores busy: waiting threads spin")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = compute_dtype.announce("cpu", args.dtype)

    with tempfile.TemporaryDirectory(prefix="gpt-states-", dir=args.dir) as state_dir:
        runs = optimizers(args.lr, args.weight_decay, state_dir, {} if args.states_on_disk else None)
        names = args.runs or DEMO_RUNS
        unknown = [n for n in names if n not in runs]
        if unknown:
            p.error(f"unknown run(s) {unknown}; known: {list(runs)}")
        config = TrainConfig()
        results = {}
        for name in names:
            results[name] = train(runs[name], args.steps, config, seed=args.seed,
                                  dtype=dtype.dtype, progress_desc=name)
    first = next(iter(results.values()))
    print(f"model: {first['params'] / 1e6:.1f} M params, vocab {first['vocab_size']} "
          f"(ln vocab = {math.log(first['vocab_size']):.2f}), {first['tokens_per_step']} tokens/step, "
          f"{args.steps} steps, {dtype.name} forward/backward")
    print(f"{'run':<16} {'final loss':>10} {'step ms':>9} {'opt ms':>8}")
    for name, r in results.items():
        s = summarize(r)
        print(f"{name:<16} {s['final_loss']:>10.3f} {s['step_s'] * 1e3:>9.0f} {s['opt_s'] * 1e3:>8.0f}")
    for name, r in results.items():
        if "traffic" in r:  # cumulative bytes per link, shown per param and step
            t, per = r["traffic"], r["params"] * args.steps
            print(f"traffic {name} (B/param/step): host->device {t['host_to_device'] / per:.2f}, "
                  f"device->host {t['device_to_host'] / per:.2f}, storage read "
                  f"{t['storage_read'] / per:.2f}, write {t['storage_write'] / per:.2f}")
    curves = {name: r["losses"] for name, r in results.items()}
    fp32 = None
    if "torch" in results and "smartinf" in results and dtype.dtype != torch.float32 \
            and args.fp32_steps > 0:  # the same pair without autocast: why the curves part
        with tempfile.TemporaryDirectory(prefix="gpt-states-", dir=args.dir) as state_dir:
            runs = optimizers(args.lr, args.weight_decay, state_dir,
                              {} if args.states_on_disk else None)
            fp32 = [train(runs[name], min(args.fp32_steps, args.steps), config, seed=args.seed,
                          dtype=torch.float32, progress_desc=f"{name} fp32")["losses"]
                    for name in ("torch", "smartinf")]
        curves.update({"torch fp32": fp32[0], "smartinf fp32": fp32[1]})
    plot_losses(curves, args.out)
    print(f"loss curves: {args.out}")
    if "torch" in results and "smartinf" in results:
        print(why_curves_part(results["torch"]["losses"], results["smartinf"]["losses"],
                              dtype.name, fp32))


#: |loss difference| from which two runs' curves are said to part (their losses ~5 nats)
PARTED = 0.01


def parting(a: list[float], b: list[float]) -> tuple[Optional[int], float]:
    """(the first step, from 1, whose losses differ by more than ``PARTED``, None if none;
    the largest difference)."""
    gaps = [abs(x - y) for x, y in zip(a, b)]
    first = next((i + 1 for i, d in enumerate(gaps) if d > PARTED), None)
    return first, max(gaps, default=0.0)


def why_curves_part(torch_losses: list[float], ours: list[float], dtype_name: str,
                    fp32: Optional[list[list[float]]]) -> str:
    """Where torch's and smartinf's curves part, and why: the optimizers agree to rounding
    (1-2 ulp a step, docs/correctness.md); bf16 autocast turns those ulps into different
    bf16 weights, and the trajectories drift apart from there. ``fp32``: the two runs' losses
    without autocast, where the curves should stay together."""
    first, most = parting(torch_losses, ours)
    lines = [f"torch vs smartinf, {dtype_name} forward/backward: "
             + (f"the curves part from step {first} (losses more than {PARTED} apart), "
                if first else f"never more than {PARTED} apart, ")
             + f"{most:.3f} at most over {len(ours)} steps"]
    if fp32 is not None:
        f_first, f_most = parting(*fp32)
        lines.append(f"the same pair in float32, {len(fp32[0])} steps: "
                     + (f"parts from step {f_first}, " if f_first else "the curves overlap, ")
                     + f"{f_most:.2g} apart at most" + (
                         f" (in {dtype_name}, {parting(torch_losses[:len(fp32[0])], ours)[1]:.2g}"
                         f" over those steps)" if dtype_name != "float32" else ""))
    ulps = ("the two optimizers agree to rounding, 1-2 ulp of fp32 a step (torch's kernels "
            "fuse multiply-adds, smartinf's round each operation: docs/correctness.md)")
    if dtype_name == "float32" or (fp32 is not None and parting(*fp32)[0] is not None):
        lines.append(f"why: {ulps}, differences that training carries on")
    elif first is not None:
        lines.append(f"why: {ulps}; bf16 autocast rounds every weight to 8 bits of mantissa "
                     f"each forward, so a 1-ulp difference flips some of those roundings, each "
                     f"flip a 2^-8 relative change that training carries on and grows: two "
                     f"equally exact trajectories, parted"
                     + (" (in float32 they overlap)" if fp32 is not None else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
