"""DeepSpeed's ``tests/unit/v1/zero/test_offload_states.py`` (its ZeRO-3 cases) through the
``"smartinf"`` block, for tests/deepspeed_api.py (one launch, every rank alike).

As DeepSpeed's ``run_model_zero3``: a model built partitioned (``zero.Init``), bf16, Adam over
two param groups (weight decay on all but the biases); after each step the states are taken,
``offload_states(include=[state])`` (each ``OffloadStateTypeEnum`` alone, then all), their
devices checked (``get_state_devices``: host memory; the reduce buckets gone),
``reload_states()``, and the hp params, lp params, gradient partitions and Adam states read
again: equal. The cases run on one engine, a step between them, next to a second engine
trained on the same batches without offloading: after every case the two hold the same
params and states, bit for bit (training goes on as without the round trip). With
``pin_memory`` and ``non_blocking`` off and on (DeepSpeed's CPU accelerator runs both the
same way; the GPU's own check is tests/test_deepspeed.py's GPU test)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import deepspeed
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.offload_states import get_state_devices
from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

import smartinf.integrations.deepspeed as smartinf_ds

CASES = [(state, flag) for state in [*OffloadStateTypeEnum, None] for flag in (False, True)]


def config(directory: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
            "smartinf": {"devices": [directory]}}


def build(make_model: Callable, directory: str) -> object:
    """DeepSpeed's test's engine: partitioned as made, two param groups."""
    c = config(directory)
    torch.manual_seed(0)  # (the same weights each time: zero.Init draws them from torch's RNG)
    with deepspeed.zero.Init(config_dict_or_path=c):
        model = make_model()
    groups = [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]
    return smartinf_ds.initialize(model=model, model_parameters=groups, config=c)[0]


def snapshot(eng: object) -> list:
    """What DeepSpeed's test compares across the round trip, in its order."""
    params = list(eng.module.parameters())
    return [*(safe_get_local_fp32_param(p).clone() for p in params),
            *(p.ds_tensor.clone() for p in params),
            eng.optimizer.grad_partitions_flat_buffer.clone(),
            *(safe_get_local_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")
              for p in params)]


def same_states(eng: object, other: object) -> bool:
    """Whether two engines hold the same partitions and stored states, bit for bit, read a
    sub-group at a time (``snapshot``'s accessors read a param's whole sub-group for each
    param: at GPT-2 XL's 580 params, hundreds of reads of up to 12 GB)."""
    a, b = eng.optimizer.pipeline, other.optimizer.pipeline
    if a.num_subgroups != b.num_subgroups:
        return False
    for i in range(a.num_subgroups):
        x, y = a.read_states(i), b.read_states(i)
        if x.keys() != y.keys() or not all((x[k] == y[k]).all() for k in x):
            return False
    return all(torch.equal(p.ds_tensor, q.ds_tensor)
               for p, q in zip(eng.module.parameters(), other.module.parameters()))


def devices(eng: object, include: list | None) -> dict:
    return {s.name: sorted(str(d) for d in get_state_devices(eng, s))
            for s in OffloadStateTypeEnum if include is None or s in include}


