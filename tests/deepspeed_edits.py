"""Params edited between steps, and the kept-whole (persistent) params read right after
``step()``, on smartinf.integrations.deepspeed next to DeepSpeed's own ZeRO-3 (fp32 torch
AdamW, no offload) on the same model and batches. For tests/test_deepspeed.py:

    torchrun --nproc_per_node=2 tests/deepspeed_edits.py --dir D --out O \
        --cases '[["NAME", OVERLAP, ["--bf16", "--block", "{...}"]], ...]'

Each case in turn in this one launch (a launch costs several times a case), in D/NAME with
its results in O/NAME.json and SMARTINF_SPECULATE_ON_CPU set by OVERLAP; a case that fails
ends the launch.

Each step, both engines get the same edit: after step 2 every param clamped through
``GatheredParameters(modifier_rank=0)``, after step 3 the kept-whole params pruned in their
gathered copies (``p.data``, no gather), after step 4 their data replaced by half of it
(``p.data = p.data * 0.5``), after step 5 every param rolled back to its values
after step 1. DeepSpeed's own step would overwrite such edits with its fp32 masters, so its
run is told of them the DeepSpeed way (``safe_set_full_fp32_param``); smartinf's is not.
``--bf16`` trains in bf16 (DeepSpeed's fp32 masters, smartinf's fp32 or split ones), ``--block``
adds keys to the smartinf block (a memory budget, a split master), ``--freeze`` freezes the
blocks' first LayerNorms (kept whole, in no sub-group; the kept-whole edits leave them). Rank 0 writes, per step, the losses, how far each engine's persistent params (read
without a gather) and gathered params are from the other's, how often each step released
a persistent param and which edit came before it; then, clamped once more after
the last step, the largest fp32 master of smartinf's checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.gpt
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepspeed  # noqa: E402
from deepspeed.utils import safe_set_full_fp32_param  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

from deepspeed_api import LANG, engine, gathered, named, rel, start, train  # noqa: E402
from examples.deepspeed.train import leave_without_teardown  # noqa: E402
from examples.gpt.data import batches  # noqa: E402

CLIP = 0.05
# Steps small beside the clamped params: fp32 rounding of torch's AdamW (FMA) and smartinf's
# (rounded once per operation) then stays far below the suite's tolerance over 7 steps.
LR = 1e-3
STEPS = 7


def clamp(eng: object, snapshot: dict) -> None:
    params = list(named(eng).values())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        for p in params:
            p.data.clamp_(-CLIP, CLIP)


def kept_whole(eng: object) -> list:
    """The trained kept-whole params, as gathered as step() left them (an edit of an empty
    released copy would edit nothing)."""
    params = [p for p in named(eng).values() if getattr(p, "ds_persist", False) and p.requires_grad]
    assert all(p.data.numel() == p.ds_numel for p in params), "a kept-whole param was released"
    return params


def prune_kept_whole(eng: object, snapshot: dict) -> None:
    kept = {id(p) for p in kept_whole(eng)}
    for i, p in enumerate(named(eng).values()):
        if id(p) in kept:
            g = torch.Generator().manual_seed(i)
            p.data.mul_((torch.rand(p.shape, generator=g) > 0.3).to(p.device, p.dtype))


def rescale_kept_whole(eng: object, snapshot: dict) -> None:
    """A kept-whole param's data replaced by a new tensor (``p.data = ...``), not edited in
    place: at one rank its gathered copy is then no longer its partition's memory."""
    for p in kept_whole(eng):
        p.data = p.data * 0.5


def roll_back(eng: object, snapshot: dict) -> None:
    params = named(eng)
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
        for n, p in params.items():
            p.data.copy_(snapshot[n])


EDITS = {2: clamp, 3: prune_kept_whole, 4: rescale_kept_whole, 5: roll_back}


def trained_counting_releases(eng: object, data: object) -> tuple:
    """One step's loss, and how often it released a kept-whole param (DeepSpeed's own
    ``param.partition``, which forward and backward leave alone)."""
    calls = []
    kept = [q for q in eng.module.parameters() if getattr(q, "ds_persist", False)]
    own = [q.partition for q in kept]
    for q, partition in zip(kept, own):
        q.partition = lambda *a, _p=partition, **k: (calls.append(1), _p(*a, **k))[1]
    try:
        loss = train(eng, data, 1)[0]
    finally:
        for q, partition in zip(kept, own):
            q.partition = partition
    return loss, len(calls)


