"""One copy with forward recovery (``copies="log"``): every chunk's new version goes to a
free extent, each step's gradients are logged before its first update, and a crash at any
instant reopens at the step before or finishes the logged one. The same bits as two copies;
the disk near the states plus one step's gradients; the misuses refused; a failed step
before any extent was written over goes back, one after closes and the reopen finishes it.
(Kills at random and at every fault point: test_crash.py.)"""
import os

import numpy as np
import pytest

import smartinf
import smartinf._native as native
from conftest import open_with_subgroups
from test_tiers import CHUNK, RULE, SIZES, assert_same, grads, states, train


def open_log(d, **kwargs):
    return open_with_subgroups(d, RULE, SIZES, CHUNK, copies="log", **kwargs)


def logged_step(pipe, step, dtype=np.float32):
    """One step as a front-end runs it with a log: every gradient logged, then updated."""
    outs = [np.empty(n, np.float16) for n in SIZES]
    gs = [g.astype(dtype) for g in grads(step)]
    with pipe.step():
        for i, g in enumerate(gs):
            pipe.update(i, g, outs[i], log_only=True).wait()
        for i, g in enumerate(gs):
            pipe.update(i, g, outs[i])
    return outs


@pytest.fixture(autouse=True)
def disarm():
    yield
    native.disarm_fault()


def test_a_log_gives_the_two_copy_bits(tmp_path):
    """Params out at every step, the states after each, and after a reopen."""
    steps = 5
    plain = train(str(tmp_path / "plain"), steps + 1, overlap=False)
    d = str(tmp_path / "log")
    with open_log(d) as pipe:
        assert pipe.logs_gradients and not pipe.settings.overlap
        for step in range(steps):
            assert_same(logged_step(pipe, step), plain[step][0])
            assert_same(states(pipe), plain[step][1])
            assert pipe.durable_step_count == step + 1
    with open_log(d) as pipe:
        assert pipe.step_count == steps
        assert_same(states(pipe), plain[steps - 1][1])
        assert_same(logged_step(pipe, steps), plain[steps][0])
        assert_same(states(pipe), plain[steps][1])


