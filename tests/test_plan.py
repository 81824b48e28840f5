"""state_dtype="auto" (smartinf.planning.plan): what it picks without a probe record, that explicit
settings win, that split masters need bf16 params, the refusal when no format fits the
disk, and smartinf.optim resolving "auto" into the settings its pipeline runs with."""
import errno
import math
import os
import shutil

import pytest
import torch

import smartinf.optim
from smartinf.planning import plan
from smartinf.planning.model import state_bytes_per_param


def test_all_resident_picks_the_most_precise_format(tmp_path):
    c = plan.choose(1_000_000, [str(tmp_path)], memory=1 << 30, figures={})
    assert (c.state_dtype, c.master) == ("fp32", "fp32")
    assert c.commit_every == plan.RESIDENT_COMMIT_EVERY and c.step_s is None
    states = 1_000_000 * state_bytes_per_param("fp32", "fp32")
    whole = math.ceil(states * (1 + plan.BUDGET_SLACK)) + (16 << 20)
    assert c.memory_budget == c.ram_bytes == 2 * whole  # with room for the twins
    assert "room for every sub-group's twin" in c.why
    tight = plan.choose(1_000_000, [str(tmp_path)], memory=whole + 1, figures={})
    assert tight.memory_budget == whole + 1 and "no room for twins" in tight.why
    # what the memory holds beyond the states twins as many sub-groups as it holds
    half = plan.choose(1_000_000, [str(tmp_path)], memory=whole + whole // 2, figures={})
    assert half.memory_budget == whole + whole // 2
    assert "room for twins of 50% of the states: the updates of the other sub-groups wait" in half.why
    assert c.disk_bytes[str(tmp_path)] == pytest.approx(2 * states, rel=1e-6)  # both copies
    assert "no probe record" in c.why


def test_too_little_memory_picks_the_fewest_bytes(tmp_path):
    c = plan.choose(10_000_000, [str(tmp_path)], memory=8_000_000, figures={})
    assert (c.state_dtype, c.master) == ("int4", "split")
    assert c.memory_budget == 8_000_000
    assert "resident" in c.why
    fp32_params = plan.choose(10_000_000, [str(tmp_path)], memory=8_000_000, figures={},
                              bf16_params=False)
    assert fp32_params.master == "fp32" and fp32_params.state_dtype == "int4"


def test_explicit_settings_win(tmp_path):
    c = plan.choose(10_000_000, [str(tmp_path)], memory=8_000_000, figures={}, master="fp32",
                    memory_budget=1 << 20, commit_every=3)
    assert c.master == "fp32" and c.memory_budget == 1 << 20 and c.commit_every == 3
    assert all(r["master"] == "fp32" for r in c.weighed)


def test_refuses_when_no_format_fits_the_disk(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    params = int(free / state_bytes_per_param("int4", "split"))  # two copies: twice the free space
    with pytest.raises(OSError) as e:
        plan.choose(params, [str(tmp_path / "new" / "dir")], memory=0, figures={})
    assert e.value.errno == errno.ENOSPC
    assert "int4/split: needs" in str(e.value) and "free" in str(e.value)
    assert not (tmp_path / "new").exists()  # nothing made


def test_optim_runs_with_what_auto_picked(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with caplog.at_level("WARNING"):
        opt = smartinf.optim.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path)],
                                   state_dtype="auto", commit_every=2)
    assert "smartinf auto:" in caplog.text
    assert opt.pipeline.settings.state_dtype == "fp32" and opt.pipeline.settings.commit_every == 2
    ref = torch.nn.Linear(64, 64)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(torch.ones(4, 64)).square().sum().backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    opt.close()


def test_a_budget_that_holds_every_state_counts_as_all_resident(tmp_path):
    """Whatever the bytes per param (int8 + split's are not whole), states that fit the
    memory are all resident: the most precise such format wins, not the one whose bytes
    happen to round."""
    for params in (1_000_003, 33_333_331, 77_777_777):
        c = plan.choose(params, [str(tmp_path)], memory=1 << 50, figures={},
                        master="split")
        assert (c.state_dtype, c.master) == ("fp32", "split")
        assert all(r["resident"] == 1.0 for r in c.weighed)


