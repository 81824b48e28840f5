"""smartinf.optim over FSDP2 (``fully_shard``), on the CPU with gloo (issue 61): each rank's
shards in its own sub-groups and directories, the gradients' norm and inf/NaN agreed over
the ranks; against FSDP2 + torch's AdamW on the same batches (tests/fsdp_train.py)."""
import contextlib
import os
import random
import shutil
import signal
import time

import psutil
import pytest
import torch

import warm
from conftest import assert_close_fp32, files_digest as _tree, free_port
from smartinf.planning import space
from fsdp_train import run

STEPS = 6
KILLED_STEPS = 40
DURABLE = dict(commit_every=1)  # every step durable: a kill at any step reopens past it


# What the ranks import before their first line (tests/warm.py's zygote has them imported
# once; torch.multiprocessing.spawn's fresh interpreters paid seconds each).
WARM = ("torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "smartinf.optim",
        "fsdp_train")


def spawn(fn, args, nprocs):
    """torch.multiprocessing.spawn(fn, args, nprocs), the processes forked from a warm one
    (tests/warm.py)."""
    warm.spawn("fsdp", WARM, fn, args, nprocs)


def train(tmp_path, name, world, **config):
    config = dict(config, out=str(tmp_path / f"{name}.pt"), steps=config.get("steps", STEPS))
    config.setdefault("dir", str(tmp_path / name))
    port = free_port()
    spawn(run, (world, port, config), world)
    return torch.load(config["out"])


def assert_params_close(ours, theirs):
    for step, (a, b) in enumerate(zip(ours["params"], theirs["params"]), 1):
        for i, (p, q) in enumerate(zip(a, b)):
            assert_close_fp32(p.numpy(), q.numpy(), f"param {i} after step {step}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_trains_as_torch_adamw(tmp_path, world):
    """fp32 params sharded over 1, 2 and 4 ranks (at 4 the last Linear's 9 rows leave one
    rank an empty shard): torch's AdamW's params after every step, clipping acting (the
    norm over every rank's shards) and step 3's NaN skipped on every rank."""
    kw = dict(world=world, clip=0.05, nan_at=3)
    ours = train(tmp_path, "ours", optim="smartinf", **kw)
    theirs = train(tmp_path, "torch", optim="torch", **kw)
    assert ours["skipped"] == theirs["skipped"] == [s == 3 for s in range(STEPS)]
    assert_params_close(ours, theirs)
    assert ours["loss"][-1] < ours["loss"][0]


def test_mixed_precision_policy(tmp_path):
    """MixedPrecisionPolicy(bf16 compute, fp32 reduce) over fp32 sharded params: torch's
    AdamW fed the same gradients gives the same params (two runs of their own drift apart:
    bf16 compute turns a last-bit difference of a param into another gradient)."""
    both = train(tmp_path, "both", 2, optim="both", mixed=True)
    assert_params_close(both, {"params": both["torch_params"]})
    assert both["loss"][-1] < both["loss"][0]


@pytest.mark.parametrize("kw", [{}, dict(memory_budget="1MiB")], ids=["streamed", "resident"])
def test_updates_during_backward_change_no_bit(tmp_path, kw):
    """Updates started in the post-accumulate-grad hooks (after FSDP2's reduce-scatter):
    the same bits as overlap=False, and kept from the second step on."""
    on = train(tmp_path, "on", 2, optim="smartinf", kw=dict(kw, overlap=True))
    off = train(tmp_path, "off", 2, optim="smartinf", kw=dict(kw, overlap=False))
    for a, b in zip(on["params"], off["params"]):
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    assert on["counts"]["kept"] > 0


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_finished_during_the_next_forward_changes_no_bit(tmp_path, world):
    """The step finished in the background, each FSDP2 all-gather waiting for its own
    shards' sub-groups (SMARTINF_STEP_TAIL_ON_CPU=1): every step's loss and the last params
    bit for bit those of overlap=False, clipping acting and step 3's NaN skipped."""
    kw = dict(world=world, clip=0.05, nan_at=3, optim="smartinf")
    on = train(tmp_path, "on", tail=True, kw=dict(overlap=True), **kw)
    off = train(tmp_path, "off", kw=dict(overlap=False), **kw)
    assert on["skipped"] == off["skipped"] == [s == 3 for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(on["loss"]), torch.tensor(off["loss"]), rtol=0, atol=0,
                               equal_nan=True)  # (step 3's is NaN)
    for p, q in zip(on["params"][-1], off["params"][-1]):
        assert torch.equal(p, q)
    assert on["tail"]["deferred"] > 0 and off["tail"] is None
    # The first step's updates in plan order; after a forward has shown the order its
    # all-gathers need them in, the root group's first (its own param is the model's last)
    sent, root = on["tail"]["sent"], on["tail"]["root"]
    first = [sg for step, sg in sent if step == 0]
    assert first == sorted(first) and root[-1] == first[-1]
    for step in {step for step, _ in sent} - {0}:
        order = [sg for s, sg in sent if s == step]
        assert sorted(order[:len(root)]) == root and order != sorted(order)


@pytest.mark.parametrize("world_after", [2, 1])
def test_dcp_checkpoint_continues_the_run(tmp_path, world_after):
    """get_optimizer_state_dict + dcp.save after step 3 at world 2, dcp.load +
    set_optimizer_state_dict into fresh directories at world 2 and 1: steps 4-6 as the
    uninterrupted run's (bit for bit at world 2; at world 1 one rank takes the whole batch,
    whose gradient is summed in another order: within the fp32 tolerance)."""
    whole = train(tmp_path, "whole", 2, optim="smartinf")
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "first", 2, optim="smartinf", steps=3, save=ckpt)
    if world_after == 2:
        rest = train(tmp_path, "rest", 2, optim="smartinf", first=3, load=ckpt)
        for a, b in zip(rest["params"], whole["params"][3:]):
            for p, q in zip(a, b):
                assert torch.equal(p, q)
    else:
        rest = train(tmp_path, "rest1", 1, optim="smartinf", first=3, load=ckpt)
        assert_params_close(rest, {"params": whole["params"][3:]})


