"""smartinf.optim under DDP (world 2, gloo, the CPU; updates during backward with
SMARTINF_SPECULATE_ON_CPU=1, as conftest sets it): the updates start from DDP's averaged
gradients (its communication hook), are kept at step(), and the run is bit for bit the one
with overlap off, with and without ``no_sync`` gradient accumulation."""
import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import smartinf.optim as so
import warm
from conftest import files_digest, free_port
from smartinf.pipeline.checkpoint import manifest_fields

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


# -- reopening: the ranks' directories agreed on at open (issue 88) --------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 9))


def _reopen(rank: int, world: int, port: int, config: dict) -> None:
    """A DDP rank that opens ``config["dir"]`` (``if_exists``, durable every step) and trains
    ``steps`` steps from the step it opens at (each step's data by its number, so a resumed
    run continues the uninterrupted one); records its error, or where it opened, what its
    logger said, its params and ``state_dict()``'s step."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = _model()
    ddp = DDP(model)
    said: list = []
    heard = logging.Handler(logging.WARNING)
    heard.emit = lambda r: said.append(r.getMessage())
    logging.getLogger("smartinf").addHandler(heard)
    record = {"said": said}
    try:
        opt = so.AdamW(ddp.parameters(), lr=1e-2, devices=[config["dir"]], subgroup_size=300,
                       chunk=128, commit_every=1, if_exists=config.get("if_exists", "error"))
    except Exception as e:
        record["error"] = f"{type(e).__name__}: {e}"
    else:
        record["first"] = opt.pipeline.step_count
        for step in range(record["first"], record["first"] + config["steps"]):
            x = torch.randn(8, 24, generator=torch.Generator().manual_seed(1000 * step + rank))
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        record["params"] = [p.detach().clone() for p in model.parameters()]
        record["step"] = {float(v["step"]) for v in opt.state_dict()["state"].values()}
        opt.close()
    torch.save(record, f"{config['out']}.{rank}")
    # Gone without tearing down: DDP's reducer, freed as this returns, destroyed gloo's group
    # with the GIL held while gloo's thread freed a collective's tensors, which takes the GIL
    # (a deadlock seen once in CI; a script's exit is step/ranks.py's leave_cleanly).
    os._exit(0)


def reopen(tmp_path, name: str, directory, world: int = 2, **config) -> list:
    """Each rank's record of a ``_reopen`` launch."""
    config = dict(config, dir=str(directory), out=str(tmp_path / name))
    warm.spawn("ddp", WARM, _reopen, (world, free_port(), config), world)
    return [torch.load(f"{config['out']}.{r}") for r in range(world)]


def _rank_one_put_back(directory, behind) -> None:
    shutil.rmtree(directory / "rank00001")
    shutil.copytree(behind, directory / "rank00001")


def test_ddp_ranks_one_commit_apart_reopen_at_the_lower_step(tmp_path):
    """A crash between the ranks' commits: rank 1's directory one step behind rank 0's.
    Reopened, both ranks open at rank 1's step (rank 0 rolled back, saying so) and continue
    as the uninterrupted run, bit for bit: identical replicas, one step in state_dict()."""
    run = tmp_path / "run"
    reopen(tmp_path, "first", run, steps=3)
    shutil.copytree(run / "rank00001", tmp_path / "rank1-at-3")
    reopen(tmp_path, "fourth", run, steps=1, if_exists="resume")
    _rank_one_put_back(run, tmp_path / "rank1-at-3")
    rest = reopen(tmp_path, "rest", run, steps=2, if_exists="resume")
    whole = reopen(tmp_path, "whole", tmp_path / "whole", steps=5)
    assert [r.get("first") for r in rest] == [3, 3], [r.get("error") for r in rest]
    assert any("one commit ahead of the other ranks'" in s and "rolled back to step 3" in s
               for s in rest[0]["said"]), rest[0]["said"]
    assert [r["step"] for r in rest] == [{5.0}, {5.0}]
    for r in rest:
        for p, q in zip(r["params"], whole[0]["params"]):
            assert torch.equal(p, q)


