"""Crash consistency under SIGKILL: a forked child trains on two device directories and is
killed at random moments, or by itself at a chosen point (a fault point armed to kill:
during a load, a write-back, after the states are synced, with the new manifest written
or renamed, between the two devices' commits). After every kill the directories are
reopened: their states must equal, bit for bit, an uninterrupted run's at the step they
report, and the next child goes on training from there, so every later check also shows
that training continued identically.

The same harness runs with the memory tier and a commit interval (``commit_every=4``, a
budget that holds half the sub-groups; fp32 and int8, one and two devices): a reopened
directory is then at a durable commit (a multiple of 4), bit for bit the uninterrupted
plain run's (no tier, every step committed), and training continues identically.

``SMARTINF_CRASH_TRIALS`` sets the number of random-time kills (70, and 50 for each tiered
configuration); six kills per fault point are added (36; 2 each with tiers, 12)."""
import os
import random
import re
import signal
import time
import traceback

import numpy as np
import pytest

import smartinf
import smartinf._native as native
from conftest import open_with_subgroups

SIZES = [3000, 2500, 1000, 4000]
CHUNK = 1000
RULE = smartinf.AdamW(lr=1e-2, weight_decay=0.1)
MAX_STEPS_PER_CHILD = 200  # children run until killed; this only bounds a runaway one
KILL_WINDOW_S = 0.3
RANDOM_KILLS = int(os.environ.get("SMARTINF_CRASH_TRIALS", "70"))
POINTS = ["io.read", "io.write", "store.synced", "manifest.written", "manifest.renamed",
          "pipeline.device_committed"]
LOG_POINTS = ["log.written", "log.sealed", "journal.synced"]  # copies="log"
KILLS_PER_POINT = 6


# (devices, state_dtype, memory_budget per device, commit_every): budgets that hold the
# states of exactly 2 of the 4 sub-groups (checked), as placement fills them in order.
TIERED = [(2, "fp32", 36864, 4), (1, "fp32", 69632, 4), (2, "int8", 24576, 4), (1, "int8", 45056, 4)]


def open_pipe(dirs, state_dtype="fp32", memory_budget=0, commit_every=1, io_schedule="mixed",
              **kwargs):
    return open_with_subgroups(dirs, RULE, SIZES, CHUNK, state_dtype=state_dtype,
                               memory_budget=memory_budget, commit_every=commit_every,
                               io_schedule=io_schedule, **kwargs)


ALL_STATES = 131072  # the fp32 states of SIZES, one copy (4 KiB-aligned chunks)


def train_step(pipe, step):
    rng = np.random.default_rng(1000 + step)
    outs = [np.empty(n, np.float16) for n in SIZES]
    grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    with pipe.step():
        if pipe.logs_gradients:  # copies="log": the step's gradients first
            for i, g in enumerate(grads):
                pipe.update(i, g, outs[i], log_only=True)
        for i, g in enumerate(grads):
            pipe.update(i, g, outs[i])


def snapshot(pipe):
    return [np.concatenate(list(pipe.read_states(i).values())) for i in range(len(SIZES))]


def snapshot_at(reference, step):
    """The uninterrupted run ``reference`` advanced to ``step`` (a reopened directory's
    step: steps only move forward, a kill loses at most those since the last durable
    commit), and its states there."""
    assert step >= reference.step_count, "a committed step was lost"
    while reference.step_count < step:
        train_step(reference, reference.step_count)
    return snapshot(reference)


def child(dirs, point, after, log, config, max_steps):
    """Runs in the forked child; never returns."""
    code = 0
    try:
        if point:
            native.arm_fault(point, "kill", after=after)
        with open_pipe(dirs, **config) as pipe:
            first = pipe.step_count
            for step in range(first, first + max_steps):
                train_step(pipe, step)
    except BaseException:
        with open(log, "a") as f:
            f.write(traceback.format_exc())
        code = 3
    os._exit(code)


def test_sigkill_anywhere_leaves_the_last_committed_step(tmp_path):
    kill_and_reopen(tmp_path, 2, {}, RANDOM_KILLS, KILLS_PER_POINT, 100, MAX_STEPS_PER_CHILD)