def test_ranks_one_commit_apart_reopen_at_one_step(tmp_path):
    """A crash between the ranks' commits: rank 1's directories one step behind rank 0's.
    Reopened (if_exists="resume"), rank 0 goes back to rank 1's step and both continue as
    the uninterrupted run, bit for bit."""
    whole = train(tmp_path, "whole", 2, optim="smartinf")
    directory = str(tmp_path / "run")
    train(tmp_path, "first", 2, optim="smartinf", steps=3, dir=directory)
    behind = tmp_path / "rank1-at-3"
    shutil.copytree(os.path.join(directory, "rank00001"), behind)
    train(tmp_path, "fourth", 2, optim="smartinf", first=3, steps=4, dir=directory, if_exists="resume")
    shutil.rmtree(os.path.join(directory, "rank00001"))
    shutil.copytree(behind, os.path.join(directory, "rank00001"))
    rest = train(tmp_path, "rest", 2, optim="smartinf", first=3, dir=directory, if_exists="resume")
    for a, b in zip(rest["params"], whole["params"][3:]):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_a_rank_killed_at_random_reopens_every_rank_at_one_step(tmp_path):
    """SIGKILL to one rank at a random moment of a run (the others then killed, as torchrun
    ends a job whose rank died): reopened with if_exists="resume", every rank opens at one
    durable step (ranks a commit apart go back to the earlier) and goes on as the
    uninterrupted run, bit for bit, three times over."""
    whole = train(tmp_path, "whole", 2, optim="smartinf", steps=KILLED_STEPS)
    rng = random.Random(os.getpid())
    for trial in range(3):
        directory, started = str(tmp_path / f"run{trial}"), tmp_path / f"started{trial}"
        config = dict(optim="smartinf", dir=directory, steps=KILLED_STEPS, started=str(started),
                      sleep=0.02, out=str(tmp_path / "killed.pt"), kw=DURABLE)
        port = free_port()
        if warm.fresh():  # (torch.multiprocessing's own)
            ranks = torch.multiprocessing.start_processes(run, args=(2, port, config), nprocs=2,
                                                          join=False, start_method="spawn")
            alive, pids = lambda: all(p.is_alive() for p in ranks.processes), ranks.pids  # noqa: E731
            reaped = lambda: [process.join() for process in ranks.processes]  # noqa: E731
        else:  # forked from a warm process, one's death ending no other (tests/warm.py)
            launch = warm.zygote("fsdp", WARM, dict(os.environ)).start_spawn(run, (2, port, config), 2)
            alive = lambda: not launch.done()  # noqa: E731
            pids = lambda: [p.pid for p in psutil.Process(launch.pid).children()]  # noqa: E731
            reaped = lambda: (launch.wait(120), launch.close())  # noqa: E731
        while not started.exists():
            assert alive(), "a rank died before its first step"
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.4))  # within the run's first ~20 of its 40 steps
        victim, ranks_pids = rng.randrange(2), pids()
        assert len(ranks_pids) == 2, ranks_pids
        os.kill(ranks_pids[victim], signal.SIGKILL)
        for pid in ranks_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reaped()
        assert not os.path.exists(config["out"])  # killed before the end
        rest = train(tmp_path, f"rest{trial}", 2, optim="smartinf", dir=directory,
                     steps=KILLED_STEPS, first="resume", if_exists="resume", kw=DURABLE)
        assert 0 < rest["first"] < KILLED_STEPS
        for a, b in zip(rest["params"], whole["params"][rest["first"]:], strict=True):
            for p, q in zip(a, b):
                assert torch.equal(p, q)


def test_bf16_params_split_master_int8(tmp_path):
    """bf16 sharded params (and gradients) with a split master and int8 moments: updates
    during backward change no bit, and the loss falls."""
    kw = dict(master="split", state_dtype="int8", memory_budget="1MiB")
    on = train(tmp_path, "on", 2, optim="smartinf", bf16=True, kw=dict(kw, overlap=True))
    off = train(tmp_path, "off", 2, optim="smartinf", bf16=True, kw=dict(kw, overlap=False))
    for a, b in zip(on["params"], off["params"]):
        for p, q in zip(a, b):
            assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    assert on["loss"][-1] < on["loss"][0] and on["counts"]["kept"] > 0


