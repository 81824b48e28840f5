"""The traffic and storage-limit model the demo and benchmarks report against."""
import json
import math
import os

import pytest

import smartinf
from smartinf import _native
from smartinf.planning import model, model_cli
from smartinf.planning import placement as pl
from smartinf.pipeline import settings


def test_table_one_traffic_per_param():
    ours = model.traffic_per_param("smartupdate", grad_bytes=2, param_bytes=2)
    zero = model.traffic_per_param("zero-infinity")
    # SmartUpdate: 24 B/param of states stay behind the device; 4 B cross the host link.
    assert (ours["storage_read"], ours["storage_write"], ours["storage_total"]) == (12, 12, 24)
    assert (ours["host_to_device"], ours["device_to_host"], ours["host_link_total"]) == (2, 2, 4)
    # ZeRO-Infinity: states and fp32 gradients both ways over the host link.
    assert zero["storage_total"] == 32 and zero["host_link_total"] == 32
    assert model.traffic_per_param("smartupdate", 4, 2)["host_link_total"] == 6
    assert model.traffic_per_param("zero-infinity", 4, 4) == zero  # always fp32 grads


def test_storage_limit_is_read_then_write_time():
    assert model.storage_bound_from_bytes(3e9, 1e9, 1.5e9, 2e9) == pytest.approx(2.5)
    # 1 M params: 12 MB read at 1.2 GB/s + 12 MB written at 2.4 GB/s.
    assert model.storage_bound_seconds(10**6, 1.2e9, 2.4e9) == pytest.approx(0.015)


def test_storage_limit_with_the_measured_mix():
    """With the probe's aggregate for reads and writes in flight together, the balanced
    part of a step's traffic goes at that rate, the excess of one direction at its own."""
    assert model.storage_bound_from_bytes(2e9, 2e9, 1e9, 1e9, mix_bps=0.8e9) == pytest.approx(5.0)
    assert model.storage_bound_from_bytes(3e9, 1e9, 1.5e9, 2e9, mix_bps=2e9) == pytest.approx(
        2e9 / 2e9 + 2e9 / 1.5e9)
    with pytest.raises(ValueError, match="mix=0"):
        model.storage_bound_from_bytes(1, 1, 1, 1, mix_bps=0)


def test_scaling_model_saturates_at_the_host_link():
    t = dict(t_opt=8.0, t_param_swap=4.0, b_pcie=16e9, b_ssd=4e9)
    assert model.scaled_step_time(n=1, **t) == 8.0  # update-bound on one device
    assert model.scaled_step_time(n=2, **t) == 4.0
    # Beyond 4 devices (16 / 4) the param swap no longer speeds up: 4 / 4 = 1 s.
    assert model.scaled_step_time(n=8, **t) == 1.0
    assert model.scaled_step_time(n=16, **t) == 1.0


def test_table_one_ratios_with_smartcomp():
    zero = model.traffic_per_param("zero-infinity")
    ours = model.traffic_per_param("smartupdate")
    comp = model.traffic_per_param("smartcomp", ratio=0.01)
    # 1 % of the elements as (int32, fp16) pairs in, fp16 params out.
    assert comp["host_to_device"] == pytest.approx(0.06)
    assert comp["host_link_total"] == pytest.approx(2.06)
    assert comp["storage_total"] == ours["storage_total"] == 24
    assert zero["host_link_total"] / ours["host_link_total"] == 8
    assert zero["host_link_total"] / comp["host_link_total"] == pytest.approx(15.53, abs=0.01)
    assert zero["storage_total"] / ours["storage_total"] == pytest.approx(4 / 3)


HW = model.Hardware(read_bps=2e9, write_bps=1e9, host_link_bps=4e9)  # device link = read


def test_predict_is_the_seed_formula_on_hand_computed_cases():
    # 1e9 params: T_opt = 12 GB / 2 GB/s + 12 GB / 1 GB/s = 18 s on one device;
    # T_param_swap = 2 GB (the busier direction) / 2 GB/s = 1 s; B_PCIe / B_SSD = 2.
    cases = {1: (18.0, "storage"), 4: (4.5, "storage"), 64: (0.5, "host link")}
    for n, (expected, bound) in cases.items():
        p = model.predict(1e9, n, HW)
        assert p.step_s == pytest.approx(expected)
        assert p.step_s == pytest.approx(model.scaled_step_time(18.0, 1.0, n, 4e9, 2e9))
        assert p.bound == bound
    assert model.predict(1e9, 64, HW).link_s == pytest.approx(2e9 / 4e9)


def test_zero_infinity_on_a_raid0_of_the_drives():
    # 16 B/param read and 16 written over n drives; 16 B/param each way over the link.
    two = model.predict(1e9, 2, HW, "zero-infinity")
    assert (two.step_s, two.bound) == (pytest.approx(16e9 / 4e9 + 16e9 / 2e9), "storage")
    eight = model.predict(1e9, 8, HW, "zero-infinity")
    assert (eight.step_s, eight.bound) == (pytest.approx(16e9 / 4e9), "host link")
    slow_cpu = model.Hardware(2e9, 1e9, host_update_pps=1e8)
    assert model.predict(1e9, 8, slow_cpu, "zero-infinity").step_s == pytest.approx(10.0)
    rows = model.scaling_table(1e9, [2, 8], HW)
    assert rows[0]["smartupdate"]["speedup"] == pytest.approx(12.0 / 9.0)
    assert rows[1]["smartupdate"]["speedup"] == pytest.approx(4.0 / 2.25)
    assert rows[1]["smartupdate"]["host_link_bytes"] == 4e9


def test_devices_on_shared_disks_and_slow_kernels_do_not_scale():
    shared = model.Hardware(2e9, 1e9, shared_read_bps=2e9, shared_write_bps=1e9)
    assert model.predict(1e9, 4, shared).step_s == pytest.approx(18.0)  # one disk: no gain
    slow = model.Hardware(2e9, 1e9, update_pps=5e7)
    p = model.predict(1e9, 4, slow)
    assert (p.step_s, p.bound) == (pytest.approx(5.0), "update")  # 1e9 / (4 x 5e7)


