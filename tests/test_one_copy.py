"""Directories of one copy (``copies=1``): half the disk of the two-copy directory, every
sub-group resident and written in place at durable commits. The same bits as two copies;
refusals before any byte for a sub-group that would stream and for a directory made with
the other count; a commit that fails or is killed while it writes leaves a directory the
reopen refuses, naming its step, never one read as another step's states. (Kills at random:
test_crash.py.)"""
import errno
import os

import numpy as np
import pytest

import smartinf
import smartinf._native as native
from test_tiers import FP32_BYTES, RULE, SIZES, CHUNK, assert_same, grads, run_step, states, train
from conftest import open_with_subgroups

ALL_STATES = sum(FP32_BYTES.values())


def open_one(d, **kwargs):
    kwargs.setdefault("memory_budget", 2 * ALL_STATES)
    kwargs.setdefault("commit_every", 3)
    return open_with_subgroups(d, RULE, SIZES, CHUNK, copies=1, **kwargs)


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("overlap", [True, False])
def test_one_copy_gives_the_two_copy_bits_on_half_the_disk(tmp_path, state_dtype, overlap):
    """Params out at every step, the states, and after a reopen: the plain pipeline's bits;
    states.bin is half the two-copy directory's."""
    steps = 7
    plain = train(str(tmp_path / "plain"), steps + 1, state_dtype=state_dtype)
    two = str(tmp_path / "two")
    with open_with_subgroups(two, RULE, SIZES, CHUNK, state_dtype=state_dtype,
                             memory_budget=2 * ALL_STATES, commit_every=3):
        pass
    d = str(tmp_path / "one")
    with open_one(d, state_dtype=state_dtype, overlap=overlap) as pipe:
        for step in range(steps):
            assert_same(run_step(pipe, step), plain[step][0])
        assert_same(states(pipe), plain[steps - 1][1])
        assert pipe.durable_step_count == 6
    one_bytes = os.path.getsize(os.path.join(d, "states.bin"))
    assert 2 * one_bytes == os.path.getsize(os.path.join(two, "states.bin"))
    with open_one(d, state_dtype=state_dtype) as pipe:  # close() made step 7 durable
        assert pipe.step_count == steps
        assert_same(states(pipe), plain[steps - 1][1])
        assert_same(run_step(pipe, steps), plain[steps][0])
    with open_one(d, state_dtype=state_dtype) as pipe:
        assert pipe.step_count == steps + 1
        assert_same(states(pipe), plain[steps][1])


def test_a_sub_group_that_would_stream_is_refused_before_any_byte(tmp_path):
    d = str(tmp_path / "d")
    with pytest.raises(ValueError, match="with copies=1 every sub-group must be resident"):
        smartinf.Pipeline(d, RULE, chunk=CHUNK, copies=1, memory_budget=ALL_STATES // 2,
                          subgroup_sizes=SIZES)
    assert not os.path.exists(os.path.join(d, "states.bin")) or \
        os.path.getsize(os.path.join(d, "states.bin")) == 0
    with smartinf.Pipeline(d, RULE, chunk=CHUNK, copies=1, memory_budget=FP32_BYTES[0],
                           if_exists="overwrite") as pipe:
        pipe.add_subgroup(SIZES[0])
        with pytest.raises(ValueError, match="sub-group 1 .* does not fit"):
            pipe.add_subgroup(SIZES[1])


def test_a_directory_opens_only_with_the_copies_it_was_made_with(tmp_path):
    d = str(tmp_path / "d")
    with open_one(d):
        pass
    with pytest.raises(ValueError, match="made with copies 1, not 2"):
        open_with_subgroups(d, RULE, SIZES, CHUNK, memory_budget=2 * ALL_STATES)
    with pytest.raises(ValueError, match="copies"):
        smartinf.Pipeline(str(tmp_path / "e"), RULE, copies=3)


