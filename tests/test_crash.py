"""Crash consistency under SIGKILL: a forked child trains on two device directories and is
killed at random moments, or by itself at a chosen point (a fault point armed to kill:
during a load, a write-back, after the states are synced, with the new manifest written
or renamed, between the two devices' commits). After every kill the directories are
reopened: their states must equal, bit for bit, an uninterrupted run's at the step they
report, and the next child goes on training from there, so every later check also shows
that training continued identically.

``SMARTINF_CRASH_TRIALS`` sets the number of random-time kills (70); six kills per fault
point are added (36)."""
import os
import random
import signal
import time
import traceback

import numpy as np

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
KILLS_PER_POINT = 6


def open_pipe(dirs):
    return open_with_subgroups(dirs, RULE, SIZES, CHUNK)


def train_step(pipe, step):
    rng = np.random.default_rng(1000 + step)
    outs = [np.empty(n, np.float16) for n in SIZES]
    with pipe.step():
        for i, n in enumerate(SIZES):
            pipe.update(i, rng.standard_normal(n).astype(np.float32), outs[i])


def snapshot(pipe):
    return [np.concatenate(list(pipe.read_states(i).values())) for i in range(len(SIZES))]


def child(dirs, point, after, log):
    """Runs in the forked child; never returns."""
    code = 0
    try:
        if point:
            native.arm_fault(point, "kill", after=after)
        with open_pipe(dirs) as pipe:
            first = pipe.step_count
            for step in range(first, first + MAX_STEPS_PER_CHILD):
                train_step(pipe, step)
    except BaseException:
        with open(log, "a") as f:
            f.write(traceback.format_exc())
        code = 3
    os._exit(code)


def test_sigkill_anywhere_leaves_the_last_committed_step(tmp_path):
    trials = [(None, 0)] * RANDOM_KILLS + [(p, k) for p in POINTS for k in range(KILLS_PER_POINT)]
    rnd = random.Random(20261123)
    rnd.shuffle(trials)
    # The uninterrupted run, advanced to each step a reopened directory reports (steps
    # only move forward: a kill loses at most the step in flight).
    reference = open_pipe([str(tmp_path / "ref-a"), str(tmp_path / "ref-b")])

    def reference_at(step):
        assert step >= reference.step_count, "a committed step was lost"
        while reference.step_count < step:
            train_step(reference, reference.step_count)
        return snapshot(reference)

    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    log = str(tmp_path / "child.log")
    with open_pipe(dirs):
        pass
    killed = finished = 0
    by_point: dict = {}
    for point, k in trials:
        # Countdown of hits before the kill: spread over the child's steps.
        after = rnd.randrange({"io.read": 300, "io.write": 300}.get(point, 20))
        pid = os.fork()
        if pid == 0:
            child(dirs, point, after, log)
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
        with open_pipe(dirs) as pipe:  # reopen: the last committed step, bit for bit
            step = pipe.step_count
            for i, (got, want) in enumerate(zip(snapshot(pipe), reference_at(step))):
                assert np.array_equal(got, want), \
                    f"after a kill ({point or 'random'}, {after}): sub-group {i} differs at step {step}"
    reference.close()
    print(f"\ncrash harness: {len(trials)} trials, {killed} killed ({by_point}), "
          f"{finished} finished, all {len(trials)} reopened consistent; reached step {step}")
    assert killed >= 100
    assert step >= len(trials)  # training made progress through the kills
