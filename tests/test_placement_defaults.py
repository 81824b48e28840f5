"""What a user writes first gets the fast placement: ``smartinf.optim`` and the DeepSpeed block
given only ``devices`` place the states as ``state_dtype="auto"`` places them (host memory,
the commit interval, copies; a GPU's budget where the params are on one GPU), in the exact
format (fp32 states, fp32 master); each option given wins alone; and the README's example
runs as written, as torch's AdamW with clipping."""
import re
from pathlib import Path

import pytest
import torch

import smartinf.optim
from smartinf.optim import options as optim_options
from smartinf.planning import plan, space

README = Path(__file__).resolve().parents[1] / "README.md"
PARAMS = 64 * 64 + 64


def box(monkeypatch, memory: int) -> None:
    """A host with ``memory`` bytes available (the planner keeps a reserve of it)."""
    monkeypatch.setattr(space, "available_memory", lambda: memory)


def rank_zero_of(monkeypatch, world: int) -> None:
    """This process as rank 0 of ``world`` to the planner, whose collectives at open (the
    ranks' agreement) find the others' contributions zeros: no rank's directory holds a run."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: None)


def made(tmp_path, name="run", **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return model, smartinf.optim.AdamW(model.parameters(), lr=1e-2,
                                       devices=[str(tmp_path / name)], **options)


def test_states_that_fit_in_host_memory_stay_there_durable_every_ten_steps(tmp_path, monkeypatch, caplog):
    box(monkeypatch, 64 << 30)
    with caplog.at_level("WARNING"):
        _, opt = made(tmp_path)
    s = opt.pipeline.settings
    assert (s.state_dtype, s.master, s.copies) == ("fp32", "fp32", 2)
    assert s.commit_every == plan.RESIDENT_COMMIT_EVERY
    assert s.memory_budget == opt.placement.memory_budget > 12 * PARAMS
    assert all(opt.pipeline.resident(i) for i in range(opt.pipeline.num_subgroups))
    assert caplog.text.count("smartinf auto:") == 1 and "fp32" in str(opt.placement.report())
    # the choice state_dtype="auto" makes on this box, where the exact format fits
    _, auto = made(tmp_path, "auto", state_dtype="auto")
    assert auto.placement.settings() == opt.placement.settings()
    opt.close()
    auto.close()


def test_states_that_fit_nowhere_else_stream_and_the_line_says_so(tmp_path, monkeypatch, caplog):
    box(monkeypatch, plan.MIN_RESERVE)  # nothing left beyond the reserve
    with caplog.at_level("WARNING"):
        _, opt = made(tmp_path)
    s = opt.pipeline.settings
    assert (s.state_dtype, s.master, s.memory_budget, s.commit_every) == ("fp32", "fp32", 0, 1)
    assert not any(opt.pipeline.resident(i) for i in range(opt.pipeline.num_subgroups))
    assert "0% of the states resident, the rest streamed" in caplog.text
    opt.close()


@pytest.mark.parametrize("given, kept", [
    (dict(state_dtype="fp32"), dict(commit_every=plan.RESIDENT_COMMIT_EVERY)),  # drags nothing back
    (dict(commit_every=1), dict(commit_every=1)),  # today's durable step, resident all the same
    (dict(memory_budget=0), dict(memory_budget=0, commit_every=1)),  # streamed, as asked
    (dict(memory_budget=0, commit_every=4), dict(memory_budget=0, commit_every=4)),
    (dict(copies=1), dict(copies=1, commit_every=plan.RESIDENT_COMMIT_EVERY)),
    (dict(state_dtype="int8"), dict(state_dtype="int8", master="fp32")),
])
def test_each_option_given_wins_alone(tmp_path, monkeypatch, given, kept):
    box(monkeypatch, 64 << 30)
    _, opt = made(tmp_path, **given)
    s = opt.pipeline.settings
    for key, value in kept.items():
        assert getattr(s, key) == value, key
    if "memory_budget" not in given:
        assert s.memory_budget > 0
    opt.close()


def test_the_environments_settings_are_given_ones(tmp_path, monkeypatch):
    box(monkeypatch, 64 << 30)
    monkeypatch.setenv("SMARTINF_COMMIT_EVERY", "1")
    monkeypatch.setenv("SMARTINF_MEMORY_BUDGET", "0")
    _, opt = made(tmp_path)
    assert (opt.pipeline.settings.memory_budget, opt.pipeline.settings.commit_every) == (0, 1)
    opt.close()


class _OnGpu:
    """A param's stand-in for ``default_gpu_budget``: on ``cuda:index``."""

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)