def test_the_disk_is_the_states_and_one_steps_gradients(tmp_path):
    """states.bin: one copy of every chunk (each a full chunk's extent) and the spares (two
    per slot); grads.bin one step's gradients (each but the last 4 KiB-aligned) after a 1 MiB header; the
    journal emptied at each commit. Against two copies: S + G + spares."""
    two = str(tmp_path / "two")
    with open_with_subgroups(two, RULE, SIZES, CHUNK, overlap=False):
        pass
    d = str(tmp_path / "log")
    with open_log(d) as pipe:
        logged_step(pipe, 0, np.float16)
        slots = pipe.stats["slots"]
    extent = 12 * CHUNK + (-12 * CHUNK) % 4096  # fp32 master and two moments, aligned
    chunks = sum(-(-n // CHUNK) for n in SIZES)
    assert os.path.getsize(os.path.join(d, "states.bin")) == (chunks + 2 * slots) * extent
    with smartinf.Pipeline(str(tmp_path / "planned"), RULE, chunk=CHUNK, copies="log") as fresh:
        # what the disk check reserves: those extents and spares, and fp32 gradients at most
        assert fresh._native.planned_bytes(SIZES, [False] * len(SIZES)) == \
            [(chunks + 2 * fresh.stats["slots"]) * extent + 4 * sum(SIZES)]
        # or of the gradients' own dtype where the caller says it (bf16: what grads.bin takes)
        assert fresh._native.planned_bytes(SIZES, [False] * len(SIZES), 2) == \
            [(chunks + 2 * fresh.stats["slots"]) * extent + 2 * sum(SIZES)]
    assert os.path.getsize(os.path.join(d, "grads.bin")) == (1 << 20) + sum(
        -(-2 * n // 4096) * 4096 for n in SIZES[:-1]) + 2 * SIZES[-1]
    assert os.path.getsize(os.path.join(d, "journal")) == 0


def test_misuses_of_a_log_are_refused(tmp_path):
    d = str(tmp_path / "d")
    for kwargs, match in [(dict(commit_every=2), "commit_every must be 1"),
                          (dict(master="split"), "fp32 master"),
                          (dict(memory_budget="1MiB"), "no memory_budget"),
                          (dict(overlap=True), "overlap=False")]:
        with pytest.raises(ValueError, match=match):
            smartinf.Pipeline(d, RULE, chunk=CHUNK, copies="log", **kwargs)
    with pytest.raises(ValueError, match="expected 1, 2 or 'log'"):
        smartinf.Pipeline(d, RULE, copies="logs")
    outs = [np.empty(n, np.float16) for n in SIZES]
    g = grads(0)
    with open_log(d) as pipe:
        with pytest.raises(ValueError, match="has no logged gradient in this step"):
            pipe.update(0, g[0], outs[0])
        pipe.discard()
        pipe.update(0, g[0], outs[0], log_only=True)
        pipe.update(1, g[1], outs[1], log_only=True)
        with pytest.raises(ValueError, match="differs from its logged gradient"):
            pipe.update(0, g[1][:SIZES[0]].copy() if SIZES[1] >= SIZES[0] else -g[0], outs[0])
        with pytest.raises(ValueError, match="differs from its logged gradient or hyper"):
            pipe.update(0, g[0], outs[0], lr=0.5)
        pipe.update(0, g[0], outs[0]).wait()
        with pytest.raises(ValueError, match="comes after the step's first update"):
            pipe.update(2, g[2], outs[2], log_only=True)
        with pytest.raises(ValueError, match="no longer held; read them before the update"):
            pipe.read_states(0)
        with pytest.raises(ValueError, match="sub-group 1's gradient was logged in this step but "
                                             "it was not updated"):
            pipe.commit()
        pipe.update(1, g[1], outs[1]).wait()
        pipe.commit()
        assert pipe.step_count == 1
    with pytest.raises(ValueError, match="made with copies 'log', not 2"):
        open_with_subgroups(d, RULE, SIZES, CHUNK, overlap=False)
    with pytest.raises(ValueError, match="log_only is for directories made with copies='log'"):
        with open_with_subgroups(str(tmp_path / "two"), RULE, SIZES, CHUNK) as pipe:
            pipe.update(0, g[0], outs[0], log_only=True)


def test_a_failed_step_goes_back_until_an_extent_is_written_over(tmp_path, caplog):
    """A write failing early (the spares not yet used up): the step is forgotten, the log
    unsealed, and the directory holds the step before; failing once the step's chunks
    write where the step before was: closed, saying so, and the reopen finishes the step
    from its log, the bits of an uninterrupted run."""
    plain = train(str(tmp_path / "plain"), 3, overlap=False)
    d = str(tmp_path / "log")
    with open_log(d) as pipe:
        logged_step(pipe, 0)
        native.arm_fault("io.write", "error")
        with pytest.raises(OSError):
            logged_step(pipe, 1)
        assert pipe.step_count == 1
        assert_same(states(pipe), plain[0][1])
        assert_same(logged_step(pipe, 1), plain[1][0])
    chunks = sum(-(-n // CHUNK) for n in SIZES)
    with open_log(d) as pipe:
        slots = pipe.stats["slots"]
        native.arm_fault("io.write", "error", after=2 * slots + 2)  # past the spares
        with pytest.raises(RuntimeError, match="reopening the directories finishes the step"):
            logged_step(pipe, 2)
    assert chunks > 2 * slots + 2
    with open_log(d) as pipe:
        assert pipe.step_count == 3
        assert "whose gradients were logged: that step was finished" in caplog.text
        assert_same(states(pipe), plain[2][1])


def test_smartinf_optim_trains_with_a_log_as_with_two_copies(tmp_path):
    """The front-end's steps with a log (StepSession logs every gradient first): the same
    params as with two copies, clipping on, across a reopen."""
    import torch

    import smartinf.optim as so
    from test_optim import SMALL, make_model, reference_grads, set_grads
    params = {}
    for copies in (2, "log"):
        a, b = make_model(), make_model()
        d = str(tmp_path / str(copies))
        for steps in (range(4), range(4, 7)):
            opt = so.AdamW(a.parameters(), lr=1e-2, devices=[d], max_grad_norm=0.05, copies=copies,
                           overlap=False, if_exists="resume", **SMALL)
            for step in steps:
                set_grads(a, reference_grads(b, step))
                opt.step()
            opt.close()
        params[copies] = [p.detach().clone() for p in a.parameters()]
    assert all(torch.equal(x, y) for x, y in zip(params[2], params["log"]))


def test_two_devices_and_int8_states_with_small_tensors_give_the_two_copy_bits(tmp_path):
    """Several devices (two directories, and the small tensors' fp32 moments in a third):
    every device's log is sealed before any update, and the run is two copies' bit for bit."""
    small = [70, 9]
    sizes = SIZES + small

    def run(copies):
        d = tmp_path / str(copies)
        outs_all = []
        with smartinf.Pipeline([str(d / "a"), str(d / "b")], RULE, chunk=CHUNK, state_dtype="int8",
                               copies=copies, overlap=False, small_sizes=small) as pipe:
            for n in SIZES:
                pipe.add_subgroup(n)
            for n in small:
                pipe.add_subgroup(n, small=True)
            for step in range(4):
                rng = np.random.default_rng(step)
                gs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
                outs = [np.empty(n, np.float16) for n in sizes]
                with pipe.step():
                    if pipe.logs_gradients:
                        for i, g in enumerate(gs):
                            pipe.update(i, g, outs[i], log_only=True)
                    for i, g in enumerate(gs):
                        pipe.update(i, g, outs[i])
                outs_all.append(outs)
            held = [np.concatenate(list(pipe.read_states(i).values())) for i in range(len(sizes))]
        return outs_all, held

    two, log = run(2), run("log")
    for a, b in zip(two[0], log[0]):
        assert_same(a, b)
    assert_same(two[1], log[1])
    assert os.path.exists(tmp_path / "log" / "a" / "fp32-moments" / "grads.bin")


def test_states_loaded_into_a_log_directory_train_on_as_saved(tmp_path):
    """load_state_dict into a pipeline with a log (written in place, as with one copy) and
    a reopen: the run goes on bit for bit as the one it was saved from."""
    import torch

    import smartinf.optim as so
    from test_optim import SMALL, make_model, reference_grads, set_grads
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[str(tmp_path / "a")], copies="log", **SMALL)
    for step in range(3):
        set_grads(a, reference_grads(b, step))
        oa.step()
    saved = oa.state_dict()
    c = make_model()
    c.load_state_dict(a.state_dict())
    oc = so.AdamW(c.parameters(), lr=1e-2, devices=[str(tmp_path / "c")], copies="log", **SMALL)
    oc.load_state_dict(saved)
    oc.close()
    oc = so.AdamW(c.parameters(), lr=1e-2, devices=[str(tmp_path / "c")], copies="log",
                  if_exists="resume", **SMALL)
    for step in range(3, 6):
        grads = reference_grads(b, step)
        set_grads(a, grads)
        set_grads(c, grads)
        oa.step()
        oc.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    oa.close()
    oc.close()


def test_a_checkpoint_restored_over_a_log_directory_is_not_finished_from_its_log(tmp_path):
    """After a restore (save_devices / restore_devices, as the DeepSpeed checkpoint does) the
    directory's own log of a later step must not be taken for the checkpoint's next step."""
    from smartinf.pipeline.checkpoint import restore_devices, save_devices
    d, ckpt = str(tmp_path / "log"), str(tmp_path / "ckpt")
    with open_log(d) as pipe:
        logged_step(pipe, 0)
        logged_step(pipe, 1)
        saved = states(pipe)
        save_devices([d], ckpt)
        logged_step(pipe, 2)
    restore_devices(ckpt, [d])
    assert not os.path.exists(os.path.join(d, "grads.bin"))
    with open_log(d) as pipe:
        assert pipe.step_count == 2
        assert_same(states(pipe), saved)


@pytest.mark.parametrize("crash", ["after-one-commit", "before-all-sealed"])
def test_two_ranks_a_crash_leaves_apart_decide_together(tmp_path, crash):
    """Two pipelines as two ranks, each logging and sealing its step before either updates
    (as the DeepSpeed step does, with a barrier). Killed after the first committed the step
    and before the second did: one a step ahead, the other holding its sealed log, so the
    step is finished there from the log. Killed after the first sealed and before the
    second did: no update ran, so the sealed log is forgotten. Either way both reopen at
    one step, bit for bit an uninterrupted run's."""
    import signal

    from smartinf.integrations.deepspeed_states import logged_step_decision
    dirs = [str(tmp_path / f"rank{r}") for r in range(2)]
    plain = train(str(tmp_path / "plain"), 3, overlap=False)
    pid = os.fork()
    if pid == 0:
        try:
            pipes = [open_log(d) for d in dirs]
            for step in range(2):
                for pipe in pipes:
                    logged_step(pipe, step)
            outs = [np.empty(n, np.float16) for n in SIZES]
            for r, pipe in enumerate(pipes):
                for i, g in enumerate(grads(2)):
                    pipe.update(i, g, outs[i], log_only=True)
                if crash == "before-all-sealed" and r == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                pipe.seal_log()
            for i, g in enumerate(grads(2)):
                pipes[0].update(i, g, outs[i])
            pipes[0].commit()
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), status
    steps, pending = [], []
    for d in dirs:
        with smartinf.Pipeline(d, RULE, chunk=CHUNK, copies="log", defer_logged_step=True) as pipe:
            steps.append(pipe.durable_step_count)
            pending.append(pipe.logged_step_pending)
    decision = logged_step_decision(steps, pending)
    assert (steps, pending, decision) == (([3, 2], [False, True], "finish") if crash == "after-one-commit"
                                          else ([2, 2], [True, False], "drop"))
    for d in dirs:
        with smartinf.Pipeline(d, RULE, chunk=CHUNK, copies="log", defer_logged_step=True) as pipe:
            if decision == "finish" and pipe.logged_step_pending:
                pipe.finish_logged_step()
            elif decision == "drop":
                pipe.drop_logged_step()
    expected = 3 if decision == "finish" else 2
    for d in dirs:
        with open_log(d) as pipe:
            assert pipe.step_count == expected
            assert_same(states(pipe), plain[expected - 1][1])


@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "int4"])
def test_the_disk_of_each_format_is_within_5_percent_of_its_bound(tmp_path, state_dtype):
    """With a log, a directory holds one copy of the states S and one step's gradients G
    (bf16 here): S + G a param is the bound (docs/memory-tiers.md), which the chunks'
    4 KiB alignment, the spare extents (two a slot) and the log's 1 MiB header exceed by a
    few per cent at 16 Mi params in chunks of 64 Ki (less at a model's size)."""
    from smartinf.planning.model import state_bytes_per_param
    numel, chunk = 16 << 20, 1 << 16
    d = str(tmp_path / state_dtype)
    with smartinf.Pipeline(d, RULE, chunk=chunk, copies="log", state_dtype=state_dtype,
                           subgroup_sizes=[numel], gradient_bytes=2) as pipe:
        pipe.add_subgroup(numel)
        out = np.empty(numel, np.float16)
        g = np.full(numel, 1e-3, np.float32).astype(np.float16)
        with pipe.step():
            pipe.update(0, g, out, log_only=True).wait()
            pipe.update(0, g, out)
    disk = sum(os.path.getsize(os.path.join(d, f)) for f in ("states.bin", "grads.bin", "journal"))
    bound = numel * (state_bytes_per_param(state_dtype, "fp32") + 2)
    assert bound <= disk <= 1.05 * bound, disk / bound
    print(f"\n{state_dtype}: disk {disk / bound:.3f}x S + G")
