"""DeepSpeed's fp32 accessors and checkpoint tools on smartinf.integrations.deepspeed, next
to DeepSpeed's own ZeRO-3 (fp32, no offload: its fp32 partitions are the model's, torch
AdamW) on the same model and batches. For tests/test_deepspeed.py:

    torchrun --nproc_per_node=2 tests/deepspeed_api.py --dir D --out results.json

Each check records its figures, or its error (so one failing check does not hide the
others); rank 0 writes them all.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.gpt

import deepspeed  # noqa: E402
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,  # noqa: E402
                             safe_get_local_fp32_param, safe_set_full_fp32_param, safe_set_full_grad,
                             safe_set_full_optimizer_state, safe_set_local_fp32_param)
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

import smartinf.integrations.deepspeed as smartinf_ds  # noqa: E402
from smartinf.integrations.deepspeed_norm import norm_groups  # noqa: E402
from examples.deepspeed.train import leave_without_teardown  # noqa: E402
from examples.gpt.data import Language, batches  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

LANG = Language()
KEYS = (None, "exp_avg", "exp_avg_sq")  # the master, then Adam's states


def config(devices: str | None, lr: float = 1e-2, bf16: bool = False,
           block: dict | None = None, zero: dict | None = None) -> dict:
    """DeepSpeed's default stage3_param_persistence_threshold: all but the embedding stay
    gathered. ``block``: more keys of the smartinf block; ``zero``: of zero_optimization."""
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1,
                                                   "torch_adam": True}},
         "zero_optimization": {"stage": 3, **(zero or {})}, "steps_per_print": 10 ** 9}
    if bf16:
        c["bf16"] = {"enabled": True}
    if devices:
        c["smartinf"] = {"devices": [devices], **(block or {})}
    return c


def engine(devices: str | None, seed: int = 0, args: object = None, lr: float = 1e-2,
           bf16: bool = False, block: dict | None = None, zero: dict | None = None,
           freeze: bool = False) -> object:
    """``freeze``: the blocks' first LayerNorms frozen (kept whole, in no sub-group)."""
    model = GPT(GPTConfig(LANG.vocab_size, 32, 64, 2, 4), seed=seed)
    if freeze:
        for name, p in model.named_parameters():
            if ".ln1." in name:
                p.requires_grad_(False)
    init = smartinf_ds.initialize if devices else deepspeed.initialize
    if args is not None:  # the argparse way: the config only in args.deepspeed_config
        return init(args=args, model=model, model_parameters=model.parameters())[0]
    return init(model=model, model_parameters=model.parameters(),
                config=config(devices, lr, bf16, block, zero))[0]


