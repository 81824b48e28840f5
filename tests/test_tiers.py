"""The memory tier (a budget of resident states per device), the commit interval and the
parallel update: the same bits as the plain pipeline, the traffic the tiers promise, and
what a failed step, a failed commit, discard, flush and close do between durable commits.
(Crash consistency under SIGKILL with tiers: test_crash.py.)"""
import errno
import os

import numpy as np
import pytest
import torch

import smartinf
import smartinf._native as native
from smartinf.pipeline.compress import Compressed
from conftest import open_with_subgroups

SIZES = [3000, 2500, 1000, 4000]
CHUNK = 1000
RULE = smartinf.AdamW(lr=1e-2, weight_decay=0.1)
FP32_BYTES = {0: 36864, 1: 32768, 2: 12288, 3: 49152}  # each sub-group's states, one copy


def open_pipe(dirs, **kwargs):
    return open_with_subgroups(dirs, RULE, SIZES, CHUNK, **kwargs)


def grads(step, compressed=False):
    rng = np.random.default_rng(1000 + step)
    out = []
    for n in SIZES:
        g = rng.standard_normal(n).astype(np.float32)
        if compressed:  # 10 % top-k pairs, fp16 values
            index = np.sort(rng.choice(n, n // 10, replace=False)).astype(np.int32)
            g = Compressed(torch.from_numpy(index), torch.from_numpy(g[index]).half(), n)
        out.append(g)
    return out


def run_step(pipe, step, compressed=False):
    outs = [np.empty(n, np.float16) for n in SIZES]
    with pipe.step():
        for i, g in enumerate(grads(step, compressed)):
            pipe.update(i, g, outs[i])
    return outs


def states(pipe):
    return [np.concatenate(list(pipe.read_states(i).values())) for i in range(len(SIZES))]


def assert_same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"sub-group {i} differs"


def train(dirs, steps, compressed=False, **kwargs):
    """Params out and states after each step."""
    with open_pipe(dirs, **kwargs) as pipe:
        return [(run_step(pipe, s, compressed), states(pipe)) for s in range(steps)]


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("compressed", [False, True])
def test_tiers_and_threads_give_the_plain_pipelines_bits(tmp_path, state_dtype, compressed):
    """Every resident fraction, commit interval, thread count and device count: the params
    sent out and the states after every step equal the plain pipeline's, bit for bit."""
    plain = train(str(tmp_path / "plain"), 6, compressed, state_dtype=state_dtype, compute_threads=1)
    for name, devices, kwargs in [
            ("all", 1, dict(memory_budget="1MiB", commit_every=1, compute_threads=4)),
            ("half", 2, dict(memory_budget=40000, commit_every=4, compute_threads=3)),
            ("none", 2, dict(memory_budget=0, commit_every=3, compute_threads=2))]:
        dirs = [str(tmp_path / f"{name}{i}") for i in range(devices)]
        got = train(dirs, 6, compressed, state_dtype=state_dtype, **kwargs)
        for step, ((outs, st), (want_outs, want_st)) in enumerate(zip(got, plain)):
            assert_same(outs, want_outs)
            assert_same(st, want_st)


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("every", [1, 3])
def test_background_commits_give_the_plain_pipelines_bits(tmp_path, state_dtype, every):
    """Durable commits written in the background (overlap) while later steps update resident
    states: in their second copy where the budget holds one (all, or only sub-group 0's),
    else after the commit lands. The params sent out at every step, the states at the end
    and after reopening equal the plain pipeline's, bit for bit; overlap=False the same."""
    steps = 7
    plain = train(str(tmp_path / "plain"), steps, state_dtype=state_dtype)
    all_states = sum(FP32_BYTES.values())
    for name, budget, overlap in [("twins", 2 * all_states, True),
                                  ("one-twin", all_states + FP32_BYTES[0], True),
                                  ("no-twin", all_states, True), ("off", 2 * all_states, False),
                                  ("reserved", all_states, True)]:
        # reserved: the device places sub-groups resident only with their twin (0 and 2)
        d = smartinf.CpuDevice(str(tmp_path / name), twins=name == "reserved")
        with open_pipe(d, memory_budget=budget, commit_every=every, state_dtype=state_dtype,
                       overlap=overlap) as pipe:
            if name == "reserved" and state_dtype == "fp32":
                assert [pipe.resident(i) for i in range(len(SIZES))] == [True, False, True, False]
            for step in range(steps):
                assert_same(run_step(pipe, step), plain[step][0])
            assert_same(states(pipe), plain[-1][1])
            stats = pipe.stats
        assert stats["background_commits"] == (steps // every if overlap else 0), name
        if name in ("twins", "off") or state_dtype == "fp32":  # int8 states leave room for more twins
            assert (stats["twin_copies"] > 0) == (name in ("twins", "one-twin", "reserved")), name
        with open_pipe(d.path, state_dtype=state_dtype) as pipe:
            assert pipe.step_count == steps
            assert_same(states(pipe), plain[-1][1])


def test_parallel_update_splits_a_chunk_over_threads_with_the_same_bits(tmp_path):
    """Chunks of 3 Mi params are cut into parts over 7 threads (int8 blocks whole)."""
    n = 3 << 20
    rng = np.random.default_rng(5)
    init = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    results = []
    for threads in (1, 7):
        for dtype in ("fp32", "int8"):
            with smartinf.Pipeline(str(tmp_path / f"{threads}{dtype}"), RULE, chunk=n,
                                   state_dtype=dtype, compute_threads=threads) as pipe:
                pipe.add_subgroup(n, init)
                out = np.empty(n, np.float32)
                for _ in range(2):
                    with pipe.step():
                        pipe.update(0, g, out)
                results.append((out.copy(), np.concatenate(list(pipe.read_states(0).values()))))
    for (a, s), (b, t) in zip(results[:2], results[2:]):
        assert np.array_equal(a, b) and np.array_equal(s, t)


def landed(pipe):
    """Waits for a durable commit written in the background (overlap) to land."""
    if pipe.commit_pending:
        pipe.flush()
    assert not pipe.commit_pending and pipe.durable_step_count == pipe.step_count


@pytest.mark.parametrize("overlap", [False, True])
def test_resident_states_are_written_never_read(disk_dir, overlap):
    """All resident, K=1: a step writes each sub-group's states once and reads none from
    storage; the kernel reads and writes them in memory. With overlap the write is in the
    background: commit() returns before it, the commit is durable when it lands."""
    with open_pipe(disk_dir, memory_budget=sum(FP32_BYTES.values()), overlap=overlap) as pipe:
        assert all(pipe.resident(i) for i in range(len(SIZES)))
        before = pipe.stats
        run_step(pipe, 0)
        assert pipe.commit_pending == overlap
        landed(pipe)
        after = pipe.stats
        moved = {k: after[k] - before[k] for k in ("storage_read", "storage_write", "memory_read",
                                                   "memory_write")}
    total = sum(FP32_BYTES.values())
    assert moved == {"storage_read": 0, "storage_write": total, "memory_read": total,
                     "memory_write": total}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_commit_interval_writes_resident_states_only_at_durable_commits(disk_dir, overlap):
    """Half resident, K=3: the resident sub-groups reach storage once per 3 steps; the
    streamed ones are read and written every step (in their working copy)."""
    budget = FP32_BYTES[0] + FP32_BYTES[1]
    streamed = FP32_BYTES[2] + FP32_BYTES[3]
    with open_pipe(disk_dir, memory_budget=budget, commit_every=3, overlap=overlap) as pipe:
        assert [pipe.resident(i) for i in range(4)] == [True, True, False, False]
        writes = []
        for step in range(6):
            before = pipe.stats["storage_write"]
            run_step(pipe, step)
            if (step + 1) % 3 == 0:
                landed(pipe)
            writes.append(pipe.stats["storage_write"] - before)
            assert pipe.durable_step_count == (step + 1) // 3 * 3
        assert writes == [streamed, streamed, streamed + budget] * 2
        assert pipe.stats["memory_read"] == 6 * budget


def test_reopen_after_close_is_at_the_last_committed_step(tmp_path):
    """close() makes the steps since the last durable commit durable."""
    d = str(tmp_path / "d")
    plain = train(str(tmp_path / "plain"), 5)
    with open_pipe(d, memory_budget=40000, commit_every=4) as pipe:
        for step in range(5):
            run_step(pipe, step)
        assert (pipe.step_count, pipe.durable_step_count) == (5, 4)
    with open_pipe(d, memory_budget=40000, commit_every=4) as pipe:
        assert (pipe.step_count, pipe.durable_step_count) == (5, 5)
        assert_same(states(pipe), plain[4][1])


def test_flush_discard_and_reads_between_durable_commits(tmp_path):
    d = str(tmp_path / "d")
    plain = train(str(tmp_path / "plain"), 4)
    with open_pipe(d, memory_budget=40000, commit_every=10) as pipe:
        run_step(pipe, 0)
        run_step(pipe, 1)
        assert_same(states(pipe), plain[1][1])  # reads give the committed step, not the durable one
        pipe.flush()
        assert pipe.durable_step_count == 2
        run_step(pipe, 2)
        out = np.empty(SIZES[0], np.float16)
        pipe.update(0, grads(3)[0], out)
        pipe.wait()
        with pytest.raises(ValueError, match="updated in the step in progress after steps not yet durable"):
            pipe.read_states(0)
        others = [np.concatenate(list(pipe.read_states(i).values())) for i in (1, 2, 3)]
        assert_same(others, plain[2][1][1:])  # the others: at step 3
        with pytest.raises(ValueError, match="step is in progress"):
            pipe.flush()
        pipe.discard()  # back to the durable commit: steps 2 and 3 forgotten
        assert (pipe.step_count, pipe.durable_step_count) == (2, 2)
        assert_same(states(pipe), plain[1][1])
        run_step(pipe, 2)
        run_step(pipe, 3)
        assert_same(states(pipe), plain[3][1])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("point", ["io.read", "io.write"])
def test_an_io_error_in_an_update_made_in_place_goes_back_to_the_durable_commit(tmp_path, point, overlap):
    """An I/O error in step 7 (durable commits every 4), whose updates write in place over
    steps 5 and 6 (not yet durable): which update is half written is not known, so the
    pipeline is back at its last durable commit (resident states reloaded), the directories
    too, and training goes on identically from there."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    plain = train(str(tmp_path / "plain"), 8)
    with open_pipe(dirs, memory_budget=36864, commit_every=4, overlap=overlap) as pipe:
        for step in range(6):
            run_step(pipe, step)
        native.arm_fault(point, "error", errno=errno.EIO)
        with pytest.raises(OSError, match="injected fault|read failed|write failed") as e:
            run_step(pipe, 6)
        native.disarm_fault()
        assert e.value.errno == errno.EIO
        assert (pipe.step_count, pipe.durable_step_count) == (4, 4)
        assert pipe.undo_step() == []
        assert_same(states(pipe), plain[3][1])
        for step in range(4, 8):
            run_step(pipe, step)
        assert_same(states(pipe), plain[7][1])
    with open_pipe(dirs, memory_budget=36864, commit_every=4) as pipe:
        assert pipe.step_count == 8
        assert_same(states(pipe), plain[7][1])


@pytest.mark.parametrize("point", ["io.read", "io.write"])
def test_an_io_error_in_the_first_step_after_a_durable_commit_undoes_it_alone(tmp_path, point):
    """The same I/O error in step 5, the first after the durable commit of step 4: every
    update read states the committed copy holds, so the step is undone alone (streamed
    sub-groups' writes forgotten, the resident one reloaded) and nothing else is lost."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    plain = train(str(tmp_path / "plain"), 6)
    with open_pipe(dirs, memory_budget=36864, commit_every=4) as pipe:
        for step in range(4):
            run_step(pipe, step)
        pipe.settle()  # (step 4's durable commit landed: the fault is step 5's)
        native.arm_fault(point, "error", errno=errno.EIO)
        with pytest.raises(OSError):
            run_step(pipe, 4)
        native.disarm_fault()
        assert (pipe.step_count, pipe.durable_step_count, pipe.undo_step()) == (4, 4, [])
        assert_same(states(pipe), plain[3][1])
        run_step(pipe, 4)
        run_step(pipe, 5)
        assert_same(states(pipe), plain[5][1])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_failing_in_the_caller_undoes_itself_alone(tmp_path, overlap):
    """An exception in the caller's code within ``with pipe.step():`` after some updates (no
    device failed): the steps before stay. In step 5 (the first after a durable commit) each
    update is undone; in step 7 those made in place over steps 5 and 6 are whole and are
    kept (undo_step() names them), the others undone: finishing step 7 for those gives the
    uninterrupted run's bits."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    plain = train(str(tmp_path / "plain"), 8)

    def failing_step(step, updated):
        with pytest.raises(RuntimeError, match="the caller's"):
            with pipe.step():
                for i in updated:
                    pipe.update(i, grads(step)[i], np.empty(SIZES[i], np.float16))
                pipe.wait()
                raise RuntimeError("the caller's own error")

    with open_pipe(dirs, memory_budget=36864, commit_every=4, overlap=overlap) as pipe:
        for step in range(4):
            run_step(pipe, step)
        pipe.settle()
        failing_step(4, [0, 2])
        assert (pipe.step_count, pipe.durable_step_count, pipe.undo_step()) == (4, 4, [])
        assert_same(states(pipe), plain[3][1])
        for step in range(4, 6):
            run_step(pipe, step)
        failing_step(6, [0, 2, 3])
        kept = pipe.undo_step()
        assert kept == [0, 2, 3]  # each updated in place over steps 5 and 6
        assert (pipe.step_count, pipe.durable_step_count) == (6, 4)
        for i, got in enumerate(states(pipe)):
            assert np.array_equal(got, plain[6 if i in kept else 5][1][i]), f"sub-group {i}"
        with pipe.step():  # step 7 for the one not kept
            pipe.update(1, grads(6)[1], np.empty(SIZES[1], np.float16))
        run_step(pipe, 7)
        assert_same(states(pipe), plain[7][1])
    with open_pipe(dirs, memory_budget=36864, commit_every=4) as pipe:
        assert pipe.step_count == 8
        assert_same(states(pipe), plain[7][1])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("point", ["store.synced", "manifest.renamed"])
def test_a_failed_durable_commit_keeps_the_steps(tmp_path, point, overlap):
    """The durable commit of step 8 fails (a sync, or one device's manifest renamed and the
    other's not): the error is raised, every device stays at step 4 on disk, and nothing is
    undone: the steps stand in memory, and the next durable commit writes them. With overlap
    the commit fails where it lands (here flush())."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    plain = train(str(tmp_path / "plain"), 9)
    with open_pipe(dirs, memory_budget=36864, commit_every=4, overlap=overlap) as pipe:
        for step in range(6):
            run_step(pipe, step)
        native.arm_fault(point, "error", errno=errno.EIO)
        with pytest.raises(OSError, match="injected fault") as e:
            for step in range(6, 8):  # the commit of step 8 is durable
                run_step(pipe, step)
            pipe.flush()
        native.disarm_fault()
        assert e.value.errno == errno.EIO
        assert (pipe.step_count, pipe.durable_step_count) == (8, 4)
        assert_same(states(pipe), plain[7][1])
        assert not any(os.path.exists(os.path.join(d, "manifest.tmp")) for d in dirs)
        run_step(pipe, 8)  # due again: durable now
        pipe.settle()
        assert (pipe.step_count, pipe.durable_step_count) == (9, 9)
        assert_same(states(pipe), plain[8][1])
    with open_pipe(dirs, memory_budget=36864, commit_every=4) as pipe:
        assert pipe.step_count == 9
        assert_same(states(pipe), plain[8][1])


def test_a_directory_reopens_with_another_budget_and_interval(tmp_path):
    """Residency is decided when the pipeline places its sub-groups, not stored: the same
    directory opens with any budget, and the states are the same."""
    d = str(tmp_path / "d")
    plain = train(str(tmp_path / "plain"), 4)
    with open_pipe(d, memory_budget=0) as pipe:
        run_step(pipe, 0)
        run_step(pipe, 1)
    with open_pipe(d, memory_budget="1 MiB", commit_every=2) as pipe:
        assert all(pipe.resident(i) for i in range(4))
        run_step(pipe, 2)
        run_step(pipe, 3)
    with open_pipe(d, memory_budget=40000) as pipe:
        assert_same(states(pipe), plain[3][1])


def test_budget_and_interval_settings_are_checked(tmp_path, monkeypatch):
    d = str(tmp_path)
    assert smartinf.PipelineSettings.resolve(memory_budget="24GiB").memory_budget == 24 << 30
    assert smartinf.PipelineSettings.resolve(memory_budget="1.5 GB").memory_budget == 1_500_000_000
    monkeypatch.setenv("SMARTINF_MEMORY_BUDGET", "2MiB")
    monkeypatch.setenv("SMARTINF_COMMIT_EVERY", "5")
    monkeypatch.setenv("SMARTINF_COMPUTE_THREADS", "3")
    s = smartinf.PipelineSettings.resolve()
    assert (s.memory_budget, s.commit_every, s.compute_threads) == (2 << 20, 5, 3)
    for kwargs, error, match in [
            (dict(memory_budget="lots"), ValueError, "memory_budget='lots': expected bytes"),
            (dict(memory_budget=-1), ValueError, "must not be negative"),
            (dict(commit_every=0), ValueError, r"commit_every=0 is outside \[1"),
            (dict(compute_threads=-2), ValueError, "compute_threads=-2 is outside"),
            (dict(memory_budget=1 << 60), ValueError, "of host memory from creation; .* is available")]:
        with pytest.raises(error, match=match):
            smartinf.Pipeline(d, RULE, **kwargs)


@pytest.mark.parametrize("waits", [True, False])
def test_a_durable_commit_due_while_the_last_is_written_waits_or_is_put_off(disk_dir, waits):
    """Every state resident, K=2, the device's storage capped to 1 MB/s so that a durable
    commit's background write (about 0.4 MB) is still going two steps later. commit_waits:
    step 4 waits for step 2's write and is durable (every K-th step, exactly); without, step 4
    is put off, and the first commit after step 2's write landed (step 5) is durable; the
    same bits either way."""
    device = smartinf.CpuDevice(disk_dir, storage_gbps=0.001)
    budget = 2 * sum(FP32_BYTES.values())
    seen = []
    with open_pipe(device, memory_budget=budget, commit_every=2, commit_waits=waits) as pipe:
        for step in range(4):
            run_step(pipe, step)
        seen.append((pipe.durable_step_count, pipe.commit_pending))
        pipe.settle()  # (step 2's write landed, or step 4's)
        run_step(pipe, 4)
        pipe.settle()
        seen.append(pipe.durable_step_count)
        final = states(pipe)
    if waits:
        assert seen == [(2, True), 4]  # (step 4's own write in the background)
    else:
        assert seen == [(0, True), 5]  # step 2's write still going: step 4 put off
    with open_pipe(disk_dir, memory_budget=budget) as again:  # (close() made step 5 durable)
        assert again.step_count == 5
        assert_same(states(again), final)
    assert_same(final, train(os.path.join(disk_dir, "plain"), 5)[-1][1])


def test_a_new_directory_of_two_copies_is_written_first_by_its_first_durable_commit(tmp_path):
    """Resident sub-groups' first states stay in memory until the first durable commit
    (GPT-2 XL: 18.7 GB were written by the first step): a run stopped before it reopens
    afresh from the model; a failure that must go back to a durable commit before it closes
    the pipeline once they were updated, and leaves them as made before (copies=1:
    test_one_copy.py)."""
    d = str(tmp_path / "d")
    all_states = sum(FP32_BYTES.values())
    plain = train(str(tmp_path / "plain"), 3)
    made = states(open_pipe(str(tmp_path / "made")))
    pipe = open_pipe(d, memory_budget=all_states, commit_every=3)
    assert pipe.stats["storage_write"] == 0
    pipe.discard()  # nothing updated: as made
    assert_same(states(pipe), made)
    for step in range(3):
        assert pipe.stats["storage_write"] == 0
        run_step(pipe, step)
    landed(pipe)
    assert pipe.durable_step_count == 3 and pipe.stats["storage_write"] == all_states
    pipe.close()
    with open_pipe(d, memory_budget=all_states, commit_every=3, if_exists="resume") as pipe:
        assert pipe.step_count == 3
        assert_same(states(pipe), plain[2][1])

    e = str(tmp_path / "e")
    child = os.fork()
    if child == 0:  # stopped after two steps, before its first durable commit
        p = open_pipe(e, memory_budget=all_states, commit_every=3)
        run_step(p, 0)
        run_step(p, 1)
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    with open_pipe(e, memory_budget=all_states, commit_every=3, if_exists="resume") as pipe:
        assert pipe.step_count == 0 and not any(pipe.resumed(i) for i in range(len(SIZES)))
        assert_same(states(pipe), made)
        run_step(pipe, 0)
        with pytest.raises(RuntimeError, match="before the first durable commit that writes them"):
            pipe.discard()