def test_refuses_no_params_or_no_directory(tmp_path):
    for params, dirs in ((0, [str(tmp_path)]), (-5, [str(tmp_path)]), (10, [])):
        with pytest.raises(ValueError, match="positive param count and at least one directory"):
            plan.choose(params, dirs, memory=1 << 30, figures={})


def test_optim_auto_weighs_only_the_params_it_keeps_states_for(tmp_path, monkeypatch):
    """Frozen params (requires_grad=False) get no sub-group and no states: auto does not
    count them, nor their dtype."""
    asked = []
    choose = plan.choose
    monkeypatch.setattr(plan, "choose", lambda params, *a, **k: asked.append((params, k)) or choose(params, *a, **k))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 64))
    model[1].requires_grad_(False)
    opt = smartinf.optim.AdamW(model.parameters(), devices=[str(tmp_path)], state_dtype="auto")
    assert asked == [(64 * 64 + 64, asked[0][1])]
    assert asked[0][1]["bf16_params"] is True  # the trained params are bf16: a split master may be weighed
    opt.close()


def test_one_copy_where_the_disk_holds_one_and_memory_every_state(tmp_path, monkeypatch):
    """Two copies of int4 + split states do not fit the disk, one does, and host memory holds
    them all: copies=1, and the report says what a crash during a commit then costs. Where
    memory does not hold every state, or two copies are asked for, nothing fits."""
    params = 100_000_000
    one = params * state_bytes_per_param("int4", "split")
    free = int(1.5 * one)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=free))
    c = plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={})
    # the most precise whose one copy fits: int8 + split (fp32's would not)
    assert (c.state_dtype, c.master, c.copies) == ("int8", "split", 1)
    assert c.settings()["copies"] == 1 and sum(c.disk_bytes.values()) <= free
    assert "copies=1: the disk holds one copy" in c.why and "loses them" in c.why
    assert "copies=1" in c.report()
    with pytest.raises(OSError, match="one copy would need every state resident"):
        plan.choose(params, [str(tmp_path)], memory=0, figures={})
    with pytest.raises(OSError, match="int4/split: needs"):
        plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={}, copies=2)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=1 << 50))
    assert plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={}).copies == 2


def test_two_copies_of_a_compact_format_win_over_one_of_a_precise_one(tmp_path, monkeypatch):
    """Where some format's two copies fit, auto keeps two copies (every instant recoverable)
    rather than take one copy of a more precise format: fp32 + split would fit once here."""
    params = 100_000_000
    free = int(1.05 * params * state_bytes_per_param("fp32", "split")) + (1 << 20)
    assert 2 * params * state_bytes_per_param("int8", "split") < free
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=free))
    c = plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={})
    assert (c.state_dtype, c.master, c.copies) == ("int8", "split", 2)
    # each more precise format with the reason it was left (not "the states do not fit in
    # host memory": they all do)
    assert "fp32/fp32: refused for the disk (two copies: needs" in c.why
    assert "fp32/split: only one copy fits the disk (two needs" in c.why
    assert "more precise formats ruled out" in c.why and "int8/fp32" not in c.why


def test_a_resumed_run_keeps_its_format_and_its_disk(tmp_path, monkeypatch):
    """Re-running a script with auto and if_exists="resume": the directory's format (fixed
    for it) is taken, and the bytes its states file holds count as free, so a run that
    filled its disk resumes rather than be refused. Overwritten: a free choice."""
    d = str(tmp_path / "d")
    params = 3 << 20
    with smartinf.Pipeline(d, smartinf.AdamW(), chunk=1 << 20, state_dtype="int8", master="split",
                           memory_budget=1 << 30, copies=1) as pipe:
        pipe.add_subgroup(params)
    held = os.stat(os.path.join(d, "states.bin")).st_blocks * 512
    assert held > 0
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=held // 10))
    c = plan.choose(params, [d], memory=1 << 40, figures={}, if_exists="resume")
    assert (c.state_dtype, c.master, c.copies) == ("int8", "split", 1)
    assert c.why.startswith(f"resumes the run in {d} in its format")
    with smartinf.Pipeline(d, smartinf.AdamW(), chunk=1 << 20, **{k: v for k, v in c.settings().items()
                                                                  if k != "commit_every"}) as pipe:
        pipe.add_subgroup(params)
        assert pipe.resumed(0)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=1 << 50))
    fresh = plan.choose(params, [d], memory=1 << 40, figures={}, if_exists="overwrite")
    assert (fresh.state_dtype, fresh.master, fresh.copies) == ("fp32", "fp32", 2)