def test_int8_states_halve_the_storage_traffic():
    assert model.state_bytes_per_param("int8") == 6.03125
    ours = model.traffic_per_param("smartupdate", state_bytes=model.state_bytes_per_param("int8"))
    assert ours["storage_total"] == pytest.approx(12.0625)
    # Storage-bound: the step time follows the bytes (ZeRO-Infinity keeps fp32 states).
    fp32, int8 = (model.scaling_table(1e9, [2], HW, state_dtype=d)[0] for d in ("fp32", "int8"))
    assert int8["zero-infinity"] == fp32["zero-infinity"]
    assert fp32["smartupdate"]["step_s"] / int8["smartupdate"]["step_s"] == pytest.approx(12 / 6.03125)
    with pytest.raises(ValueError, match="state_dtype"):
        model.state_bytes_per_param("int2")


def test_the_moments_formats_are_the_layouts_list():
    """state_dtype's values are store/layout.h's one list of formats; a name not in it is
    refused by the layout itself, with the list."""
    assert settings.STATE_DTYPES == _native.moments_names() == ("fp32", "int8", "int4")
    with pytest.raises(ValueError, match="state_dtype must be one of fp32, int8, int4, got 'int2'"):
        _native.state_bytes("int2", "fp32", 1000)


def test_split_masters_and_int4_moments_in_bytes_per_param():
    """The bytes per param are store/layout.h's: a split master saves 2 B per param on
    storage each way and costs the params' bytes host -> device (the trade-off on a real CSD)."""
    assert model.state_bytes_per_param("fp32", "split") == pytest.approx(10, abs=1e-4)  # + 8 B a chunk
    assert model.state_bytes_per_param("int8", "split") == pytest.approx(4.03125, abs=1e-4)
    assert model.state_bytes_per_param("int4", "split") == pytest.approx(3.09375, abs=1e-4)
    with pytest.raises(ValueError, match="master"):
        model.state_bytes_per_param("fp32", "half")
    split = model.traffic_per_param("smartupdate", state_bytes=4.03125, split=True)
    assert (split["storage_total"], split["host_to_device"]) == (pytest.approx(8.0625), 4)
    assert model.traffic_per_param("zero-infinity")["storage_total"] / split["storage_total"] \
        == pytest.approx(32 / 8.0625)
    # A link as fast as the drive: the params sent in are free while storage bounds the step...
    fast, slow = model.Hardware(2e9, 2e9), model.Hardware(2e9, 2e9, device_link_bps=1e8)
    rows = {m: model.scaling_table(1e9, [1], fast, state_dtype="int8", master=m)[0]
            for m in ("fp32", "split")}
    assert rows["split"]["smartupdate"]["step_s"] < rows["fp32"]["smartupdate"]["step_s"]
    assert rows["split"]["smartupdate"]["host_link_bytes"] == 6e9
    # ...and cost time once the link bounds it
    rows = {m: model.scaling_table(1e9, [1], slow, state_dtype="int8", master=m)[0]
            for m in ("fp32", "split")}
    assert rows["split"]["smartupdate"]["step_s"] > rows["fp32"]["smartupdate"]["step_s"]


def test_hardware_from_probe_results():
    probe = {"storage": [{"read_bps": 2e9, "write_bps": 3e9}, {"read_bps": 1.5e9, "write_bps": 4e9}]}
    hw = model.Hardware.from_probe(probe, host_link_bps=8e9)
    assert (hw.read_bps, hw.write_bps, hw.link_bps, hw.host_link_bps) == (1.5e9, 3e9, 1.5e9, 8e9)
    cards = {"storage": [], "smartssd": [{"p2p_read_bps": 3e9, "p2p_write_bps": 2e9,
                                          "host_to_fpga_bps": 3.5e9, "fpga_to_host_bps": 3.2e9}]}
    hw = model.Hardware.from_probe(cards)
    assert (hw.read_bps, hw.write_bps, hw.link_bps, hw.host_link_bps) == (3e9, 2e9, 3.2e9, math.inf)
    with pytest.raises(ValueError, match="no storage figures"):
        model.Hardware.from_probe({"storage": []})
    assert hw.mix_bps is None and model.Hardware.from_probe(probe).mix_bps is None


def test_the_prediction_uses_the_probes_mix_curve():
    """A disk that loses bandwidth when reads and writes mix: smartinf's ring (both in flight)
    is predicted at the mixed rate; ZeRO-Infinity's swapper takes turns, so it is not."""
    storage = {"read_bps": 2e9, "write_bps": 2e9, "mixed_bps": 1.2e9, "phased_bps": []}
    hw = model.Hardware.from_probe({"storage": [storage, dict(storage, mixed_bps=1.5e9)]})
    assert hw.mix_bps == 1.2e9
    turns = model.Hardware(2e9, 2e9)
    ours, theirs = model.predict(1e9, 1, hw), model.predict(1e9, 1, turns)
    assert ours.storage_s == pytest.approx(24e9 / 1.2e9) and theirs.storage_s == pytest.approx(12.0)
    assert model.predict(1e9, 1, hw, "zero-infinity").storage_s == \
        model.predict(1e9, 1, turns, "zero-infinity").storage_s
    # Where bursts of one direction beat the mix by more than the margin, "auto" runs phased
    # and the prediction takes that burst's figure.
    phased = dict(storage, phased_bps=[[64 << 20, 1.3e9], [256 << 20, 1.9e9]])
    assert model.Hardware.from_probe({"storage": [phased]}).mix_bps == 1.9e9
    # Where the record holds what the ring drew, the schedule and the figure are the ring's.
    ring = dict(phased, ring_mixed_bps=1.6e9, ring_phased_bps=1.4e9)
    assert model.Hardware.from_probe({"storage": [ring]}).mix_bps == 1.6e9