def offload_round_trips(make_model: Callable, root: Path, batches: Callable, train: Callable) -> dict:
    """Every case: devices while offloaded and after, the states equal across the round
    trip, and equal to the engine trained without it; the parked pipeline's refusal."""
    eng, same = build(make_model, str(root / "offload")), build(make_model, str(root / "same"))
    data, twin = batches(), batches()
    out: dict = {"cases": [], "losses": [[], []]}
    for state, flag in CASES:
        out["losses"][0] += train(eng, data, 1)
        out["losses"][1] += train(same, twin, 1)
        before = snapshot(eng)
        include = None if state is None else [state]
        eng.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=flag,
                           non_blocking=flag)
        case = {"state": None if state is None else state.name, "flag": flag,
                "offloaded": devices(eng, include), "parked": eng.optimizer.pipeline.parked}
        if case["parked"] and "refused" not in out:  # the states are not reachable meanwhile
            try:
                eng.optimizer.pipeline.read_states(0)
                out["refused"] = None
            except ValueError as e:
                out["refused"] = str(e)
        eng.reload_states()
        after = snapshot(eng)
        case["restored"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        case["reloaded"] = devices(eng, include)
        case["as_without"] = all(torch.equal(a, b) for a, b in zip(after, snapshot(same)))
        case["unparked"] = not eng.optimizer.pipeline.parked
        out["cases"].append(case)
    out["losses"][0] += train(eng, data, 1)  # and after the last round trip
    out["losses"][1] += train(same, twin, 1)
    out["then_as_without"] = all(torch.equal(a, b) for a, b in zip(snapshot(eng), snapshot(same)))
    for e in (eng, same):
        e.destroy()
    return out


def gpu_round_trip(out: Path, shape: str = "small") -> None:
    """On a GPU, world 1: the states in the GPU's memory (a budget that holds them all),
    two steps, offload_states(): the GPU memory in use (the device's, the pipeline's
    allocations being CUDA's, not torch's) falls by at least the states' bytes, and stays
    so through a 'generation' phase; reload_states(), two more steps: params and states
    equal an engine's that never offloaded (python tests/deepspeed_offload.py OUT.json
    under torchrun; tests/test_deepspeed.py's GPU test). ``shape`` "xl": GPT-2 XL's (48 layers
    of 1600, 1.5 B params, fp32 states: 17.7 GB; the issue's acceptance, bench/measured)."""
    import json
    import sys
    import time
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.gpt.data import Language, batches
    from examples.gpt.model import GPT, GPTConfig

    deepspeed.init_distributed()
    lang = Language()
    root = out.parent / "offload-gpu"

    def make(name: str) -> object:
        c = config(str(root / name))
        budget = "20GiB" if shape == "xl" else "2GiB"
        c["smartinf"].update(gpu={"memory_budget": budget, "host_states": False}, memory_budget=0)
        dims = (1600, 48, 25) if shape == "xl" else (512, 8, 8)
        model = GPT(GPTConfig(lang.vocab_size, 64, *dims), seed=5)
        return smartinf_ds.initialize(model=model, model_parameters=model.parameters(), config=c)[0]

    def step(eng: object, data: object) -> float:
        x, y = (t.to(eng.device) for t in next(data))
        logits = eng(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), y.reshape(-1))
        eng.backward(loss)
        eng.step()
        return loss.item()

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    eng, same = make("offload"), make("same")
    data, twin = batches(lang, 4, 64, seed=9), batches(lang, 4, 64, seed=9)
    losses = [[step(eng, data) for _ in range(2)], [step(same, twin) for _ in range(2)]]
    pipe = eng.optimizer.pipeline
    resident = [i for i in range(pipe.num_subgroups) if pipe.resident(i)]
    states = sum(pipe.numel(i) for i in resident) * 4 * (1 + len(pipe.optimizer.state_names))
    before = used()
    clock = time.perf_counter()
    eng.offload_states()
    offloaded, offload_s = used(), time.perf_counter() - clock
    phase = torch.empty(states // 2, dtype=torch.float16, device="cuda")  # 'generation' fills it
    during = used()
    del phase
    clock = time.perf_counter()
    eng.reload_states()
    after, reload_s = used(), time.perf_counter() - clock
    losses[0] += [step(eng, data) for _ in range(2)]
    losses[1] += [step(same, twin) for _ in range(2)]
    equal = same_states(eng, same)
    result = {"subgroups": pipe.num_subgroups, "resident": len(resident), "states": states,
              "freed": eng.optimizer.offloaded_bytes, "before": before, "offloaded": offloaded,
              "during": during, "after": after,
              "offload_s": offload_s, "reload_s": reload_s, "losses": losses, "equal": equal}
    out.write_text(json.dumps(result, indent=1))
    for e in (eng, same):
        e.destroy()


if __name__ == "__main__":
    import sys
    gpu_round_trip(Path(sys.argv[1]), *sys.argv[2:3])