@pytest.mark.parametrize("case", ["two_commits_apart", "rank_missing"])
def test_ddp_ranks_further_apart_or_missing_are_refused_before_anything_is_written(tmp_path, case):
    """Rank 1's directory two commits behind rank 0's, or gone: every rank raises, naming the
    ranks (and their steps), and no directory's bytes change (the lock file holds its
    holder's pid)."""
    run = tmp_path / "run"
    reopen(tmp_path, "first", run, steps=2)
    shutil.copytree(run / "rank00001", tmp_path / "rank1-at-2")
    reopen(tmp_path, "later", run, steps=2, if_exists="resume")
    if case == "two_commits_apart":
        _rank_one_put_back(run, tmp_path / "rank1-at-2")
    else:
        shutil.rmtree(run / "rank00001")
    before = files_digest(run, but=("lock",))
    out = reopen(tmp_path, "again", run, steps=1, if_exists="resume")
    errors = [r.get("error", "") for r in out]
    if case == "two_commits_apart":
        assert all("(rank 0: step 4, rank 1: step 2), more than one commit apart" in e
                   for e in errors), errors
    else:
        assert all("rank 1 found no run in its directory, and no rank's host holds one, while "
                   "rank 0 holds its own" in e and "were lost or moved" in e for e in errors), errors
    assert files_digest(run, but=("lock",)) == before


def test_a_ddp_run_reopened_at_another_world_size_is_refused(tmp_path):
    """A run made at world 3, reopened at 2, at 1 (a process alone), or at 3 with rank 2's
    directory gone (as a run made at 2 reopened at 3): refused on every rank, saying the
    world size changed, nothing written."""
    run = tmp_path / "run"
    reopen(tmp_path, "first", run, world=3, steps=1)
    before = files_digest(run, but=("lock",))
    shrunk = reopen(tmp_path, "shrunk", run, world=2, steps=1, if_exists="resume")
    assert all(f"the run in {run} was made by at least 3 ranks" in r.get("error", "") and
               "this job has 2 ranks: the world size changed" in r["error"] for r in shrunk), shrunk
    with pytest.raises(RuntimeError, match="opens it alone \\(world size 1\\)"):
        so.AdamW(_model().parameters(), devices=[str(run)], if_exists="resume")
    assert files_digest(run, but=("lock",)) == before
    shutil.rmtree(run / "rank00002")
    grown = reopen(tmp_path, "grown", run, world=3, steps=1, if_exists="resume")
    assert all("the run was made by 2 ranks and this job has 3 (the world size changed)"
               in r.get("error", "") for r in grown), grown


def _killed_before_its_first_commit(rank: int, directory: str) -> None:
    model = _model()
    opt = so.AdamW(model.parameters(), devices=[directory], commit_every=10)
    for step in range(3):
        model(torch.randn(8, 24)).pow(2).mean().backward()
        opt.step()
    os._exit(0)  # (as a kill: nothing closed)


def test_a_run_killed_before_its_first_durable_commit(tmp_path, caplog):
    """Stopped after 3 steps of commit_every=10: nothing durable. Reopened with the default
    if_exists="error", refused saying why (a framework that restored its model's later
    weights must not get fresh states silently); with "resume", it starts at step 0 and the
    planner's line says so."""
    run = tmp_path / "run"
    warm.spawn("ddp", WARM, _killed_before_its_first_commit, (str(run),), 1)
    assert manifest_fields(str(run))["step"] == "0"
    before = files_digest(run, but=("lock",))
    with pytest.raises(ValueError, match="holds a run that never committed a step: it was stopped "
                                         "before its first durable commit"):
        so.AdamW(_model().parameters(), devices=[str(run)])
    assert files_digest(run, but=("lock",)) == before
    with caplog.at_level(logging.WARNING, logger="smartinf"):
        opt = so.AdamW(_model().parameters(), devices=[str(run)], if_exists="resume")
    assert opt.pipeline.step_count == 0
    assert f"the run in {run} never committed a step: it starts at step 0" in caplog.text
    assert "resumes the run" not in caplog.text
    opt.close()