def test_the_bytes_a_run_holds_count_its_devices_sub_directories(tmp_path):
    """What an overwritten or resumed run takes back: every states file and log under the
    directory, its devices' own sub-directories included (the small tensors' here; the
    GPU's gpu/ and gpu-host/ alike; a 13 B run rerun was refused for the disk without)."""
    d = str(tmp_path / "d")
    with smartinf.Pipeline(d, smartinf.AdamW(), chunk=1 << 20, state_dtype="int8",
                           small_sizes=[1000]) as pipe:
        pipe.add_subgroup(1000, small=True)
        pipe.add_subgroup(3 << 20)
    files = [os.path.join(d, "states.bin"), os.path.join(d, "fp32-moments", "states.bin")]
    assert all(os.path.getsize(f) > 0 for f in files)
    assert plan._held_run([d])["held"] == {d: sum(os.stat(f).st_blocks * 512 for f in files)}


def test_the_runs_host_buffers_leave_less_memory_for_states(tmp_path, monkeypatch):
    """Where host memory is read, not given: the bytes the run holds besides the states
    (DeepSpeed's pinned partition copies with overlap on a GPU) come off it first, so a
    budget with twins that would have fit beside nothing is not planned beside them."""
    params = 50_000_000
    states = params * state_bytes_per_param("int8", "split")
    whole = math.ceil(states * (1 + plan.BUDGET_SLACK)) + (16 << 20)
    available = int((2 * whole + (64 << 20)) / (1 - plan.RESERVE_SHARE)) + plan.MIN_RESERVE
    monkeypatch.setattr(plan.space, "available_memory", lambda: available)
    roomy = plan.choose(params, [str(tmp_path)], figures={}, master="split")
    buffers = 4 * params  # bf16 gradients in and params out
    tight = plan.choose(params, [str(tmp_path)], figures={}, master="split", host_buffers=buffers)
    assert roomy.memory_budget > tight.memory_budget
    assert tight.ram_bytes + buffers <= roomy.ram_bytes + buffers <= available
    assert tight.ram_bytes <= (available - max(plan.MIN_RESERVE, int(available * plan.RESERVE_SHARE))) - buffers


def test_the_gpus_share_needs_no_host_memory(tmp_path, monkeypatch):
    """States a GPU budget holds take no host memory and their sub-groups no host buffers:
    the RAM budget is what is left of the states (the GPU's budget taken as GPU_FILL_SLACK
    short, whole sub-groups), and a model too large for RAM alone fits beside the GPU."""
    params = 100_000_000
    per = state_bytes_per_param("int4", "split")
    states = params * per
    gpu = int(states * 0.6)
    in_ram = states - int(gpu * (1 - plan.GPU_FILL_SLACK))
    whole = math.ceil(in_ram * (1 + plan.BUDGET_SLACK)) + (16 << 20)
    c = plan.choose(params, [str(tmp_path)], memory=whole, figures={}, master="split",
                    gpu_budget=gpu)
    assert (c.state_dtype, c.memory_budget) == ("int4", whole) and "streamed" not in c.why
    alone = plan.choose(params, [str(tmp_path)], memory=whole, figures={}, master="split")
    assert "streamed" in alone.why  # without the GPU the same memory holds a part only
    # host buffers (memory read, not given): only the host's share of the params has them
    buffers = 4 * params
    full = math.ceil(states * (1 + plan.BUDGET_SLACK)) + (16 << 20)
    usable = full + buffers // 2  # after the reserve
    available = usable + plan.MIN_RESERVE
    assert available * plan.RESERVE_SHARE < plan.MIN_RESERVE  # (the reserve is the minimum)
    monkeypatch.setattr(plan.space, "available_memory", lambda: available)

    def int4(gpu_budget):
        c = plan.choose(params, [str(tmp_path)], figures={}, master="split", gpu_budget=gpu_budget,
                        host_buffers=buffers)
        return next(r for r in c.weighed if r["state_dtype"] == "int4")
    assert int4(0)["resident"] < 1.0  # the buffers of every sub-group leave too little
    assert int4(gpu)["resident"] == 1.0  # the GPU's sub-groups have none