@pytest.mark.parametrize("point", ["io.write", "store.synced", "manifest.written"])
def test_a_commit_failing_while_it_rewrites_closes_and_the_reopen_refuses(tmp_path, point):
    """Written over in place: no step to go back to. The pipeline closes with the reason;
    the directory reopens refused (it holds no step), and overwrite starts afresh."""
    d = str(tmp_path / "d")
    with open_one(d) as pipe:
        for step in range(3):
            run_step(pipe, step)
        pipe.settle()  # step 3 durable
        run_step(pipe, 3)
        # manifest.written: the first hit is the rewriting mark itself (then it is not
        # marked, and nothing is lost); the second is the commit's manifest
        native.arm_fault(point, "error", errno=errno.EIO, after=1 if point == "manifest.written" else 0)
        try:
            with pytest.raises(RuntimeError, match="states are lost, and the pipeline is closed"):
                for step in range(4, 6):
                    run_step(pipe, step)
                pipe.flush()
        finally:
            native.disarm_fault()
    with pytest.raises(ValueError, match="being rewritten in place by a durable commit after step 3"):
        open_one(d)
    with open_one(d, if_exists="overwrite") as pipe, \
            open_with_subgroups(str(tmp_path / "fresh"), RULE, SIZES, CHUNK) as fresh:
        assert pipe.step_count == 0
        assert_same(states(pipe), states(fresh))


def test_a_failed_step_between_commits_goes_back_to_the_durable_step(tmp_path):
    """Nothing was written over between durable commits: a failed step goes back to the
    durable step (resident states reloaded from the one copy), and training goes on."""
    d = str(tmp_path / "d")
    plain = train(str(tmp_path / "plain"), 6)
    with open_one(d) as pipe:
        for step in range(4):
            run_step(pipe, step)
        pipe.settle()
        pipe.discard()  # step 4 is not durable: back to 3
        assert pipe.step_count == 3
        assert_same(states(pipe), plain[2][1])
        for step in range(3, 6):
            run_step(pipe, step)
        assert_same(states(pipe), plain[5][1])


def test_discard_after_write_states_closes_the_pipeline(tmp_path):
    """write_states writes the one copy in place: a discard after it has nothing to go back
    to, and says so (the pipeline closes) rather than reload the new states as the old."""
    d = str(tmp_path / "d")
    with open_one(d) as pipe:
        run_step(pipe, 0)
        pipe.flush()
        arrays = pipe.read_states(0)
        with pipe.step():
            pipe.write_states(0, {k: v + 1 for k, v in arrays.items()}, steps=1)
        with pytest.raises(RuntimeError, match=r"going back to step 1: directories of one copy \(copies=1\) hold no step"):
            with pipe.step():
                pipe.write_states(0, arrays, steps=1)
                raise KeyError("the caller's step fails")
    with pytest.raises(ValueError, match="being rewritten in place"):
        open_one(d)


def test_a_new_directory_is_written_first_by_its_first_durable_commit(tmp_path):
    """A resident sub-group's first states stay in memory until the first durable commit
    (13 B: 51 GB not written before the first step); until then the directory holds no step:
    a reopen refuses it, and a step failing after an update before that commit closes the
    pipeline (one failing before any update undoes nothing)."""
    d = str(tmp_path / "d")
    plain = train(str(tmp_path / "plain"), 3)
    pipe = open_one(d)
    assert pipe.stats["storage_write"] == 0
    manifest = os.path.join(d, "manifest")
    assert b"\nrewriting\n" in open(manifest, "rb").read()  # a crash now: refused (test_crash)
    for step in range(3):
        run_step(pipe, step)
    pipe.settle()
    assert pipe.durable_step_count == 3 and pipe.stats["storage_write"] == ALL_STATES
    assert b"\nrewriting\n" not in open(manifest, "rb").read()
    pipe.close()
    with open_one(d) as pipe:
        assert_same(states(pipe), plain[2][1])
    with open_one(str(tmp_path / "e")) as pipe:
        with pytest.raises(KeyError):
            with pipe.step():
                raise KeyError("a step fails before any update: nothing to undo")
        with pytest.raises(RuntimeError, match="going back to step 0: directories of one copy"):
            with pipe.step():
                pipe.update(0, grads(0)[0], np.empty(SIZES[0], np.float16))
                raise KeyError("the first step fails after an update")