@pytest.mark.parametrize("given, on, devices, expected", [
    (None, [0, 0], None, "auto"),  # the params on one GPU: its memory first
    (None, [0, 1], None, None),  # on two: none (a budget is one GPU's)
    (None, [0, None], None, None),  # some on the host
    (0, [0], None, None),  # none, as asked
    ("8GiB", [0], None, "8GiB"),
    (None, [0], "xrt", None),  # a device of the caller's with budgets of its own
])
def test_a_gpus_budget_where_the_params_are_on_one_gpu(tmp_path, monkeypatch, given, on, devices, expected):
    params = [_OnGpu(i) if i is not None else torch.zeros(1) for i in on]
    monkeypatch.setattr(optim_options, "local", lambda p: p)
    spec = [smartinf.XrtDevice(str(tmp_path))] if devices == "xrt" else [str(tmp_path)]
    assert optim_options.default_gpu_budget(given, params, spec) == expected


def test_the_deepspeed_blocks_defaults(monkeypatch):
    from smartinf.integrations.deepspeed_config import Settings
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        s = Settings.from_config({"smartinf": {"devices": ["/d"]}})
        assert s.planned == () and s.pipeline.state_dtype == "fp32"
        assert s.gpu_memory_budget == ("auto" if cuda else 0)
        assert s.gpu_host_states == ("auto" if cuda else False)
    given = Settings.from_config({"smartinf": {"devices": ["/d"], "state_dtype": "auto",
                                               "commit_every": 1, "gpu": {"memory_budget": 0}}})
    assert given.planned == ("auto", "commit_every") and given.gpu_memory_budget == 0


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## In a torch training loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_example_runs_as_written_and_trains_as_torch(tmp_path, monkeypatch):
    """The README's torch example, as written but for its directories and a model of ours,
    is torch's AdamW with clip_grad_norm_ (fp32 to torch's tolerances), in the placement the
    planner chose (states in host memory here, durable every 10 steps)."""
    code = readme_example()
    assert 'devices=["/nvme0/run1", "/nvme1/run1"]' in code
    code = code.replace("/nvme0/run1", str(tmp_path / "nvme0")).replace("/nvme1/run1", str(tmp_path / "nvme1"))
    code = code.replace('"opt.pt"', repr(str(tmp_path / "opt.pt")))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

        def forward(self, batch):
            out = self.net(batch)
            return type("Output", (), {"loss": (out - batch.flip(-1)).square().mean() * 50})()

    torch.manual_seed(1)
    data = [torch.randn(8, 32) for _ in range(12)]
    model, ref = Model(), Model()
    names = {"model": model, "data": data, "torch": torch}
    exec(compile(code, "README.md", "exec"), names)
    opt = names["opt"]
    assert opt.placement is not None and opt.pipeline.settings.commit_every == plan.RESIDENT_COMMIT_EVERY
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-4, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=10_000)
    for batch in data:
        ref(batch).loss.backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0) > 1.0  # clipping acts
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    saved = torch.load(tmp_path / "opt.pt")
    torch.testing.assert_close(saved["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])
    opt.close()


def test_an_interval_chosen_is_one_no_step_waits_for(tmp_path, monkeypatch):
    """The planner's commit interval puts a durable commit off while the last is still being
    written (commit_waits=False: no step waits for the disk); one given is kept exactly."""
    box(monkeypatch, 64 << 30)
    _, chosen = made(tmp_path, "chosen")
    _, given = made(tmp_path, "given", commit_every=10)
    _, asked = made(tmp_path, "asked", commit_waits=True)
    assert chosen.pipeline.settings.commit_waits is False
    assert given.pipeline.settings.commit_waits is True
    assert asked.pipeline.settings.commit_waits is True
    for opt in (chosen, given, asked):
        opt.close()
    from smartinf.integrations.deepspeed_config import Settings
    assert "commit_waits" in Settings.from_config(
        {"smartinf": {"devices": ["/d"], "commit_waits": True}}).planned


def test_ddps_ranks_of_one_host_share_its_memory(tmp_path, monkeypatch):
    """Under DDP each rank keeps a whole copy of the states: the host's ranks (its launcher's
    LOCAL_WORLD_SIZE) each plan a share of its memory, not all of it each."""
    box(monkeypatch, plan.MIN_RESERVE + (40 << 20))  # 40 MB for states beyond the reserve
    _, alone = made(tmp_path, "alone")
    rank_zero_of(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _, shared = made(tmp_path, "shared")
    assert alone.pipeline.settings.memory_budget == 2 * alone.placement.weighed[0]["whole"]
    assert shared.pipeline.settings.memory_budget == (40 << 20) // 4  # a quarter each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # (two hosts of two ranks)
    assert optim_options.host_ranks(optim_options.Sharding([])) == 2
    alone.close()
    shared.close()


def test_ranks_keep_the_chosen_interval_exactly(tmp_path, monkeypatch):
    """Ranks would put a commit off each by its own disk, and reopen at durable steps more than
    a commit apart: with a world of several, the interval chosen is kept exactly."""
    box(monkeypatch, 64 << 30)
    rank_zero_of(monkeypatch, 2)
    _, opt = made(tmp_path)
    assert opt.pipeline.settings.commit_every == plan.RESIDENT_COMMIT_EVERY
    assert opt.pipeline.settings.commit_waits is True
    opt.close()