def test_the_report_names_the_gpus_share(tmp_path):
    """The line auto says names the states the GPU's budget holds beside the host's share (a
    GPU user shown "host memory 33.6 MB" alone took the states for streamed), or, where the
    budget is measured by the first step, says so; a run without a GPU budget names none."""
    params = 100_000_000
    states = params * state_bytes_per_param("fp32", "fp32")
    on_gpu = plan.choose(params, [str(tmp_path)], figures={}, gpu_budget=2 * int(states))
    assert on_gpu.gpu_bytes == int(states) and on_gpu.ram_bytes < states / 10
    assert f"GPU memory {plan.space._size(states)}, disk" in on_gpu.report()
    later = plan.choose(params, [str(tmp_path)], figures={}, gpu_budget_later=True)
    assert later.gpu_bytes == 0 and "GPU memory: what the first step leaves" in later.report()
    host = plan.choose(params, [str(tmp_path)], figures={})
    assert host.gpu_bytes == 0 and "GPU memory" not in host.report()


def test_a_log_where_no_format_keeps_two_copies(tmp_path, monkeypatch):
    """An fp32 master asked for, a disk that holds no format's two copies: auto takes
    copies="log" (every instant recoverable, streamed, overlap off) before one copy of
    states all resident (a crash during a commit loses them), says so and what a larger
    disk would give. Settings a log cannot run with leave it out."""
    params = 100_000_000
    per = state_bytes_per_param("int4", "fp32")
    log = plan._disk_need(params, per, [str(tmp_path)], "log")[str(tmp_path)]
    assert log == math.ceil(params * (per + 2) + plan.LOG_SPARE_CHUNKS * (1 << 20) * per
                            + plan.LOG_HEADER)
    free = log + (1 << 20)
    assert free < 2 * params * per  # int4 + fp32, the smallest with an fp32 master
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=free))
    c = plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={}, master="fp32")
    assert (c.state_dtype, c.master, c.copies) == ("int4", "fp32", "log")
    assert c.settings() == {"state_dtype": "int4", "master": "fp32", "memory_budget": 0,
                            "commit_every": 1, "copies": "log", "overlap": False}
    assert c.disk_bytes == {str(tmp_path): log}
    assert "copies='log': the disk holds one copy of these states and a step's gradients" in c.why
    assert "one copy of int8/fp32 all resident would fit too" in c.why  # 6 B a param
    assert f"a disk with {plan.space._size(2 * params * 12)} free would give two copies of fp32/fp32" in c.why
    # a GPU budget (now or sized later), a memory budget, commits every k > 1, overlap: one copy
    for given in ({"gpu_budget": 1 << 20}, {"gpu_budget_later": True}, {"memory_budget": 1 << 30},
                  {"commit_every": 10}, {"overlap": True}):
        one = plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={}, master="fp32", **given)
        assert one.copies == 1, given
    # bf16 params without a master asked for: int4 + split's two copies are smaller than any log
    assert plan.choose(params, [str(tmp_path)], memory=1 << 40, figures={}).copies == 2


def test_copies_log_asked_with_auto(tmp_path, monkeypatch):
    """copies="log" given: only fp32 masters are weighed, streamed, every step; with a
    setting a log cannot run with it is refused, saying which."""
    c = plan.choose(10_000_000, [str(tmp_path)], memory=1 << 40, figures={}, copies="log")
    assert c.copies == "log" and c.master == "fp32" and c.memory_budget == 0
    assert all(r["copies"] == "log" and r["master"] == "fp32" for r in c.weighed)
    assert "not two copies" not in c.why and "a disk with" not in c.why  # two would fit: asked for
    with pytest.raises(ValueError, match="memory_budget .* given"):
        plan.choose(10_000_000, [str(tmp_path)], figures={}, copies="log", memory_budget=1 << 30)
    with pytest.raises(ValueError, match="copies='each'"):
        plan.choose(10_000_000, [str(tmp_path)], figures={}, copies="each")


