"""AMSGrad and ``maximize`` through smartinf.integrations.deepspeed, next to DeepSpeed's own
ZeRO-3 (fp32, no offload: its fp32 partitions are stepped by a client torch optimizer) on
the same model and batches. For tests/test_deepspeed.py:

    torchrun --nproc_per_node=1 tests/deepspeed_rules.py --dir D --out results.json [--cases a,b]

Each case gives smartinf a config "optimizer" block and DeepSpeed the torch optimizer
that block stands for (Lion: the paper's update in plain torch, as tests/test_optim.py's
reference, with torch's ``maximize``). Per case rank 0 records the per-step losses of both,
the relative and largest differences of the final params and of every optimizer state
(read with DeepSpeed's ``safe_get_full_*``), or the case's error; with ``--refusals``, the
errors of engines that must not be built (param groups that disagree on the stored states,
AMSGrad with int8 states).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.gpt

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import smartinf.integrations.deepspeed as smartinf_ds  # noqa: E402
from examples.deepspeed.train import leave_without_teardown  # noqa: E402
from examples.gpt.data import Language, batches  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepspeed_api  # noqa: E402  (its training loop)

LANG = Language()
STEPS = 8


class TorchLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2) in plain torch, ``maximize`` as torch's
    optimizers do it (the gradient negated first)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay,
                                      maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m * beta1 + g * (1 - beta1)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(beta2).add_(g, alpha=1 - beta2)


ADAM = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
# name: (config "optimizer" block for smartinf, the reference's torch optimizer, its kwargs,
#        the optimizer states to compare)
CASES = {
    "adamw_amsgrad": ({"type": "AdamW", "params": {**ADAM, "amsgrad": True}},
                      torch.optim.AdamW, {**ADAM, "amsgrad": True},
                      ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false. Without weight decay: with L2
    # decay the kernel's roundings differ from torch's FMAs (grad + wd * p, lerp) by an ulp,
    # which Adam's normalisation turns into other update signs where grad ~ -wd * p: on this
    # model the params end 6e-5 to 1.5e-4 apart (by norm) after 8 steps, AMSGrad, maximize or
    # neither. tests/test_optim.py compares L2 Adam (AMSGrad too) on a tamer model.
    "adam_amsgrad_maximize": ({"type": "Adam", "params": {**ADAM, "weight_decay": 0.0,
                                                          "adam_w_mode": False, "amsgrad": True,
                                                          "maximize": True}},
                              torch.optim.Adam, {**ADAM, "weight_decay": 0.0, "amsgrad": True,
                                                 "maximize": True},
                              ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "adamw_maximize": ({"type": "AdamW", "params": {**ADAM, "maximize": True}},
                       torch.optim.AdamW, {**ADAM, "maximize": True}, ("exp_avg", "exp_avg_sq")),
    "lion_maximize": ({"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99],
                                                  "weight_decay": 0.1, "maximize": True}},
                      TorchLion, {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1,
                                  "maximize": True}, ("exp_avg",)),
    "sgd_maximize": ({"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "nesterov": True,
                                                "weight_decay": 0.1, "maximize": True}},
                     torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True,
                                       "weight_decay": 0.1, "maximize": True},
                     ("momentum_buffer",)),
    "adagrad_maximize": ({"type": "Adagrad", "params": {"lr": 1e-2, "lr_decay": 0.01,
                                                        "weight_decay": 0.1, "maximize": True}},
                         torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 0.01, "weight_decay": 0.1,
                                               "maximize": True}, ("sum",)),
}


def config(optimizer: dict | None, devices: str | None) -> dict:
    """Clipping at 1.0 acts on this model's early steps: its coefficient and maximize's
    sign travel in one grad_scale in smartinf."""
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
         "zero_optimization": {"stage": 3}, "steps_per_print": 10 ** 9,
         "zero_allow_untested_optimizer": True}  # SGD and TorchLion are not on ZeRO's list
    if optimizer is not None:
        c["optimizer"] = optimizer
    if devices:
        c["smartinf"] = {"devices": [devices]}
    return c


def model() -> GPT:
    return GPT(GPTConfig(LANG.vocab_size, 32, 64, 2, 4), seed=0)


def train(eng: object, steps: int) -> list:
    return deepspeed_api.train(eng, batches(LANG, 4, 32, seed=1000 + torch.distributed.get_rank()), steps)


def diff(a: list, b: list) -> dict:
    """||a - b|| / ||b|| and max |a - b| / max |b| over lists of tensors."""
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    worst = max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))
    scale = max(float(y.double().abs().max()) for y in b)
    return {"rel": (num / den) ** 0.5 if den else num ** 0.5, "max": worst,
            "max_rel": worst / scale if scale else worst}


def run_case(name: str, root: Path) -> dict:
    block, torch_class, kwargs, states = CASES[name]
    m = model()
    ours = smartinf_ds.initialize(model=m, model_parameters=m.parameters(),
                                  config=config(block, str(root / name)))[0]
    m = model()
    ref = deepspeed.initialize(model=m, optimizer=torch_class(m.parameters(), **kwargs),
                               config=config(None, None))[0]
    rule = ours.optimizer.pipeline.optimizer
    out = {"rule": rule.name, "maximize": rule.maximize, "state_names": list(rule.state_names),
           "losses": [train(ours, STEPS), train(ref, STEPS)]}
    pa, pb = dict(ours.module.named_parameters()), dict(ref.module.named_parameters())
    out["params"] = diff([safe_get_full_fp32_param(pa[n]) for n in pa],
                         [safe_get_full_fp32_param(pb[n]) for n in pa])
    got = {}
    for key in states:
        got[key] = [safe_get_full_optimizer_state(pa[n], key) for n in pa]
        out[key] = diff(got[key], [safe_get_full_optimizer_state(pb[n], key) for n in pa])
    if "max_exp_avg_sq" in got:  # AMSGrad ran: the running max, above exp_avg_sq somewhere
        pairs = list(zip(got["max_exp_avg_sq"], got["exp_avg_sq"]))
        out["max_below_exp_avg_sq"] = sum(int((m < v).sum()) for m, v in pairs)
        out["max_above_exp_avg_sq"] = sum(int((m > v).sum()) for m, v in pairs)
    for eng in (ours, ref):
        eng.destroy()
    return out


def refusals(root: Path) -> dict:
    """Engines that must not be built: their errors."""
    def error(name, make_optimizer, block=None, **smartinf):
        m = model()
        cfg = config(block, str(root / name))
        cfg["smartinf"].update(smartinf)
        try:
            smartinf_ds.initialize(model=m, optimizer=make_optimizer and make_optimizer(m),
                                   model_parameters=None if make_optimizer else m.parameters(),
                                   config=cfg)
            return "built"
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"

    def two_groups(m, **second):
        ps = list(m.parameters())
        return [{"params": ps[:2]}, {"params": ps[2:], **second}]

    return {
        "amsgrad_per_group": error("g1", lambda m: torch.optim.AdamW(two_groups(m, amsgrad=True))),
        "adagrad_initial_per_group": error("g2", lambda m: torch.optim.Adagrad(
            two_groups(m, initial_accumulator_value=0.5))),
        "amsgrad_int8": error("i8", None, CASES["adamw_amsgrad"][0], state_dtype="int8"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--refusals", action="store_true", help="also the engines that must fail")
    a = p.parse_args()
    deepspeed.init_distributed()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.cases.split(","):
        try:
            results[name] = run_case(name, root)
        except Exception as e:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    if a.refusals:
        results["refusals"] = refusals(root)
    if torch.distributed.get_rank() == 0:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    leave_without_teardown()
