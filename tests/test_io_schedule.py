"""The I/O schedule of a device's ring (reads and write-backs in flight together, or taking
turns) and its choice from the probe's mix curve: the schedule changes the order of the
requests, never a bit of the results."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import smartinf
from smartinf.planning import io_schedule, probe_cli
from smartinf.step.rounding import to_bf16

SIZES = [5000, 3000, 7000, 1000]
CHUNK = 1024  # several chunks per sub-group: both directions have turns within a step


def train(dirs, schedule, steps=5, **settings):
    """bf16 params and every stored state after ``steps`` steps from seeded inputs."""
    return train_with(dirs, schedule, lambda pipe: None, steps, **settings)


def train_with(dirs, schedule, look, steps=5, **settings):
    """``train``, with ``look(pipe)`` after the steps."""
    rng = np.random.default_rng(7)
    with smartinf.Pipeline(dirs, smartinf.AdamW(lr=1e-2, weight_decay=0.1), chunk=CHUNK,
                           slots=3, io_schedule=schedule, **settings) as pipe:
        assert [c.schedule for c in pipe.io_schedules] == [schedule] * len(dirs)
        params = []
        for n in SIZES:
            init = to_bf16(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
            pipe.add_subgroup(n, init.float())
            params.append(init.clone())
        for _ in range(steps):
            with pipe.step():
                futures = [pipe.update(sg, torch.from_numpy(rng.standard_normal(n).astype(np.float32))
                                       .to(torch.bfloat16), params[sg]) for sg, n in enumerate(SIZES)]
                for f in futures:
                    f.wait()
        split = settings.get("master") == "split"
        assert (pipe.stats["io_turns"] > 0) == (schedule == "phased")  # turns were taken
        look(pipe)
        states = [pipe.read_states(sg, **({"params": params[sg]} if split else {}))
                  for sg in range(len(SIZES))]
    return params, states


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("settings", [
    {}, dict(state_dtype="int8"), dict(state_dtype="int4"), dict(master="split"),
    dict(state_dtype="int8", master="split", memory_budget=40_000, commit_every=2),
    dict(memory_budget=100_000, commit_every=3),  # some sub-groups resident, some streamed
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "fp32")
def test_phased_and_mixed_io_give_the_same_bits(tmp_path, devices, settings):
    def dirs(name):
        return [str(tmp_path / name / str(i)) for i in range(devices)]
    (pm, sm), (pp, sp) = train(dirs("mixed"), "mixed", **settings), train(dirs("phased"), "phased", **settings)
    for a, b in zip(pm, pp):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(sm, sp):
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)), k


def test_auto_follows_the_probe_record_of_each_directory(tmp_path, caplog):
    """auto: mixed without a record; with one, phased only where a burst beats the mix by
    more than the margin; an explicit schedule wins; a broken record is named."""
    plain, fast_bursts, slow_bursts = (str(tmp_path / n) for n in ("plain", "fast", "slow"))
    for d in (plain, fast_bursts, slow_bursts):
        os.makedirs(d)
    storage = {"read_bps": 2e9, "write_bps": 2e9, "mixed_bps": 1.2e9}
    io_schedule.record(fast_bursts, dict(storage, phased_bps=[[64 << 20, 1.2e9], [256 << 20, 1.6e9]]))
    io_schedule.record(slow_bursts, dict(storage, phased_bps=[[64 << 20, 1.22e9]]))
    with smartinf.Pipeline([plain, fast_bursts, slow_bursts]) as pipe:
        assert [c.schedule for c in pipe.io_schedules[1:]] == ["phased", "mixed"]
        if io_schedule.find_record(str(tmp_path)) is None:  # none above tmp_path on this machine
            assert pipe.io_schedules[0].schedule == "mixed"
            assert "no probe record" in pipe.io_schedules[0].reason
        assert "phased 1.60 GB/s in 256 MiB turns, mixed 1.20 GB/s" in pipe.io_schedules[1].reason
        assert pipe.io_schedules[1].burst == 256 << 20  # the best burst, not the first
    explicit = str(tmp_path / "explicit")
    os.makedirs(explicit)
    io_schedule.record(explicit, dict(storage, phased_bps=[[64 << 20, 1.6e9]]))
    with smartinf.Pipeline(explicit, io_schedule="mixed") as pipe:
        assert pipe.io_schedules[0] == io_schedule.Choice("mixed", "as requested")
    with open(os.path.join(plain, io_schedule.RECORD), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="is not a probe record"):
        smartinf.Pipeline(plain)
    for bad in ([[-1, 1.6e9]], [["64 MiB", 1.6e9]], [64]):  # valid JSON, not a mix curve
        io_schedule.record(plain, dict(storage, phased_bps=bad))
        with pytest.raises(ValueError, match="is not a probe record"):
            smartinf.Pipeline(plain)


def test_ranks_directories_use_the_record_of_the_directory_the_probe_measured(tmp_path):
    """smartinf.optim and DeepSpeed put each rank in DIR/rank<R>: the record in DIR serves
    them; a record nearer the device directory wins."""
    storage = {"read_bps": 2e9, "write_bps": 2e9, "mixed_bps": 1.0e9}
    io_schedule.record(str(tmp_path), dict(storage, phased_bps=[[64 << 20, 1.5e9]]))
    ranks = [str(tmp_path / f"rank{r:05d}") for r in range(2)]
    os.makedirs(ranks[1])
    io_schedule.record(ranks[1], dict(storage, phased_bps=[[64 << 20, 1.0e9]]))
    with smartinf.Pipeline(ranks[0]) as pipe:
        assert pipe.io_schedules[0] == io_schedule.Choice(
            "phased", "the probe measured phased 1.50 GB/s in 64 MiB turns, mixed 1.00 GB/s",
            1.5e9, 64 << 20)
    with smartinf.Pipeline(ranks[1]) as pipe:
        assert pipe.io_schedules[0].schedule == "mixed"


def test_unset_slots_hold_a_turn_of_the_probes_burst_where_the_schedule_is_phased(tmp_path):
    """A phased turn also ends when the free slots run out: unset, the ring gets enough
    slots for the probe's best burst (plus the usual 4, at most 64); mixed keeps 4 and
    explicit slots are kept. Memory is still fixed when the pipeline is made."""
    storage = {"read_bps": 2e9, "write_bps": 2e9, "mixed_bps": 1.0e9}
    io_schedule.record(str(tmp_path), dict(storage, phased_bps=[[64 << 20, 1.5e9]]))
    chunk = 1 << 16  # 768 KiB of fp32 Adam states a chunk: a 64 MiB turn is 86 of them
    cases = [(dict(), 64), (dict(state_dtype="int8"), 64), (dict(chunk=1 << 20), 4 + 6),
             (dict(io_schedule="mixed"), 4), (dict(slots=3), 3),
             (dict(chunk=1 << 20, io_schedule="phased"), 4 + 22)]  # as requested: 256 MiB turns
    for i, (kw, slots) in enumerate(cases):
        kw = dict(dict(chunk=chunk), **kw)
        with smartinf.Pipeline(str(tmp_path / f"d{i}"), smartinf.AdamW(), **kw) as pipe:
            assert pipe.stats["slots"] == slots, kw
            sg = pipe.add_subgroup(100)
            with pipe.step():
                pipe.update(sg, np.ones(100, np.float32), np.empty(100, np.float32)).wait()


def test_the_setting_and_its_environment_default_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="io_schedule='sometimes'"):
        smartinf.Pipeline(str(tmp_path), io_schedule="sometimes")
    monkeypatch.setenv("SMARTINF_IO_SCHEDULE", "phased")
    with smartinf.Pipeline(str(tmp_path / "env")) as pipe:
        assert pipe.io_schedules[0].schedule == "phased"
    monkeypatch.setenv("SMARTINF_IO_SCHEDULE", "turns")
    with pytest.raises(ValueError, match="SMARTINF_IO_SCHEDULE='turns'"):
        smartinf.Pipeline(str(tmp_path / "bad"))


def test_the_probe_records_its_mix_curve_where_auto_reads_it(capsys, disk_dir):
    """--record: the curve and what the ring drew under each schedule (8 MiB: no bursts,
    so the ring's phased turns are its default), the choice from the ring's figures, and
    nothing left behind but the record."""
    assert probe_cli.main([disk_dir, "--size-mib", "8", "--record"]) == 0
    recorded = json.loads(open(os.path.join(disk_dir, io_schedule.RECORD)).read())
    assert recorded["directory"] == disk_dir and recorded["mixed_bps"] > 0
    assert recorded["phased_bps"] == []
    # bytes over seconds: positive, finite, below 1 TB/s from one directory
    assert all(0 < recorded[k] < 1e12 for k in ("ring_mixed_bps", "ring_phased_bps"))
    choice = io_schedule.from_figures(recorded)
    assert choice.reason.startswith("the ring drew phased")
    assert choice.bps == recorded[f"ring_{choice.schedule}_bps"] and choice.burst == 0
    assert f"io_schedule='auto' runs {choice.schedule} there ({choice.reason})" in capsys.readouterr().err
    assert os.listdir(disk_dir) == [io_schedule.RECORD]


def test_auto_follows_what_the_ring_drew_where_the_record_has_it(tmp_path):
    """The ring's figures outrank the probe's curve, both ways; phased keeps the curve's
    best burst; figures out of range name the record."""
    curve = {"read_bps": 2e9, "write_bps": 2e9, "mixed_bps": 1.87e9,
             "phased_bps": [[64 << 20, 1.9e9], [256 << 20, 2.08e9]]}  # the H100's, lease C
    cases = [(dict(ring_mixed_bps=1.9e9, ring_phased_bps=1.7e9), "mixed", 1.9e9, 0),
             (dict(ring_mixed_bps=1.2e9, ring_phased_bps=1.5e9), "phased", 1.5e9, 256 << 20),
             (dict(ring_mixed_bps=1.5e9, ring_phased_bps=1.55e9), "mixed", 1.5e9, 0)]  # < MARGIN
    for i, (ring, schedule, bps, burst) in enumerate(cases):
        d = str(tmp_path / str(i))
        os.makedirs(d)
        io_schedule.record(d, dict(curve, **ring))
        with smartinf.Pipeline(d) as pipe:
            choice = pipe.io_schedules[0]
        assert (choice.schedule, choice.bps, choice.burst) == (schedule, bps, burst), ring
        assert choice.reason.startswith("the ring drew phased") and "in 256 MiB turns" in choice.reason
    for bad in (-1.0, float("nan")):
        io_schedule.record(str(tmp_path / "0"), dict(curve, ring_mixed_bps=bad, ring_phased_bps=1e9))
        with pytest.raises(ValueError, match="is not a probe record.*ring's figures are out of range"):
            smartinf.Pipeline(str(tmp_path / "0"))


def host_turns_lock(directory: str) -> str:
    """The drive's turns lock every phased ring on ``directory``'s file system takes
    (pipeline/host_turns.cc names it so)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(base, f"smartinf-io-turns-{os.stat(directory).st_dev:x}.lock")


def test_a_phased_ring_waits_for_the_drives_turn_held_elsewhere(tmp_path, monkeypatch):
    """Another process's phased ring on the same drive (here, the lock it takes, held by
    this test) holds the drive's turn: the ring's reads wait for it, go on once it is given
    back, and the bits are those of a run alone; a mixed ring takes no turns, nor a phased
    one with SMARTINF_IO_TURNS=process (each process's turns alone), while the lock is
    held; another value is refused, naming it."""
    import fcntl
    import threading
    alone = train([str(tmp_path / "alone")], "phased", steps=2)
    d = tmp_path / "held"
    d.mkdir()
    with open(host_turns_lock(str(d)), "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        timer = threading.Timer(0.5, fcntl.flock, (holder, fcntl.LOCK_UN))
        timer.start()
        waited = {}

        def stats_of(pipe):
            waited.update(pipe.stats)
        params, states = train_with([str(d)], "phased", stats_of, steps=2)
        timer.join()
        assert waited["io_turn_waits"] >= 1
        assert all(torch.equal(a, b) for a, b in zip(params, alone[0]))
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(states, alone[1]) for k in a)
        monkeypatch.setenv("SMARTINF_IO_TURNS", "process")
        fcntl.flock(holder, fcntl.LOCK_EX)
        for schedule in ("mixed", "phased"):
            train_with([str(tmp_path / schedule)], schedule, stats_of, steps=1)  # (never waits)
            assert waited["io_turn_waits"] == 0
    monkeypatch.setenv("SMARTINF_IO_TURNS", "rank")
    with pytest.raises(ValueError, match="SMARTINF_IO_TURNS=rank: expected host or process"):
        train([str(tmp_path / "refused")], "phased", steps=1)


def test_ranks_of_one_drive_take_turns_and_a_killed_holder_frees_it(tmp_path):
    """Two processes' phased rings on one drive (two ranks of a host), started together:
    both finish (whether their turns met is up to the scheduler: the test above makes
    them meet) with the bits of a run alone. A process killed while it holds the drive's
    turn holds no one up: the kernel gives the turn back."""
    import multiprocessing
    import signal
    import time
    ctx = multiprocessing.get_context("fork")
    results, together = ctx.Queue(), ctx.Barrier(2)

    def rank(i):
        together.wait()
        params, _ = train([str(tmp_path / f"rank{i}")], "phased", steps=4)
        results.put((i, [p.view(torch.int16).numpy() for p in params]))
    procs = [ctx.Process(target=rank, args=(i,)) for i in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    alone, _ = train([str(tmp_path / "alone")], "phased", steps=4)
    for params in got.values():
        assert all(np.array_equal(a, b.view(torch.int16).numpy()) for a, b in zip(params, alone))

    import fcntl
    (tmp_path / "after").mkdir()
    ready = ctx.Event()

    def holder():
        with open(host_turns_lock(str(tmp_path / "after")), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            ready.set()
            time.sleep(600)
    child = ctx.Process(target=holder)
    child.start()
    assert ready.wait(30)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    train([str(tmp_path / "after")], "phased", steps=1)  # (would wait forever were it held)


def test_the_missing_records_reason_names_a_command_that_records_one(tmp_path):
    """The reason names the probe's command line as users run it: it named
    ``python -m smartinf.planning.probe``, a module without one, which ran nothing."""
    if io_schedule.find_record(str(tmp_path)) is not None:
        pytest.skip("a probe record above tmp_path on this machine")
    reason = io_schedule.choose("auto", str(tmp_path)).reason
    command = re.search(r"python -m (\S+) (\S+) --record", reason)
    assert command and command.group(2) == str(tmp_path), reason
    help = subprocess.run([sys.executable, "-m", command.group(1), "--help"],
                          capture_output=True, text=True, check=True).stdout
    assert "--record" in help