def test_a_resumed_log_directory_keeps_its_log(tmp_path):
    d = str(tmp_path / "d")
    with smartinf.Pipeline(d, smartinf.AdamW(), chunk=1 << 20, state_dtype="int8", copies="log") as pipe:
        pipe.add_subgroup(3 << 20)
    c = plan.choose(3 << 20, [d], memory=1 << 40, figures={}, if_exists="resume")
    assert (c.state_dtype, c.master, c.copies) == ("int8", "fp32", "log")


def test_optim_auto_trains_a_log_as_two_copies_do(tmp_path, monkeypatch):
    """smartinf.optim with state_dtype="auto" on a disk that holds a log of its states and
    no two copies: it runs with the log (overlap off) and trains bit for bit as the same
    format with two copies."""
    monkeypatch.setenv("SMARTINF_CHUNK", str(1 << 16))  # (spares of small chunks: a small disk)
    torch.manual_seed(0)
    weights = torch.randn(2048, 2048).to(torch.bfloat16)
    params = weights.numel()
    per = state_bytes_per_param("int4", "fp32")
    # (4 MiB beside the planner's estimate: the commits' files the disk check counts, a
    # manifest and a log header in the run's and the small tensors' directories)
    free = plan._disk_need(params, per, ["d"], "log")["d"] + (4 << 20)
    assert free < 2 * params * per
    usage = shutil.disk_usage(tmp_path)

    def train(directory, **storage):
        model = torch.nn.Linear(2048, 2048, bias=False).to(torch.bfloat16)
        model.weight.data.copy_(weights)
        opt = smartinf.optim.AdamW(model.parameters(), lr=1e-2, devices=[str(directory)],
                                   master="fp32", **storage)
        for step in range(3):
            opt.zero_grad()
            model(torch.ones(4, 2048, dtype=torch.bfloat16) * (step + 1)).float().square().mean().backward()
            opt.step()
        settings = opt.pipeline.settings
        opt.close()
        return model.weight.detach().clone(), settings

    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=free))
    logged, settings = train(tmp_path / "auto", state_dtype="auto")
    assert (settings.state_dtype, settings.copies, settings.overlap) == ("int4", "log", False)
    assert (tmp_path / "auto" / "grads.bin").exists()
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=1 << 50))
    two, _ = train(tmp_path / "two", state_dtype="int4", memory_budget=0, commit_every=1,
                   overlap=False)
    assert torch.equal(logged, two)


def test_a_65b_model_on_four_gpus_with_its_params_in_host_memory(tmp_path, monkeypatch):
    """Issue 62's box: the Llama-1 65B shape over 4 ranks (a quarter of 64.7 B params each),
    its bf16 params already in the 503 GiB of host memory (offload_param: 131 GB, not
    available any more), 235 GiB of free disk, no GPU budget weighed yet. Beside the states
    alone int4 + split fits, every state resident and one copy on the disk (what auto weighs
    with the states in host memory the GPUs update: the overlap keeps no host copies of
    those sub-groups' partitions); with host copies of the partitions (gradients in, params
    out: 4 B a param, as where the host's cores update them) nothing fits, and the
    refusal, before anything is made, names the host memory and the buffers."""
    params = int(64.7e9) // 4
    available = (503 << 30) - int(64.7e9) * 2
    monkeypatch.setattr(plan.space, "available_memory", lambda: available)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage._replace(free=235 << 30))
    directory = str(tmp_path / "states")
    c = plan.choose(params, [directory], figures={}, ranks=4, gpu_budget_later=True)
    assert (c.state_dtype, c.master, c.copies) == ("int4", "split", 1)
    assert c.ram_bytes >= params * state_bytes_per_param("int4", "split")
    assert 4 * c.disk_bytes[directory] <= 235 << 30
    with pytest.raises(OSError) as e:
        plan.choose(params, [directory], figures={}, ranks=4, gpu_budget_later=True,
                    host_buffers=4 * params)
    assert e.value.errno == errno.ENOSPC
    assert "int4/split: needs" in str(e.value) and "more host memory" in str(e.value)
    assert f"less up to {plan.space._size(4 * params)} of the run's host buffers" in str(e.value)
    assert not (tmp_path / "states").exists()