def test_params_replaced_after_the_optimizer_was_made(tmp_path):
    """What Accelerate's prepare() and the Trainer do with FSDP2 (the params in the groups
    replaced by sharded ones after the optimizer was built): refused at the first step,
    saying how to build it instead, not trained on states of other params."""
    import smartinf.optim as so
    model = torch.nn.Linear(4, 4)
    opt = so.AdamW(model.parameters(), devices=[str(tmp_path)])
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt.param_groups[0]["params"] = swapped
    for p in swapped:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="replaced after its states were laid out.*after Accelerator"):
        opt.step()
    opt.close()


@pytest.mark.parametrize("world", [1, 2])
def test_a_moment_reset_through_opt_state_is_torchs(tmp_path, world):
    """Both moments reset through ``opt.state`` between steps 3 and 4 (a loss spike's cure),
    updates starting during backward: torch's AdamW over the same gradients after every
    step. (An in-place op on a DTensor bumps its own version counter, not its local shard's:
    the reset was not seen, and the run went on as without it.)"""
    got = train(tmp_path, "both", world, optim="both", reset_at=3)
    for step, (a, b) in enumerate(zip(got["params"], got["torch_params"]), 1):
        for i, (p, q) in enumerate(zip(a, b)):
            assert_close_fp32(p.numpy(), q.numpy(), f"param {i} after step {step}")
    assert got["counts"]["kept"] > 0  # (updates during backward ran)


def test_a_shard_edited_on_one_rank_between_steps(tmp_path):
    """Rank 0 alone halves its shard of a weight before step 3: the edit becomes its master
    (as torch's AdamW steps the edited param), and every rank writes the edits as a step of
    its own, so the ranks' step counts stay one."""
    ours = train(tmp_path, "ours", 2, optim="smartinf", edit_at=3)
    theirs = train(tmp_path, "torch", 2, optim="torch", edit_at=3)
    assert_params_close(ours, theirs)
    assert ours["step_counts_agree"]


def test_plain_params_beside_sharded_ones_refused(tmp_path):
    spawn(_mixed_params, (str(tmp_path), free_port()), 1)


def _mixed_params(rank, directory, port):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import smartinf.optim as so
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    sharded, plain = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    fully_shard(sharded)
    with pytest.raises(ValueError, match="plain tensor beside FSDP2-sharded"):
        so.AdamW([*sharded.parameters(), *plain.parameters()], devices=[directory])
    assert not os.listdir(directory)  # refused before anything was stored
    dist.destroy_process_group()


def test_ranks_of_one_host_are_refused_the_host_memory_they_exceed_together(tmp_path):
    """Two ranks of this host (LOCAL_WORLD_SIZE 2) each given a memory budget it would be
    given alone, which together exceed what is available, are both refused before either
    holds it (each rank's own check passed them: four ranks at the 65B shape were killed
    for host memory)."""
    budget = int(space.available_memory() * 0.7)
    spawn(_budgets_together, (str(tmp_path), free_port(), budget), 2)


def _budgets_together(rank, directory, port, budget):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import smartinf.optim as so
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    layer = torch.nn.Linear(8, 8)
    fully_shard(layer)
    with pytest.raises(ValueError, match="and 2 ranks of this host open as much at once"):
        so.AdamW(layer.parameters(), devices=[f"{directory}/rank{rank}"], memory_budget=budget)
    dist.destroy_process_group()


def test_ranks_restarted_on_other_hosts_are_refused_before_anything_is_written(tmp_path):
    """Two "hosts", each rank's directory on its own host's root (its disk): restarted with
    the ranks swapped between the hosts, every rank refuses before a byte is written, naming
    what it found; restarted in place, the run resumes bit for bit."""
    hosts = [str(tmp_path / "host-a"), str(tmp_path / "host-b")]
    kw = dict(clip=0.05, optim="smartinf", kw=dict(commit_every=1))
    train(tmp_path, "first", 2, hosts=hosts, steps=3, **kw)
    before = {h: _tree(h) for h in hosts}
    with pytest.raises(RuntimeError) as e:
        train(tmp_path, "swapped", 2, hosts=hosts[::-1], if_exists="resume", first="resume", **kw)
    said = str(e.value)
    assert "rank 0 found no run in its directory (its host's" in said
    assert "holds the runs of ranks 1)" in said and "restarted on other hosts" in said
    assert "torch.distributed.checkpoint" in said
    assert {h: _tree(h) for h in hosts} == before  # nothing written, nothing made
    resumed = train(tmp_path, "again", 2, hosts=hosts, if_exists="resume", first="resume", **kw)
    straight = train(tmp_path, "straight", 2, **kw)
    assert resumed["first"] == 3
    for p, q in zip(resumed["params"][-1], straight["params"][-1]):
        assert torch.equal(p, q)