@pytest.mark.parametrize("devices, state_dtype, budget, every", TIERED)
def test_sigkill_with_resident_states_and_a_commit_interval(tmp_path, devices, state_dtype,
                                                            budget, every):
    config = dict(state_dtype=state_dtype, memory_budget=budget, commit_every=every)
    # Non-durable steps are fast: a child runs longer, so the kills land mid-run.
    kill_and_reopen(tmp_path, devices, config, int(os.environ.get("SMARTINF_CRASH_TRIALS", "50")),
                    2, 50, 5 * MAX_STEPS_PER_CHILD)


@pytest.mark.parametrize("config", [{}, dict(state_dtype="int8", memory_budget=24576, commit_every=4)],
                         ids=["plain", "tiered-int8"])
def test_sigkill_with_phased_io(tmp_path, config):
    """Reads and write-backs taking turns (io_schedule="phased"): the same guarantees, and
    the reopened states equal the uninterrupted mixed run's bit for bit."""
    kill_and_reopen(tmp_path, 2, dict(config, io_schedule="phased"),
                    int(os.environ.get("SMARTINF_CRASH_TRIALS", "30")), 2, 30, 5 * MAX_STEPS_PER_CHILD)


@pytest.mark.parametrize("every, budget", [(1, 2 * ALL_STATES), (3, 2 * ALL_STATES),
                                           (3, ALL_STATES + ALL_STATES // 2)])
def test_sigkill_during_background_commits(tmp_path, every, budget):
    """Every sub-group resident with room for a second copy (overlap, the default): each
    durable commit is written in the background while the next steps update the other
    copy. Kills at random, in those writes (io.write) or as a commit lands reopen at the
    last commit that landed, bit for bit. With room for the twins of half the states (what
    auto gives where the memory holds no more), sub-groups 0 and 2 are twinned and the
    updates of 1 and 3 wait for their writes: the same."""
    kill_and_reopen(tmp_path, 1, dict(memory_budget=budget, commit_every=every),
                    int(os.environ.get("SMARTINF_CRASH_TRIALS", "30")), 2, 30,
                    5 * MAX_STEPS_PER_CHILD, resident=len(SIZES))


@pytest.mark.parametrize("devices, state_dtype", [(1, "fp32"), (2, "int8")])
def test_sigkill_with_a_log(tmp_path, devices, state_dtype):
    """One copy with forward recovery (copies="log"): each step's gradients logged before
    its first update, each chunk's new version written to a free extent. Kills at random,
    in the log's writes (log.written, log.sealed), in the rewrite (io.write, journal.synced,
    after which extents the step's chunks left are written over) and in the commit reopen at
    the step before, or finish the logged step from its log: bit for bit the uninterrupted
    run's either way, and training goes on from there. Both happen. With two devices each
    seals its log before either updates, so a kill between their commits finishes the step
    on the one behind, and one between their seals forgets it on the one sealed."""
    kill_and_reopen(tmp_path, devices, dict(copies="log", state_dtype=state_dtype),
                    int(os.environ.get("SMARTINF_CRASH_TRIALS", "30")), 3, 30,
                    5 * MAX_STEPS_PER_CHILD, points=POINTS + LOG_POINTS)


def logged_step_pending(directory: str) -> bool:
    """Whether the directory's log holds a sealed step after its manifest's: a reopen finishes it."""
    from smartinf.pipeline.checkpoint import manifest_fields
    try:
        with open(os.path.join(directory, "grads.bin"), "rb") as f:
            head = f.read(32)
    except FileNotFoundError:
        return False
    if len(head) < 32 or head[:8] != b"si-log01":
        return False
    step, _, sealed = np.frombuffer(head[8:], np.uint64)
    return int(sealed) == 0x5ea1ed5ea1ed and int(step) == int(manifest_fields(directory)["step"]) + 1


@pytest.mark.parametrize("devices, budget", [(1, 2 * ALL_STATES), (2, 2 * ALL_STATES),
                                             (1, ALL_STATES + ALL_STATES // 2)])
def test_sigkill_with_one_copy(tmp_path, devices, budget):
    """Directories of one copy (copies=1), every sub-group resident, a durable commit every 3
    steps written in place: a kill between commits reopens at the last one, bit for bit; a
    kill while a commit writes (or between two devices' commits) leaves directories the
    reopen refuses, saying so, and never states read as another step's. Both happen. With
    twins for half the states (the 13 B run's case: auto's budget as large as the memory
    holds), the same."""
    kill_and_reopen(tmp_path, devices, dict(memory_budget=budget, commit_every=3, copies=1),
                    int(os.environ.get("SMARTINF_CRASH_TRIALS", "30")), 2, 30,
                    5 * MAX_STEPS_PER_CHILD, resident=len(SIZES))


def kill_and_reopen(tmp_path, devices, config, random_kills, kills_per_point, min_killed, max_steps,
                    resident=2, points=POINTS):
    trials = [(None, 0)] * random_kills + [(p, k) for p in points for k in range(kills_per_point)]
    rnd = random.Random(20261123)
    rnd.shuffle(trials)
    every = config.get("commit_every", 1)
    plain = {"state_dtype": config.get("state_dtype", "fp32")}
    # The uninterrupted run without tiers (snapshot_at).
    reference = open_pipe([str(tmp_path / f"ref-{i}") for i in range(devices)], **plain)

    dirs = [str(tmp_path / f"dev-{i}") for i in range(devices)]
    log = str(tmp_path / "child.log")
    with open_pipe(dirs, **config) as pipe:
        if config.get("memory_budget"):
            assert [pipe.resident(i) for i in range(len(SIZES))].count(True) == resident
    killed = finished = lost = step = forward = 0
    base = 0  # a finished child's close() made its last step durable: intervals count from it
    by_point: dict = {}
    for point, k in trials:
        # Countdown of hits before the kill: spread over the child's steps.
        after = rnd.randrange({"io.read": 300, "io.write": 300}.get(point, 20))
        pid = os.fork()
        if pid == 0:
            child(dirs, point, after, log, config, max_steps)
        if point is None:
            time.sleep(rnd.uniform(0, KILL_WINDOW_S))
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3), open(log).read()
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            killed += 1
            by_point[point or "random"] = by_point.get(point or "random", 0) + 1
        else:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            finished += 1
        forward += config.get("copies") == "log" and logged_step_pending(dirs[0])
        try:
            pipe = open_pipe(dirs, **config)  # reopen: the last durable step, bit for bit
        except ValueError as e:  # one copy, killed while written: refused, then start afresh
            assert config.get("copies") == 1 and os.WIFSIGNALED(status) and re.search(
                "being rewritten in place|one copy \\(copies=1\\) are at steps", str(e)), e
            lost += 1
            reference.close()
            reference = open_pipe([str(tmp_path / f"ref{lost}-{i}") for i in range(devices)], **plain)
            open_pipe(dirs, **config, if_exists="overwrite").close()
            base = 0
            continue
        with pipe:
            step = pipe.step_count
            assert (step - base) % every == 0 or not os.WIFSIGNALED(status), \
                f"step {step} is not durable (intervals of {every} from step {base})"
            if not os.WIFSIGNALED(status):
                base = step
            for i, (got, want) in enumerate(zip(snapshot(pipe), snapshot_at(reference, step))):
                assert np.array_equal(got, want), \
                    f"after a kill ({point or 'random'}, {after}): sub-group {i} differs at step {step}"
    reference.close()
    print(f"\ncrash harness: {len(trials)} trials, {killed} killed ({by_point}), {finished} "
          f"finished, {len(trials) - lost} reopened consistent, {lost} refused (one copy, "
          f"killed while written), {forward} finishing a logged step; reached step {step}")
    assert killed >= min_killed
    if config.get("copies") == 1:  # both outcomes were exercised
        assert lost >= 1 and len(trials) - lost >= 5
    elif config.get("copies") == "log":  # back to the step before, and forward
        assert forward >= 3 and killed - forward >= 3
    else:
        assert step >= len(trials)  # training made progress through the kills
