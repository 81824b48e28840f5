"""smartinf.optim under DDP (world 2, gloo, the CPU; updates during backward with
SMARTINF_SPECULATE_ON_CPU=1, as conftest sets it): the updates start from DDP's averaged
gradients (its communication hook), are kept at step(), and the run is bit for bit the one
with overlap off, with and without ``no_sync`` gradient accumulation."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import smartinf.optim as so
import warm
from conftest import free_port

STEPS = 5
WARM = ("torch", "torch.distributed", "smartinf.optim", "test_ddp")


def _rank(rank: int, world: int, port: int, config: dict) -> None:
    os.environ.setdefault("SMARTINF_SPECULATE_ON_CPU", "1")
    if config.get("tail"):  # the step finished while the next forward runs
        os.environ["SMARTINF_STEP_TAIL_ON_CPU"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 9))
    if config.get("unused"):  # a param no forward uses: DDP reduces zeros for it
        model.append(torch.nn.Linear(9, 9))
        model.forward = lambda x: model[2](model[1](model[0](x)))
    ddp = DDP(model, bucket_cap_mb=0.002,  # (several buckets: sub-groups spanning two)
              find_unused_parameters=bool(config.get("unused")))
    if config.get("step_first"):  # DDP's first iteration before the optimizer is made (as
        # the first step lays the states out after it on a GPU): its buckets rebuilt
        ddp(torch.randn(8, 24, generator=torch.Generator().manual_seed(7))).pow(2).mean().backward()
        for p in model.parameters():
            p.grad = None
    opt = so.AdamW(ddp.parameters(), lr=1e-2, devices=[config["dir"]], subgroup_size=300,
                   chunk=128, overlap=config["overlap"], max_grad_norm=config.get("clip"))
    record = {"params": []}
    if config.get("step_first"):  # a step before the optimizer saw a forward, as where the first
        for p in model.parameters():  # step lays the states out (a GPU budget of "auto")
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for step in range(STEPS):
        for micro in range(config.get("accumulate", 1)):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(8, 24, generator=g)
            last = micro == config.get("accumulate", 1) - 1
            with (ddp.no_sync() if not last else torch.enable_grad()):
                ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        record["params"].append([p.detach().clone() for p in model.parameters()])
    counts = opt._speculation and opt._speculation.counts
    record["deferred"] = opt._tail and opt._tail.deferred
    record["counts"] = counts and {"started": counts.started, "kept": counts.kept,
                                   "retracted": counts.retracted, "reasons": dict(counts.reasons)}
    opt.close()
    if rank == 0:
        torch.save(record, config["out"])
    dist.destroy_process_group()


def train(tmp_path, name: str, **config) -> dict:
    config = dict(config, dir=str(tmp_path / name), out=str(tmp_path / f"{name}.pt"))
    warm.spawn("ddp", WARM, _rank, (2, free_port(), config), 2)
    return torch.load(config["out"])


@pytest.mark.parametrize("accumulate", [1, 3], ids=["plain", "no_sync"])
def test_updates_start_from_ddps_averaged_gradients_and_are_kept(tmp_path, accumulate):
    on = train(tmp_path, "on", overlap=True, accumulate=accumulate)
    off = train(tmp_path, "off", overlap=False, accumulate=accumulate)
    assert_same(on, off)
    counts = on["counts"]
    # from the second step on (the first has no scale to assume), every sub-group's update
    # started during backward, from the averaged gradients, and held
    assert counts["retracted"] == 0, counts
    assert counts["kept"] == counts["started"] >= (STEPS - 1) * 2, counts


def test_ddp_is_found_at_the_first_forward_after_a_step(tmp_path):
    """DDP's first iteration, then the optimizer made and a step before its hook that finds
    DDP saw a forward (as where the first step lays the states out on a GPU): DDP is still
    found at the next forward, its communication hook registered after its first iteration,
    and updates start from its averaged gradients and hold."""
    on = train(tmp_path, "on", overlap=True, step_first=True)
    off = train(tmp_path, "off", overlap=False, step_first=True)
    assert_same(on, off)
    assert on["counts"]["retracted"] == 0 and on["counts"]["kept"] >= (STEPS - 1) * 2, on["counts"]


def test_a_param_no_forward_uses_is_stepped_as_without_overlap(tmp_path):
    """find_unused_parameters: DDP reduces zeros for the unused param and leaves its .grad
    None; the update of its sub-group is redone at step() (a zero gradient, as everywhere a
    sub-group's param lacks one), the same bits as with overlap off."""
    on = train(tmp_path, "on", overlap=True, unused=True)
    off = train(tmp_path, "off", overlap=False, unused=True)
    assert_same(on, off)
    assert on["counts"]["kept"] > 0, on["counts"]


@pytest.mark.parametrize("accumulate", [1, 3], ids=["plain", "no_sync"])
def test_a_step_finished_during_the_next_forward_changes_no_bit(tmp_path, accumulate):
    """SMARTINF_STEP_TAIL_ON_CPU=1, clipping acting: each step's params (read right after it,
    each waiting for its own sub-group) bit for bit those of overlap off."""
    on = train(tmp_path, "on", overlap=True, accumulate=accumulate, clip=0.05, tail=True)
    off = train(tmp_path, "off", overlap=False, accumulate=accumulate, clip=0.05)
    assert_same(on, off)
    assert on["deferred"] == STEPS * 5 and off["deferred"] is None  # (1369 params, 300 a sub-group)


def assert_same(on: dict, off: dict) -> None:
    for step, (a, b) in enumerate(zip(on["params"], off["params"]), 1):
        for p, q in zip(a, b):
            assert torch.equal(p, q), f"after step {step}"