def train(eng: object, data: object, steps: int) -> list:
    losses = []
    for _ in range(steps):
        x, y = (t.to(eng.device) for t in next(data))
        logits = eng(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        eng.backward(loss)
        eng.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    return losses


def named(eng: object) -> dict:
    return dict(eng.module.named_parameters())


def rel(a: list, b: list) -> float:
    """||a - b|| / ||b|| over lists of tensors (0 where both are 0)."""
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return (num / den) ** 0.5 if den else num ** 0.5


def states_diff(a: object, b: object, keys: tuple = KEYS) -> dict:
    """Per state (master, exp_avg, exp_avg_sq) rel() of all params, as DeepSpeed's
    safe_get_* give them; "local": this rank's parts of the masters."""
    out = {}
    pa, pb = named(a), named(b)
    for key in keys:
        get = safe_get_full_fp32_param if key is None else \
            (lambda p, k=key: safe_get_full_optimizer_state(p, k))
        out[str(key)] = rel([get(pa[n]) for n in pa], [get(pb[n]) for n in pa])
    out["local"] = rel([safe_get_local_fp32_param(pa[n]) for n in pa],
                       [safe_get_local_fp32_param(pb[n]) for n in pa])
    return out


def gathered(eng: object) -> dict:
    """Every param whole, as the model holds it now; the kept-whole (persistent) ones left
    gathered, as the caller found them (a ``GatheredParameters`` of them would release them
    at its exit, and an edit of theirs that followed would edit nothing)."""
    params = named(eng)
    apart = [p for p in params.values() if p.ds_status != ZeroParamStatus.AVAILABLE]
    with deepspeed.zero.GatheredParameters(apart, enabled=bool(apart)):
        return {n: p.detach().clone() for n, p in params.items()}


def start(**options: dict) -> tuple:
    """The script's arguments (--dir, --out, and ``options``: name -> add_argument's
    keywords) and this rank, distributed set up."""
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    for name, kw in options.items():
        p.add_argument(f"--{name}", **kw)
    a = p.parse_args()
    deepspeed.init_distributed()
    return a, torch.distributed.get_rank()


def main() -> None:
    a, rank = start()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "ds.json"
    if rank == 0:
        path.write_text(json.dumps(config(str(root / "ours"))))
    torch.distributed.barrier()
    results: dict = {}

    def check(fn):  # runs now (on every rank alike); its figures or its error go under its name
        try:
            results[fn.__name__] = fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            results[fn.__name__] = {"error": f"{type(e).__name__}: {e}"}
        return fn

    ours = ref = None

    @check
    def config_in_args():
        nonlocal ours
        ours = engine(str(root / "ours"), args=argparse.Namespace(deepspeed_config=str(path)))
        return {"ok": True}

    ours = ours or engine(str(root / "ours"))
    ref = engine(None)
    data = [batches(LANG, 4, 32, seed=1000 + rank) for _ in range(2)]
    results["losses"] = [train(ours, data[0], 2), train(ref, data[1], 2)]

    @check
    def gather_waits_for_the_step():
        """Right after step(), the step's updates may still run (overlap: they finish during
        the next forward): a gather waits for those of the params it gathers, so it gives
        the updated params (fp32: the masters, read after the step is settled)."""
        before = ours.optimizer.overlap_stats["deferred_updates"]
        g = gathered(ours)
        waited = ours.optimizer.overlap_stats["deferred_updates"] - before
        masters = [safe_get_full_fp32_param(q) for q in named(ours).values()]
        return {"vs_masters": rel(list(g.values()), masters), "waited_for": waited}

    @check
    def accessors():
        diff = states_diff(ours, ref)
        # in fp32 the master is the model's param
        g = gathered(ours)
        diff["master_vs_model"] = rel([safe_get_full_fp32_param(q) for q in named(ours).values()],
                                      list(g.values()))
        return diff

    @check
    def setters():
        """The same sets on both, then a step (the model's params take the new masters
        at the step, in DeepSpeed)."""
        out = {}
        for eng in (ours, ref):
            ps = named(eng)
            emb, bias, fc = (ps[n] for n in ("tok_emb.weight", "blocks.0.attn.qkv.bias",
                                             "blocks.0.mlp.fc.weight"))
            new = safe_get_full_fp32_param(emb) * 0.5 + 0.01
            safe_set_full_fp32_param(emb, new)
            exp_avg = safe_get_full_optimizer_state(fc, "exp_avg")
            safe_set_full_optimizer_state(fc, exp_avg * 3, "exp_avg")
            safe_set_local_fp32_param(bias, safe_get_local_fp32_param(bias) - 0.1)
            out.setdefault("set_then_get", []).append(rel([safe_get_full_fp32_param(emb)], [new]))
        out["loss"] = [train(ours, data[0], 1)[0], train(ref, data[1], 1)[0]]
        out.update(states_diff(ours, ref))
        return out

    @check
    def grads_set_after_step():
        """safe_set_full_grad after step(), while the step's updates may still finish
        (overlap: during the next forward): DeepSpeed's step has used the gradients by then
        (the next backward overwrites them), so the set changes nothing; then a step."""
        for eng, d in ((ours, data[0]), (ref, data[1])):
            x, y = (t.to(eng.device) for t in next(d))
            logits = eng(x)
            eng.backward(F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)))
            eng.step()
            pending = getattr(eng.optimizer, "_tail", None) is not None and eng.optimizer._tail.open
            for q in eng.module.parameters():
                safe_set_full_grad(q, torch.zeros(q.ds_shape, device=eng.device))
            if eng is ours:  # the step was still finishing, and was finished before the sets
                out = {"pending_at_set": pending, "pending_after": eng.optimizer._tail.open}
        out["loss"] = [train(ours, data[0], 1)[0], train(ref, data[1], 1)[0]]
        out.update(states_diff(ours, ref))
        return out

    @check
    def tail_launched_after_the_post_step():
        """The updates left to the tail are launched after DeepSpeed's post step, whose
        gather of the kept-whole params synchronizes the whole device (on a GPU it would
        wait for them all). No update starts during this backward (no scale predicted):
        every sub-group but the kept-whole params' is left to the tail."""
        opt, seen = ours.optimizer, {}
        post = opt._post_step

        def watched(timer_names):
            seen["at_post"] = sorted(opt._tail._flights)
            return post(timer_names)
        opt._post_step = watched
        opt._session.predict(None)
        try:
            train(ours, data[0], 1)
        finally:
            del opt._post_step
        train(ref, data[1], 1)  # (the two engines stay a step apart from none)
        return {"at_post": seen["at_post"], "after_step": sorted(opt._tail._flights),
                "open": opt._tail.open}

    cwd = os.getcwd()
    os.chdir(root)  # where save_dir="" would write

    @check
    def bad_save_dir():
        out = {}
        for name, eng in (("ours", ours), ("ref", ref)):
            for d in (None, ""):
                try:
                    eng.save_checkpoint(d)
                    out[f"{name} {d!r}"] = "saved"
                except Exception as e:  # noqa: BLE001
                    out[f"{name} {d!r}"] = f"{type(e).__name__}: {e}"
        out["written"] = sorted(os.listdir(root))
        return out

    os.chdir(cwd)
    ours.save_checkpoint(str(root / "ckpt-ours"))
    ref.save_checkpoint(str(root / "ckpt-ref"))

    @check
    def zero_to_fp32():
        masters = {n: safe_get_full_fp32_param(q) for n, q in named(ours).items()}
        if rank != 0:
            return {}
        sd = get_fp32_state_dict_from_zero_checkpoint(str(root / "ckpt-ours"))
        sd_ref = get_fp32_state_dict_from_zero_checkpoint(str(root / "ckpt-ref"))
        return {"vs_masters": rel([sd[n] for n in masters], list(masters.values())),
                "vs_deepspeed": rel([sd[n] for n in masters], [sd_ref[n] for n in masters])}

    @check
    def load_right_after_step():
        """A load while the last step's updates may still run (overlap): they land before
        the load, not over the loaded weights (the masters are the loaded module's)."""
        train(ours, data[0], 1)
        train(ref, data[1], 1)
        for eng, ckpt in ((ours, "ckpt-ours"), (ref, "ckpt-ref")):
            eng.load_checkpoint(str(root / ckpt), load_module_only=True)
        return states_diff(ours, ref, keys=(None,))

    for i, how in enumerate(({"load_optimizer_states": False}, {"load_module_only": True})):
        def load(how=how, i=i):
            """DeepSpeed's partial loads of our checkpoint into fresh engines (another seed),
            ours and DeepSpeed's own, then a step: both start from the same files, so what
            differs is the load, then one step's rounding. (From checkpoints of their own,
            the two would start apart by the kernels' drift over the steps before, and a first
            Adam step, lr * g / (|g| + eps), flips where g is within that drift of 0: 2 lr.)"""
            fresh = engine(str(root / f"ours-load{i}"), seed=1), engine(None, seed=1)
            for eng in fresh:
                eng.load_checkpoint(str(root / "ckpt-ours"), **how)
            out = {"after_load": states_diff(*fresh, keys=(None,))}  # no states yet in torch's Adam
            out["loss"] = [train(eng, batches(LANG, 4, 32, seed=2000 + rank), 1)[0]
                           for eng in fresh]
            out.update(states_diff(*fresh))
            for eng in fresh:
                eng.destroy()
            return out
        load.__name__ = "load_" + next(iter(how))
        check(load)

    @check
    def failed_commit_keeps_the_step():
        """A durable commit that fails (the disk full at its sync) raises, from step() or,
        with overlap, where the step's tail drains (settle), and undoes nothing: the step
        stands, the devices' and the model's params at it, the directories at the step
        before until a commit lands (the next one's): fp32, and bf16 over fp32 masters."""
        import smartinf._native as native

        def one(bf16):  # (every step durable: the next one's commit fails)
            eng = engine(str(root / f"ours-fail-{bf16}"), bf16=bf16, block={"commit_every": 1})
            d = batches(LANG, 4, 32, seed=3000 + rank)
            train(eng, d, 1)
            eng.optimizer.settle()
            before, steps = gathered(eng), eng.optimizer.pipeline.step_count
            native.arm_fault("store.synced", "error", errno=28)
            errno = None
            try:
                train(eng, d, 1)
                eng.optimizer.settle()
            except OSError as e:
                errno = e.errno
            finally:
                native.disarm_fault()
            after = gathered(eng)
            whole = [n for n, q in named(eng).items() if getattr(q, "ds_persist", False)]
            out = {"errno": errno, "kept_whole": len(whole),
                   "moved": rel(list(after.values()), list(before.values())),
                   "steps": [steps, eng.optimizer.pipeline.step_count],
                   "durable": eng.optimizer.pipeline.durable_step_count}
            out["then"] = train(eng, d, 1)  # training goes on
            eng.optimizer.settle()
            out["durable_then"] = eng.optimizer.pipeline.durable_step_count
            eng.destroy()
            return out
        return {"fp32": one(False), "bf16": one(True)}

    @check
    def offload_states():
        """DeepSpeed's test_offload_states.py ZeRO-3 cases through the block
        (tests/deepspeed_offload.py)."""
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from deepspeed_offload import offload_round_trips
        return offload_round_trips(lambda: GPT(GPTConfig(LANG.vocab_size, 32, 64, 2, 4), seed=3),
                                   root / "offload", lambda: batches(LANG, 4, 32, seed=2000 + rank),
                                   train)

    @check
    def norms_by_subgroup():
        """deepspeed_norm.norm_groups (one all-reduce for every sub-group) against DeepSpeed's
        own _get_norm_groups on the same gradients, several sub-groups, bit for bit: finite,
        then with an inf in one sub-group's gradient (its norm -1)."""
        eng = engine(str(root / "norms"), zero={"sub_group_size": 20000})
        x, y = (t.to(eng.device) for t in next(batches(LANG, 4, 32, seed=7 + rank)))
        logits = eng(x)
        eng.backward(F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)))
        opt = eng.optimizer

        def both() -> list:
            ours_, theirs = norm_groups(opt), opt._get_norm_groups()
            return [[float(a) for a in ours_], [float(b) for b in theirs],
                    all(torch.equal(a, b) for a, b in zip(ours_, theirs))]
        out = {"groups": len(opt.fp16_groups), "finite": both(), "device": eng.device.type,
               "numel": sum(q.ds_numel for q in eng.module.parameters()),
               "tensors": len(list(eng.module.parameters()))}
        out["batched"] = opt.__dict__["_smartinf_norm_group"] != "own"
        grad = opt.averaged_gradients[1][0]
        kept = grad.view(-1)[0].item()
        if rank == 0:
            grad.view(-1)[0] = float("inf")
        out["inf"] = both()
        grad.view(-1)[0] = kept
        eng.step()
        eng.destroy()
        return out

    if rank == 0:
        Path(a.out).write_text(json.dumps(results, indent=1))
    for eng in (ours, ref):
        eng.destroy()


if __name__ == "__main__":
    main()
    leave_without_teardown()