def test_command_line(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"storage": [{"read_bps": 2e9, "write_bps": 1e9}]}))
    png = tmp_path / "scaling.png"
    assert model_cli.main(["--params", "1e9", "--devices", "1-3,8", "--probe", str(probe),
                       "--host-link-gbps", "4", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["n"] for r in out["rows"]] == [1, 2, 3, 8]
    assert out["rows"][3]["zero-infinity"]["bound"] == "host link"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert model_cli.main(["--params", "8e9", "--read-gbps", "3", "--write-gbps", "2"]) == 0
    table = capsys.readouterr().out
    assert "SmartUpdate" in table and len(table.splitlines()) == 2 + 10
    assert model_cli.main(["--params", "1e9", "--devices", "0-2", "--read-gbps", "1",
                       "--write-gbps", "1"]) == 2
    assert "device counts must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model_cli.main(["--params", "1e9"])
    assert "--read-gbps" in capsys.readouterr().err


@pytest.mark.parametrize("call, match", [
    (lambda: model.traffic_per_param("zero-offload"), "unknown scheme"),
    (lambda: model.traffic_per_param("smartupdate", grad_bytes=0), "grad_bytes"),
    (lambda: model.traffic_per_param("smartupdate", param_bytes=True), "param_bytes"),
    (lambda: model.storage_bound_from_bytes(1, 1, 0, 1), "positive"),
    (lambda: model.storage_bound_from_bytes(-1, 1, 1, 1), "negative"),
    (lambda: model.storage_bound_seconds(-5, 1, 1), "negative"),
    (lambda: model.scaled_step_time(1, 1, 0, 1, 1), "positive int"),
    (lambda: model.scaled_step_time(1, 1, 2, 0, 1), "positive"),
    (lambda: model.traffic_per_param("smartcomp", ratio=0), "ratio"),
    (lambda: model.Hardware(0, 1), "read_bps"),
    (lambda: model.Hardware(1, 1, shared_read_bps=1), "both"),
    (lambda: model.predict(0, 1, HW), "params"),
    (lambda: model.predict(1e9, 0, HW), "n must"),
    (lambda: model_cli.parse_devices("a-b"), "expected N"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_tiered_step_and_the_budget_a_step_time_needs():
    """Storage time falls linearly with the resident fraction, to the resident states'
    write-back once per interval; budget_for inverts it."""
    P, R, W, mem = 1e9, 2e9, 1e9, 10e9
    none = model.predict_tiered(P, 0.0, R, W, mem)
    assert none.storage_s == pytest.approx(P * 12 / R + P * 12 / W) and none.bound == "storage"
    full = model.predict_tiered(P, 1.0, R, W, mem, commit_every=10)
    assert full.storage_s == pytest.approx(P * 12 / 10 / W)
    assert full.memory_s == pytest.approx(P * 28 / mem) and full.bound == "memory"
    half = model.predict_tiered(P, 0.5, R, W, mem, commit_every=1)
    assert half.storage_s == pytest.approx(P * 6 / R + P * 12 / W)
    for target in (none.storage_s * 0.7, half.storage_s, 13.0):
        budget = model.budget_for(target, P, R, W, commit_every=4)
        got = model.predict_tiered(P, budget / (P * 12), R, W, mem, commit_every=4)
        assert got.storage_s == pytest.approx(target)
    assert model.budget_for(100.0, P, R, W) == 0.0
    assert model.budget_for(0.1, P, R, W, commit_every=1) == math.inf
    with pytest.raises(ValueError, match="fraction"):
        model.predict_tiered(P, 1.5, R, W, mem)


def test_command_line_tiers(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"storage": [{"read_bps": 2e9, "write_bps": 1e9}],
                                 "triad": {"bps": 10e9}}))
    assert model_cli.main(["--params", "1e9", "--tiers", "--probe", str(probe), "--commit-every", "4",
                       "--step-time", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["resident"] for r in out["rows"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert out["rows"][0]["step_s"] == pytest.approx(18.0)
    assert out["budget_bytes"] == pytest.approx(model.budget_for(10, 1e9, 2e9, 1e9, 4))
    # where the probe timed the ring, streamed states go at what it drew (auto: mixed here)
    probe.write_text(json.dumps({"storage": [{"read_bps": 2e9, "write_bps": 1e9, "mixed_bps": 1.5e9,
                                              "ring_mixed_bps": 3e9, "ring_phased_bps": 2e9}],
                                 "triad": {"bps": 10e9}}))
    assert model_cli.main(["--params", "1e9", "--tiers", "--probe", str(probe), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["step_s"] == pytest.approx(24e9 / 3e9)
    assert model_cli.main(["--params", "1e9", "--tiers", "--read-gbps", "2", "--write-gbps", "1",
                       "--step-time", "1"]) == 2
    assert "--memory-gbps" in capsys.readouterr().err
    assert model_cli.main(["--params", "1e9", "--tiers", "--read-gbps", "2", "--write-gbps", "1",
                       "--memory-gbps", "10", "--step-time", "0.5"]) == 0
    assert "more than all the states" in capsys.readouterr().out


def test_sub_groups_fill_the_gpu_budget_then_host_memory_then_stream():
    """Whole sub-groups, in order: 10 of 1e8 params at 12 B; a GPU budget of 2.5 sub-groups'
    states takes 2, host memory of 4.5 takes the next 4 (the third does not fit the GPU's
    half left), the last 4 stream; a short last sub-group fits what is left."""
    got = pl.place(1e9, 12, 2.5 * 12e8, 4.5 * 12e8, subgroup=1e8)
    assert (got.gpu, got.ram, got.streamed) == (2e8, 4e8, 4e8)
    got = pl.place(1.05e9, 12, 0, 10.6 * 12e8, subgroup=1e8)
    assert (got.gpu, got.ram, got.streamed) == (0, 1.05e9, 0)
    with pytest.raises(ValueError, match="positive"):
        pl.place(1e9, 12, -1, 0)


def test_the_placed_step_is_the_longer_of_the_gpu_and_the_host():
    """The GPU's part at its rate beside the host's tiered step and the PCIe copies of its
    sub-groups' gradients and params; the balance point equalises the two."""
    P, gpu_pps, host_pps, mem = 1e9, 50e9, 1e9, 1e12  # memory fast: the host's kernel bounds
    placement = pl.place(P, 12, 0.25 * P * 12, P * 12, subgroup=1e7)
    p = pl.predict_placed(placement, gpu_pps, host_pps, mem, 2e9, 1e9, 20e9, 10e9)
    assert p.gpu_s == pytest.approx(0.25 * P / gpu_pps)
    # the host's part all resident with a durable commit every step: its write-back, and the
    # GPU's beside it, bound (the GPU's 6 s wait for its write fits in the disk's 12 s)
    assert p.host_s == pytest.approx(0.75 * P * 12 / 1e9) and p.bound == "storage"
    assert p.disk_s == pytest.approx(P * 12 / 1e9) == p.step_s
    p = pl.predict_placed(placement, gpu_pps, host_pps, mem, 2e9, 100e9, 20e9, 10e9,
                             commit_every=10)
    # ... and the GPU's first updates after a commit wait for its 3 GB written at 100 GB/s
    # beside as many of the host's, 0.06 s, while the host's part of that step takes 0.75
    assert p.commit_s == 0 and p.step_s == pytest.approx(0.75) and p.bound == "host"
    assert p.disk_s == pytest.approx(12 / 100 / 10)
    assert p.link_s == pytest.approx(0.75 * P * 2 / 10e9)
    assert p.balance_gpu_params == pytest.approx(P * gpu_pps / (gpu_pps + host_pps))
    # at 1 GB/s the wait, 6 s, outlasts that step: the interval is 6 s + the GPU's update,
    # then 9 steps of 0.75 s, longer than the disk's 12 GB (1.2 s a step)
    p = pl.predict_placed(placement, gpu_pps, host_pps, mem, 2e9, 1e9, 20e9, 10e9,
                             commit_every=10)
    assert p.disk_s == pytest.approx(1.2) and p.bound == "storage"
    assert p.step_s == pytest.approx((6 + 0.25 * P / gpu_pps + 9 * 0.75) / 10)
    assert p.commit_s == pytest.approx(p.step_s - 1.2)
    alone = pl.predict_placed(pl.place(P, 12, P * 12, 0), gpu_pps, host_pps, mem, 2e9,
                                 1e9, 20e9, 10e9, commit_every=1 << 40)
    assert alone.step_s == pytest.approx(P / gpu_pps) and alone.host_s == 0 and alone.bound == "gpu"
    # a durable commit every step: the GPU's 12 GB written at 1 GB/s, waited for
    alone = pl.predict_placed(pl.place(P, 12, P * 12, 0), gpu_pps, host_pps, mem, 2e9,
                                 1e9, 20e9, 10e9)
    assert alone.step_s == pytest.approx(P / gpu_pps + 12)


def test_resident_writes_beside_the_hosts_update_take_the_probes_slower_rate():
    """A durable commit's background write runs at the probe's write beside the host's
    update (commit_write_bps) for as long as the update runs each step, at the plain write
    rate after it; none given: the plain rate throughout, as before."""
    P, mem, host_pps = 1e9, 1e12, 2e9  # the host's update 0.5 s a step over P
    W, beside = 2e9, 1e9
    # all resident in host memory, a durable commit every 4 steps: 3 GB written a step
    plain = model.predict_tiered(P, 1.0, 4e9, W, mem, 4, update_pps=host_pps)
    assert plain.storage_s == pytest.approx(3e9 / W)
    slow = model.predict_tiered(P, 1.0, 4e9, W, mem, 4, update_pps=host_pps, commit_write_bps=beside)
    # 0.5 s beside the update (0.5 GB), the other 2.5 GB at 2 GB/s
    assert slow.storage_s == pytest.approx(0.5 + 2.5e9 / W) and slow.bound == "storage"
    # a write shorter than the update runs beside it all along
    short = model.predict_tiered(P, 1.0, 4e9, W, mem, 48, update_pps=host_pps, commit_write_bps=beside)
    assert short.storage_s == pytest.approx(0.25e9 / beside) and short.bound == "update"
    # streamed states are read and written at the plain rates either way
    half = model.predict_tiered(P, 0.5, 4e9, W, mem, 4, update_pps=host_pps, commit_write_bps=beside)
    assert half.storage_s == pytest.approx(6e9 / 4e9 + 6e9 / W + 0.5 + 1e9 / W)
    # placed: a quarter on the GPU with twins, the rest in host memory; the GPU's states
    # are written beside the host's update too (3 + 9 GB over 4 steps: 3 GB a step)
    placement = pl.place(P, 12, 2 * 0.25 * P * 12, P * 12, subgroup=1e7, twins=True)
    args = (50e9, host_pps, mem, 4e9, W, 20e9, 20e9)
    p = pl.predict_placed(placement, *args, commit_every=4, twins=True)
    assert p.disk_s == pytest.approx(3e9 / W) == p.step_s
    q = pl.predict_placed(placement, *args, commit_every=4, twins=True, commit_write_bps=beside)
    assert q.disk_s == pytest.approx(0.375 + (3e9 - 0.375 * beside) / W) == q.step_s  # host 0.375 s
    # without twins the GPU's wait for its 3 GB (beside 3 GB of the host's) is at that rate too
    placement = pl.place(P, 12, 0.25 * P * 12, P * 12, subgroup=1e7)
    r = pl.predict_placed(placement, *args, commit_every=4, commit_write_bps=beside)
    wait = 0.375 + (6e9 - 0.375 * beside) / W
    assert r.step_s == pytest.approx(max(r.disk_s, (wait + r.gpu_s + 3 * 0.375) / 4))
    with pytest.raises(ValueError, match="commit_write_bps"):
        model.Hardware(read_bps=1e9, write_bps=1e9, commit_write_bps=0)
    probe = {"storage": [{"read_bps": 2e9, "write_bps": 2e9, "write_beside_update_bps": 1.5e9},
                         {"read_bps": 2e9, "write_bps": 2e9, "write_beside_update_bps": 1.2e9}]}
    assert model.Hardware.from_probe(probe).commit_write_bps == 1.2e9
    del probe["storage"][1]["write_beside_update_bps"]  # a directory probed before it
    assert model.Hardware.from_probe(probe).commit_write_bps is None


def test_streamed_states_go_at_what_the_ring_draws_and_follow_backward():
    """With the ring's figure for its I/O schedule (mix_bps) streamed states are read and
    written back together at it, not one direction after the other; what follows backward
    (exposed_s: the updates, the streamed traffic, a GPU's wait for its write) sets the
    iteration with forward and backward, the disk's whole traffic where it is longer."""
    P, mem, host_pps, R, W, M = 1e9, 1e12, 1e10, 1e9, 2e9, 3e9
    streamed = model.predict_tiered(P, 0.0, R, W, mem, 10, update_pps=host_pps, mix_bps=M)
    assert streamed.storage_s == pytest.approx(2 * 12 * P / M) and streamed.bound == "storage"
    assert model.predict_tiered(P, 0.0, R, W, mem, 10, update_pps=host_pps).storage_s == \
        pytest.approx(12 * P / R + 12 * P / W)
    # a quarter on the GPU with twins, a quarter in host memory, half streamed
    placement = pl.Placement(gpu=0.25 * P, ram=0.25 * P, streamed=0.5 * P)
    args = (50e9, host_pps, mem, R, W, 20e9, 20e9)
    p = pl.predict_placed(placement, *args, commit_every=10, twins=True, mix_bps=M)
    streamed_s = 2 * 12 * 0.5 * P / M
    assert p.disk_s == pytest.approx(streamed_s + 0.5 * P * 12 / 10 / W) == p.step_s
    assert p.exposed_s == pytest.approx(streamed_s)
    assert p.iteration_s(0.5) == pytest.approx(0.5 + streamed_s)  # the disk idles in forward
    assert p.iteration_s(0.0) == pytest.approx(p.step_s)
    # without twins the step after a commit waits for the GPU's 3 GB beside as many of the
    # host's (3 s at W), and its streamed traffic comes after the wait
    q = pl.predict_placed(placement, *args, commit_every=10, mix_bps=M)
    assert q.exposed_s == pytest.approx((3 + streamed_s + 9 * streamed_s) / 10)
    assert q.step_s == pytest.approx(max(q.disk_s, q.exposed_s))
    assert pl.iteration_s(1.0, 0.25, 0.5) == 1.0 and pl.iteration_s(1.0, 0.75, 0.5) == 1.25


def test_recorded_rates_take_the_rings_figure_for_the_schedule():
    """The record's aggregate for the pipeline's schedule: the ring's where the probe timed
    it, else the mix curve's; the schedule auto picks where none is named; none at all
    where the record has neither (one direction after the other)."""
    host = {"triad": {"bps": 1e10}, "read_bps": 1e9, "write_bps": 2e9,
            "kernel": [{"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32",
                        "threads": 2, "master": "fp32", "params_per_s": 1e8}]}
    curve = {"mixed_bps": 1.5e9, "phased_bps": [[64 << 20, 1.6e9], [256 << 20, 1.8e9]]}
    ring = {"ring_mixed_bps": 2.9e9, "ring_phased_bps": 2.2e9}
    assert pl.recorded_rates(host, "fp32", "fp32")["mix_bps"] is None
    assert pl.recorded_rates(host | curve, "fp32", "fp32")["mix_bps"] == 1.8e9  # auto: phased
    assert pl.recorded_rates(host | curve, "fp32", "fp32", "mixed")["mix_bps"] == 1.5e9
    assert pl.recorded_rates(host | curve | ring, "fp32", "fp32")["mix_bps"] == 2.9e9
    assert pl.recorded_rates(host | curve | ring, "fp32", "fp32", "phased")["mix_bps"] == 2.2e9
    with pytest.raises(ValueError, match="ring"):
        pl.recorded_rates(host | {"ring_mixed_bps": -1.0}, "fp32", "fp32")


def test_twins_pay_where_the_hosts_update_of_half_a_budget_beats_waiting_for_its_write():
    """Per byte of a GPU budget over a commit interval of k steps: twins cost k / (2 s H)
    (half its params updated by the host), none costs 1 / W (the write waited for)."""
    s, host, write = 12, 4e9, 2e9  # 2 s H / W = 48
    assert pl.twins_pay(s, 47, host, write) and not pl.twins_pay(s, 49, host, write)
    assert pl.twins_pay(6, 10, 2.3e9, 2e9) and not pl.twins_pay(5, 10, 1.2e9, 2e9)
    with pytest.raises(ValueError, match="commit_every"):
        pl.twins_pay(s, 0, host, write)
    # with twins a sub-group takes twice its bytes of the GPU's budget, and the GPU's
    # resident states are written in the background (the disk's traffic, not a wait)
    P = 1e9
    plain, twin = (pl.place(P, 12, 0.5 * P * 12, P * 12, subgroup=1e8, twins=t)
                   for t in (False, True))
    assert (plain.gpu, twin.gpu, twin.ram) == (5e8, 2e8, 8e8)
    p = pl.predict_placed(twin, 50e9, 1e9, 1e12, 2e9, 1e9, 20e9, 10e9, commit_every=10,
                             twins=True)
    assert p.commit_s == 0 and p.twins
    assert p.host_s == pytest.approx(max(0.8, 8e8 * 12 / 10 / 1e9))
    assert p.disk_s == pytest.approx((8e8 + 2e8) * 12 / 10 / 1e9) == p.step_s


def test_a_gpus_twins_are_chosen_by_the_model_from_the_probes_record(tmp_path, monkeypatch):
    """CudaDevice(twins=None), where the host has no memory for a host twin: twins where the
    directory's probe record (or none) says so; as given otherwise; none without a budget or
    with overlap off."""
    from smartinf.planning import io_schedule, space, twins
    monkeypatch.setattr(space, "available_memory", lambda: 0)
    (tmp_path / "run" / "gpu").mkdir(parents=True)
    gpu = smartinf.CudaDevice(str(tmp_path / "run" / "gpu"), memory_budget="1GB")
    choice = twins.choose(gpu, "fp32", "fp32", 10, True)
    assert choice.twins and "no probe record" in choice.reason
    kernel = {"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32", "threads": 14,
              "master": "fp32", "params_per_s": 4e9}
    io_schedule.record(str(tmp_path), {"write_bps": 2e9, "kernel": [kernel]})
    assert twins.choose(gpu, "fp32", "fp32", 10, True).twins  # 2 x 12 x 4 / 2 = 48 > 10
    choice = twins.choose(gpu, "fp32", "fp32", 100, True)
    assert not choice.twins and "2.00 GB/s" in choice.reason
    # the GPU's wait for its write runs beside the host's update: at that rate where measured
    io_schedule.record(str(tmp_path), {"write_bps": 2e9, "write_beside_update_bps": 0.4e9,
                                       "kernel": [kernel]})
    choice = twins.choose(gpu, "fp32", "fp32", 100, True)
    assert choice.twins and "0.40 GB/s" in choice.reason  # 100 / 96e9 s < 1 / 0.4e9 s
    io_schedule.record(str(tmp_path), {"write_bps": 2e9, "kernel": [kernel]})
    assert not twins.choose(gpu, "fp32", "fp32", 10, False).twins
    assert not twins.choose(smartinf.CudaDevice(gpu.path), "fp32", "fp32", 10, True).twins
    assert twins.choose(smartinf.CudaDevice(gpu.path, memory_budget=1, twins=True), "fp32",
                        "fp32", 100, True).reason == "as requested"
    assert not twins.choose(smartinf.CpuDevice(gpu.path), "fp32", "fp32", 10, True).twins
    with pytest.raises(TypeError, match="twins must be True or False"):
        smartinf.CpuDevice(gpu.path, twins=None)
    # records the probe wrote before it kept kernel rates: the default
    io_schedule.record(str(tmp_path), {"write_bps": 2e9})
    assert "no probe record with the host's update rate" in twins.choose(
        gpu, "fp32", "fp32", 100, True).reason
    for bad in ({"write_bps": "fast", "kernel": [kernel]}, {"kernel": [kernel]},
                {"write_bps": 2e9, "kernel": [{"threads": 14}]}):
        io_schedule.record(str(tmp_path), bad)
        with pytest.raises(ValueError, match="is not a probe record"):
            twins.choose(gpu, "fp32", "fp32", 10, True)
    for bad in ("{", "[]"):
        (tmp_path / io_schedule.RECORD).write_text(bad)
        with pytest.raises(ValueError, match="is not a probe record.*pass twins=True or False"):
            twins.choose(gpu, "fp32", "fp32", 10, True)


def test_a_gpu_budget_takes_a_host_twin_where_the_hosts_memory_holds_it(tmp_path, monkeypatch):
    """CudaDevice(twins=None) with a budget in GPU memory: a host twin (page-locked, as large,
    that durable commits write from) where the host's available memory holds it for every
    local rank beside the pipeline's other host budgets, with a tenth of the machine spare;
    else the model's choice. Asked for, it is taken; refused for a budget in host memory."""
    from smartinf import defaults
    from smartinf.planning import space, twins
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spare = int(0.1 * total)
    (tmp_path / "gpu").mkdir()
    gpu = smartinf.CudaDevice(str(tmp_path / "gpu"), memory_budget=4 << 30)
    for name in defaults.LOCAL_RANKS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(space, "available_memory", lambda: (4 << 30) + (1 << 30) + spare)
    got = twins.choose(gpu, "int8", "split", 10, True, (), 1 << 30)
    assert got.host and not got.twins and got.reason.startswith("a host twin")
    assert not twins.choose(gpu, "int8", "split", 10, True, (), (1 << 30) + 1).host
    assert not twins.choose(gpu, "int8", "split", 10, False, (), 1 << 30).host  # overlap off
    monkeypatch.setenv("LOCAL_SIZE", "2")  # (the deepspeed launcher's) each rank's budgets: twice as much
    assert not twins.choose(gpu, "int8", "split", 10, True, (), 1 << 30).host
    monkeypatch.setattr(space, "available_memory", lambda: 0)
    asked = smartinf.CudaDevice(gpu.path, memory_budget=1, twins="host")
    assert twins.choose(asked, "fp32", "fp32", 10, True).host
    with pytest.raises(ValueError, match='twins="host" is a host copy of a budget in GPU memory'):
        smartinf.CudaDevice(gpu.path, memory_budget=1, memory="host", twins="host")
    with pytest.raises(TypeError, match='"host"'):
        smartinf.CudaDevice(gpu.path, memory_budget=1, twins="yes")


def test_twins_by_the_whole_placement_where_the_sub_groups_are_known(tmp_path, monkeypatch):
    """With the sub-groups' sizes and a record holding the GPU's figures, no twins only where
    the model's mean over the interval is more than 1 % shorter without. 10 x 1e8 params, all
    resident: (a) a quarter of their bytes as the GPU's budget, a fast host: the disk writes
    every state once per interval either way (a tie: twins); (b) a host 4x slower: the
    GPU's wait outlasts what twins send to the host (twins); (c) a budget of one sub-group,
    which twins leave empty: the wait hides behind the host's part of its step (none), where
    the rule per byte takes twins. (No memory for a host twin.)"""
    from smartinf.planning import io_schedule, space, twins
    monkeypatch.setattr(space, "available_memory", lambda: 0)
    (tmp_path / "gpu").mkdir()
    sizes, ram = [int(1e8)] * 10, 12e9
    kernel = {"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32", "threads": 14,
              "master": "fp32", "params_per_s": 4e9}
    figures = {"read_bps": 2e9, "write_bps": 2e9, "kernel": [kernel], "triad": {"bps": 1e12},
               "gpu": {"update_pps": {"fp32": 50e9}, "host_to_gpu_bps": 20e9,
                       "gpu_to_host_bps": 20e9}}

    def choice(budget, host_pps, sizes=sizes):
        kernel["params_per_s"] = host_pps
        io_schedule.record(str(tmp_path), figures)
        gpu = smartinf.CudaDevice(str(tmp_path / "gpu"), memory_budget=int(budget))
        return twins.choose(gpu, "fp32", "fp32", 10, True, sizes, ram)

    got = choice(3e9, 4e9)
    assert got.twins and "with twins 0.600 s, without 0.600 s" in got.reason
    # without: 2 sub-groups on the GPU, its 2.4 GB written beside 2.4 of the host's (2.4 s)
    # then its update, and 9 steps of the host's 0.8 s; with: 1 there, the host's 0.9 s
    got = choice(3e9, 1e9)
    assert got.twins and "with twins 0.900 s, without 0.960 s" in got.reason
    # without: 1 there, its 1.2 s wait beside the host's 0.9 s, then 9 of 0.9; with: none
    assert pl.twins_pay(12, 10, 1e9, 2e9)
    got = choice(1.2e9, 1e9)
    assert not got.twins and "with twins 1.000 s, without 0.930 s" in got.reason
    # the margin: without twins only where more than 1 % shorter
    assert pl.twins_win(1.0, 0.991) and not pl.twins_win(1.0, 0.989)
    with pytest.raises(ValueError, match="a sub-group of 0"):
        choice(1.2e9, 1e9, sizes=[int(1e8), 0])
    with pytest.raises(ValueError, match=r"subgroup_sizes must be positive ints .*got -5 among them"):
        smartinf.Pipeline(str(tmp_path / "cpu"), subgroup_sizes=[10, -5])
    with pytest.raises(ValueError, match="got 1.5"):
        smartinf.Pipeline(str(tmp_path / "cpu"), subgroup_sizes=[1.5])
    assert not (tmp_path / "cpu").exists()  # refused before anything is created
    # no sizes, or a record without the GPU's figures: the rule per byte
    assert "G params/s" in choice(1.2e9, 1e9, sizes=()).reason
    del figures["gpu"]
    assert "G params/s" in choice(1.2e9, 1e9).reason
    for bad in ({"update_pps": {"fp32": -1.0}, "host_to_gpu_bps": 1, "gpu_to_host_bps": 1},
                {"update_pps": {"fp32": True}, "host_to_gpu_bps": 1, "gpu_to_host_bps": 1},
                {"update_pps": {"int8": 1e9}, "host_to_gpu_bps": 1, "gpu_to_host_bps": 1}):
        figures["gpu"] = bad
        with pytest.raises(ValueError, match="is not a probe record"):
            choice(1.2e9, 1e9)


def test_command_line_places_with_the_probes_gpu(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    figures = {"storage": [{"read_bps": 2e9, "write_bps": 1e9}], "triad": {"bps": 1e12},
               "kernel": [{"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32",
                           "threads": 14, "master": "fp32", "params_per_s": 1e9}]}
    probe.write_text(json.dumps(figures))
    assert model_cli.main(["--params", "1e9", "--probe", str(probe), "--gpu-budget", "3GB"]) == 2
    assert "measured a GPU" in capsys.readouterr().err
    figures["gpu"] = {"update_pps": {"fp32": 50e9}, "host_to_gpu_bps": 20e9,
                      "gpu_to_host_bps": 10e9}
    probe.write_text(json.dumps(figures))
    assert model_cli.main(["--params", "1e9", "--probe", str(probe), "--gpu-budget", "3.05GB",
                       "--memory-budget", "9.1GB", "--subgroup", "2.5e8", "--commit-every", "10",
                       "--twins", "off", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"] == {"gpu": 2.5e8, "ram": 7.5e8, "streamed": 0.0, "gpu_host": 0.0}
    # the disk writes the host's 9 GB and the GPU's 3 GB once per 10 steps at 1 GB/s (1.2 s
    # a step), longer than the host's kernel (0.75 s); but the GPU's updates wait 6 s for
    # its 3 GB written beside 3 GB of the host's, then 9 steps of 0.75 s follow: 12.755 s
    assert not out["twins"] and out["disk_s"] == pytest.approx(1.2)
    assert out["step_s"] == pytest.approx(1.2755) and out["bound"] == "storage"
    assert out["commit_s"] == pytest.approx(0.0755)
    # auto: the whole placement with twins is faster (the budget then takes no sub-group
    # with its twin: all on the host, 1.2 s a step, the disk's) than without (1.2755)
    assert model_cli.main(["--params", "1e9", "--probe", str(probe), "--gpu-budget", "3.05GB",
                       "--memory-budget", "12.1GB", "--subgroup", "2.5e8", "--commit-every", "10",
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["twins"] and out["placement"]["gpu"] == 0 and out["commit_s"] == 0
    assert model_cli.main(["--params", "1e9", "--probe", str(probe), "--gpu-budget", "3.05GB",
                       "--subgroup", "2.5e8", "--twins", "off"]) == 0
    out = capsys.readouterr().out
    assert "GPU 2.5e+08 params (without twins), host memory 0, streamed 7.5e+08" in out
    # the host streams 7.5e8 params (13.5 s of disk a step): the GPU's 3 s wait for its own
    # write every step hides behind it
    assert "disk 16.500 s, the GPU's wait for its commit adds 0.000 s" in out


def test_command_line_placement_rejects_bad_budgets_and_sub_groups(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({
        "storage": [{"read_bps": 2e9, "write_bps": 1e9}], "triad": {"bps": 1e12},
        "kernel": [{"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32",
                    "threads": 14, "master": "fp32", "params_per_s": 1e9}],
        "gpu": {"update_pps": {"fp32": 50e9}, "host_to_gpu_bps": 20e9, "gpu_to_host_bps": 10e9}}))
    assert model_cli.main(["--params", "1e9", "--probe", str(probe), "--gpu-budget", "lots"]) == 2
    assert "--gpu-budget='lots': expected bytes" in capsys.readouterr().err
    assert model_cli.main(["--params", "1e9", "--probe", str(probe), "--gpu-budget", "3GB",
                       "--subgroup", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_the_model_predicts_a_pipelines_own_placement_from_its_directorys_record(tmp_path):
    """predict_pipeline: the sub-groups where the pipeline put them (here 2 of 3 resident in
    host memory, one streamed), its settings, and the probe's record of its directory (or
    above it); without a record, or one without the host's figures, none."""
    from smartinf.planning import io_schedule
    state = 12
    sizes = (3000, 2000, 4000)
    kernel = {"grad": "bfloat16", "param": "bfloat16", "state_dtype": "fp32", "threads": 14,
              "master": "fp32", "params_per_s": 1e6}
    figures = {"read_bps": 2e6, "write_bps": 1e6, "write_beside_update_bps": 0.5e6,
               "kernel": [kernel], "triad": {"bps": 1e9}}
    with smartinf.Pipeline(str(tmp_path / "run"), memory_budget=5000 * state + 4096,
                           commit_every=4) as pipe:
        for n in sizes:
            pipe.add_subgroup(n)
        assert pl.predict_pipeline(pipe) is None  # no record yet
        io_schedule.record(str(tmp_path), {"read_bps": 2e6, "write_bps": 1e6})
        assert pl.predict_pipeline(pipe) is None  # no host figures in it
        io_schedule.record(str(tmp_path), figures)
        got = pl.predict_pipeline(pipe)
        resident = [pipe.resident(sg) for sg in range(3)]
    assert resident == [True, True, False]
    want = pl.predict_placed(pl.Placement(gpu=0, ram=5000, streamed=4000), math.inf, 1e6,
                                1e9, 2e6, 1e6, math.inf, math.inf, state, commit_every=4,
                                commit_write_bps=0.5e6)
    assert got == want
    # by hand: the host's update of 9000 params, 9 ms; its 4000 streamed read and written,
    # 24 + 48 ms; 60 kB resident / 4 a step, 4.5 kB beside the update, 10.5 kB after it
    assert got.step_s == pytest.approx(0.024 + 0.048 + 0.009 + 0.0105) and got.bound == "storage"
    io_schedule.record(str(tmp_path), dict(figures, read_bps="fast"))
    with smartinf.Pipeline(str(tmp_path / "run")) as pipe, \
            pytest.raises(ValueError, match="is not a probe record"):
        pl.predict_pipeline(pipe)


def test_ranks_of_one_host_share_its_memory_cores_and_disk():
    """rank_share: N ranks stepping at once each get 1/N of the host's kernel rate, memory
    bandwidth and disk; a GPU's and its link's rates stay each rank's own. N ranks of 1/N
    of the params each then take as long as one rank with all of them, on a host-bound
    placement."""
    rates = {"gpu_pps": 5e9, "host_pps": 4e9, "memory_bps": 80e9, "read_bps": 2e9,
             "write_bps": 2e9, "host_to_gpu_bps": 50e9, "gpu_to_host_bps": 50e9,
             "commit_write_bps": None, "mix_bps": 2.4e9}
    half = pl.rank_share(rates, 2)
    assert half["host_pps"] == 2e9 and half["read_bps"] == 1e9 and half["mix_bps"] == 1.2e9
    assert half["gpu_pps"] == 5e9 and half["host_to_gpu_bps"] == 50e9 and half["commit_write_bps"] is None
    one = pl.predict_placed(pl.Placement(gpu=0, ram=1e9, streamed=1e9), **rates, state_bytes=12)
    two = pl.predict_placed(pl.Placement(gpu=0, ram=0.5e9, streamed=0.5e9), **half, state_bytes=12)
    assert two.step_s == pytest.approx(one.step_s)
    with pytest.raises(ValueError, match="ranks must be a positive int"):
        pl.rank_share(rates, 0)


def test_the_gpus_states_in_host_memory_cross_pcie_both_ways():
    """States in host memory that the GPU updates (CudaDevice(memory="host")): each step
    they cross PCIe both ways, at BOTH_WAYS_SHARE of each direction's rate, and the step
    is bound by that where the host's cores would take longer."""
    rates = dict(gpu_pps=1e11, host_pps=3e9, memory_bps=80e9, read_bps=2e9, write_bps=2e9,
                 host_to_gpu_bps=50e9, gpu_to_host_bps=50e9)
    on_gpu = pl.predict_placed(pl.Placement(gpu=0, ram=0, streamed=0, gpu_host=8e9),
                                  **rates, state_bytes=4, commit_every=100)
    assert on_gpu.link_s == pytest.approx(8e9 * 4 / (50e9 * pl.BOTH_WAYS_SHARE))
    assert on_gpu.bound == "pcie" and on_gpu.step_s == pytest.approx(on_gpu.link_s)
    on_cores = pl.predict_placed(pl.Placement(gpu=0, ram=8e9, streamed=0), **rates,
                                    state_bytes=4, commit_every=100)
    assert on_cores.step_s == pytest.approx(8e9 / 3e9) and on_cores.step_s > on_gpu.step_s
