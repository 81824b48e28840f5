"""The I/O schedule of a device's ring (reads and write-backs in flight together, or taking
turns) and its choice from the probe's mix curve: the schedule changes the order of the
requests, never a bit of the results."""
import json
import os

import numpy as np
import pytest
import torch

import smartinf
from smartinf import io_schedule, probe
from smartinf.rounding import to_bf16

SIZES = [5000, 3000, 7000, 1000]
CHUNK = 1024  # several chunks per sub-group: both directions have turns within a step


def train(dirs, schedule, steps=5, **settings):
    """bf16 params and every stored state after ``steps`` steps from seeded inputs."""
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
    assert probe.main([disk_dir, "--size-mib", "8", "--record"]) == 0
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