def tell_deepspeed(eng: object) -> None:
    """DeepSpeed's own way to make the model's (edited) params its fp32 masters."""
    params = named(eng)
    values = gathered(eng)
    for n, p in params.items():
        if p.data.numel() == p.ds_numel:  # kept whole: its copy is what the forward used
            values[n] = p.data.detach().clone()
    for n, p in params.items():
        if p.requires_grad:  # (a frozen one has no master: GatheredParameters wrote its partition)
            safe_set_full_fp32_param(p, values[n])


def main() -> None:
    a, rank = start(cases={"type": json.loads, "required": True})
    flags = argparse.ArgumentParser()
    flags.add_argument("--bf16", action="store_true")
    flags.add_argument("--block", default="{}", type=json.loads, help="more of the smartinf block")
    flags.add_argument("--freeze", action="store_true", help="the blocks' first LayerNorms frozen")
    for name, overlap, argv in a.cases:
        os.environ["SMARTINF_SPECULATE_ON_CPU"] = "1" if overlap else "0"
        case = flags.parse_args(argv)
        run(Path(a.dir) / name, Path(a.out) / f"{name}.json", case.bf16, case.block, rank, case.freeze)
    leave_without_teardown()


def run(directory: Path, out: Path, bf16: bool, block: dict, rank: int, freeze: bool) -> None:
    ours = engine(str(directory / "ours"), lr=LR, bf16=bf16, block=block, freeze=freeze)
    ref = engine(None, lr=LR, bf16=bf16, freeze=freeze)
    data = [batches(LANG, 4, 32, seed=1000 + rank) for _ in range(2)]
    kept_whole = [n for n, q in named(ours).items() if getattr(q, "ds_persist", False)]
    record: dict = {"kept_whole": len(kept_whole), "steps": []}
    snapshots: dict = {}
    for step in range(1, STEPS + 1):
        (mine_loss, mine_released), (ref_loss, ref_released) = \
            trained_counting_releases(ours, data[0]), trained_counting_releases(ref, data[1])
        losses = [mine_loss, ref_loss]
        mine, theirs = named(ours), named(ref)  # read right after step(), no gather
        shapes_equal = all(mine[n].data.shape == theirs[n].data.shape for n in kept_whole)
        whole = rel([mine[n].data for n in kept_whole], [theirs[n].data for n in kept_whole]) \
            if shapes_equal else float("inf")
        everything = rel(list(gathered(ours).values()), list(gathered(ref).values()))
        record["steps"].append({"losses": losses, "kept_whole_shapes_equal": shapes_equal,
                                "kept_whole": whole, "gathered": everything,
                                "released": [mine_released, ref_released],
                                "edit_before": EDITS[step - 1].__name__ if step - 1 in EDITS else None})
        if step == 1:
            snapshots = {id(e): gathered(e) for e in (ours, ref)}
        if step in EDITS:
            for e in (ours, ref):
                EDITS[step](e, snapshots[id(e)])
            tell_deepspeed(ref)
    record["clamped_max"] = max(float(v.abs().max()) for v in gathered(ours).values())
    clamp(ours, {})  # after the last step: a checkpoint holds the edit as its fp32 masters
    ours.save_checkpoint(str(directory / "ckpt"), tag="t")
    if rank == 0:
        masters = get_fp32_state_dict_from_zero_checkpoint(str(directory / "ckpt"), tag="t")
        record["saved_max"] = max(float(v.abs().max()) for v in masters.values())
        record["clip_fp32"] = float(torch.tensor(CLIP))
        record["clip_bf16"] = float(torch.tensor(CLIP).bfloat16())
    if rank == 0:
        out.write_text(json.dumps(record))
    for e in (ours, ref):  # (ours: its pipeline closed; the next case's engines start afresh)
        e.destroy()


if __name__ == "__main__":
    main()
