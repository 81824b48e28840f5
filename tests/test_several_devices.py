"""A Pipeline over N devices: bit-for-bit the single-device result, placement by bytes,
resume, refused device lists, and the host-link / storage bandwidth caps."""
import os
import time
import zlib

import numpy as np
import pytest
import torch

import smartinf
from smartinf.pipeline.compress import TopK

SIZES = [4000, 1000, 1000, 1000, 1000, 2500, 7, 1500]
CHUNK = 1000
RULE = smartinf.AdamW(lr=1e-2, weight_decay=0.1)


def dirs_in(root, n):
    return [str(root / f"dev{i}") for i in range(n)]


def train(dirs, steps, *, first_step=0, sizes=SIZES, reopen=False, compress_sg=None):
    """Runs `steps` steps (grads seeded by step number); returns per-step outputs and the
    final stored states."""
    rng = np.random.default_rng(0)
    inits = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    outs_per_step = []
    with smartinf.Pipeline(dirs, RULE, chunk=CHUNK, slots=2) as pipe:
        for x in inits:
            pipe.add_subgroup(x.size, init=x)
        assert all(pipe.resumed(i) for i in range(len(sizes))) == reopen
        for step in range(first_step, first_step + steps):
            g_rng = np.random.default_rng(100 + step)
            outs = [np.empty(n, np.float16) for n in sizes]
            with pipe.step():
                for i, n in enumerate(sizes):
                    g = g_rng.standard_normal(n).astype(np.float32)
                    if i == compress_sg:
                        g = TopK(0.1).compress(torch.from_numpy(g))
                    pipe.update(i, g, outs[i])
            outs_per_step.append(outs)
        states = [pipe.read_states(i) for i in range(len(sizes))]
        return outs_per_step, states, pipe.device_stats, pipe.stats


def assert_identical(a, b):
    outs_a, states_a = a[:2]
    outs_b, states_b = b[:2]
    for step, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        for i, (x, y) in enumerate(zip(oa, ob)):
            assert np.array_equal(x, y), f"params of sub-group {i} differ at step {step}"
    for i, (sa, sb) in enumerate(zip(states_a, states_b)):
        for name in sa:
            assert np.array_equal(sa[name], sb[name]), f"{name} of sub-group {i} differs"


def timed_step(pipe, sizes, out_dtype, stats):
    """Sub-groups of ``sizes`` added and one step of ones as gradients: the ``stats()`` before,
    the step's seconds, the ``stats()`` after."""
    for n in sizes:
        pipe.add_subgroup(n)
    before = stats()
    start = time.perf_counter()
    with pipe.step():
        for i, n in enumerate(sizes):
            pipe.update(i, np.ones(n, np.float32), np.empty(n, out_dtype))
    return before, time.perf_counter() - start, stats()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_n_devices_equal_one_bit_for_bit(disk_dir, tmp_path, n):
    import pathlib
    one = train(dirs_in(pathlib.Path(disk_dir) / "one", 1), 3, compress_sg=2)
    many = train(dirs_in(tmp_path / "many", n), 3, compress_sg=2)
    assert_identical(one, many)
    per_device, total = many[2], many[3]
    assert len(per_device) == n
    assert all(d["numel"] > 0 for d in per_device)  # every device got work
    for key in ("storage_read", "storage_write", "host_to_device", "device_to_host", "chunks"):
        assert sum(d[key] for d in per_device) == total[key]


def test_placement_is_balanced_by_bytes_not_by_count(tmp_path):
    """4000 + 4 x 1000 params on 2 devices: the big one alone on one device, the four small
    ones on the other (round-robin by id would put 6000 on one and 2000 on the other)."""
    per_device = train(dirs_in(tmp_path, 2), 1, sizes=[4000, 1000, 1000, 1000, 1000])[2]
    assert [d["numel"] for d in per_device] == [4000, 4000]
    # Each device moved exactly its own params: in, the fp32 init and the fp32 gradient;
    # out, the fp16 params and the 3 fp32 states read back at the end.
    for d in per_device:
        assert d["storage_read"] >= 24 * d["numel"]  # the update + the final read_states
        assert d["host_to_device"] == (4 + 4) * d["numel"]
        assert d["device_to_host"] == (2 + 12) * d["numel"]


def test_resume_continues_bit_for_bit(tmp_path):
    straight = train(dirs_in(tmp_path / "straight", 3), 4)
    dirs = dirs_in(tmp_path / "resumed", 3)
    first = train(dirs, 2)
    second = train(dirs, 2, first_step=2, reopen=True)
    assert_identical(straight, (first[0] + second[0], second[1]))


def manifests(dirs):
    return [open(os.path.join(d, "manifest"), "rb").read() for d in dirs]


def test_other_device_lists_are_refused_and_change_nothing(tmp_path):
    dirs = dirs_in(tmp_path / "a", 3)
    train(dirs, 1)
    before = manifests(dirs)
    other = dirs_in(tmp_path / "b", 2)
    train(other, 1)
    cases = [
        (dirs[::-1], "device 2 \\(from 0\\) of a pipeline of 3, but was passed as device 0"),
        (dirs[:2], "of a pipeline of 3, but was passed as device 0 of 2"),
        (dirs + [str(tmp_path / "new")], "of a pipeline of 3, but was passed as device 0 of 4"),
        ([dirs[0], str(tmp_path / "new"), dirs[2]], "holds no states.*a directory is missing or was replaced"),
        ([dirs[0], other[1], dirs[2]], "belong to different pipelines"),
    ]
    for devices, match in cases:
        with pytest.raises(ValueError, match=match):
            smartinf.Pipeline(devices, RULE, chunk=CHUNK)
    assert manifests(dirs) == before
    assert not os.path.exists(tmp_path / "new" / "manifest")
    train(dirs, 1, first_step=1, reopen=True)  # the right list still opens


def test_version_2_manifest_without_membership_opens(tmp_path):
    """Directories made before membership was recorded open, and get it recorded."""
    dirs = dirs_in(tmp_path, 2)
    straight = train(dirs_in(tmp_path / "straight", 2), 2)
    train(dirs, 1)
    for d in dirs:
        path = os.path.join(d, "manifest")
        lines = open(path).read().splitlines()
        body = "".join(line + "\n" for line in lines[:-1]
                       if not line.startswith(("member ", "sums ", "attached ", "fingerprint ",
                                               "previous ", "master ", "copies "))
                       ).replace("smartinf-manifest 10", "smartinf-manifest 2")
        assert body.startswith("smartinf-manifest 2\n")
        with open(path, "w") as f:
            f.write(body + f"crc32 {zlib.crc32(body.encode()):08x}\n")
    second = train(dirs, 1, first_step=1, reopen=True)
    assert_identical((straight[0][1:], straight[1]), second)
    assert all(b"\nmember " in m for m in manifests(dirs))


def test_host_link_cap_paces_both_directions_over_all_devices(tmp_path):
    """20 MB/s shared: 1.2 MB of fp32 gradients in over two devices takes >= 60 ms, and
    the 0.6 MB of fp16 params out >= 30 ms, overlapping with it."""
    sizes = [150_000, 150_000]
    rate = 20e6
    with smartinf.Pipeline(dirs_in(tmp_path, 2), RULE, chunk=50_000,
                           host_link_gbps=rate / 1e9) as pipe:
        before, elapsed, after = timed_step(pipe, sizes, np.float16, lambda: pipe.stats)
    moved_in = after["host_to_device"] - before["host_to_device"]
    assert moved_in == 4 * sum(sizes)
    # The limiter lets no more than one chunk through ahead of the rate.
    assert elapsed >= (moved_in - 4 * 50_000) / rate
    assert after["wait_host_link"] > 0
    assert pipe.device_stats[0]["wait_host_link"] > 0 and pipe.device_stats[1]["wait_host_link"] > 0


def test_storage_cap_paces_each_device_on_its_own(tmp_path):
    """Each device's storage at 24 MB/s: 2 x 600 KB read + written per device take
    >= 50 ms on each, in parallel (the caps are per device, not shared)."""
    sizes = [50_000, 50_000]
    rate = 24e6
    devices = [smartinf.CpuDevice(d, storage_gbps=rate / 1e9) for d in dirs_in(tmp_path, 2)]
    with smartinf.Pipeline(devices, RULE, chunk=10_000) as pipe:
        before, elapsed, after = timed_step(pipe, sizes, np.float32, lambda: pipe.device_stats)
    for d, b in zip(after, before):
        moved = d["storage_read"] + d["storage_write"] - b["storage_read"] - b["storage_write"]
        assert moved >= 24 * 50_000
        assert d["wait_storage"] > 0
        assert elapsed >= (moved - 2 * 12 * 10_000) / rate  # minus the first read and write


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(host_link_gbps=0), ValueError, "positive finite"),
    (dict(host_link_gbps=-1.0), ValueError, "positive finite"),
    (dict(host_link_gbps=float("nan")), ValueError, "positive finite"),
    (dict(host_link_gbps="fast"), TypeError, "number of GB/s"),
])
def test_bad_host_link(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        smartinf.Pipeline(str(tmp_path), **kwargs)


def test_host_link_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SMARTINF_HOST_LINK_GBPS", "fast")
    with pytest.raises(ValueError, match="SMARTINF_HOST_LINK_GBPS='fast' is not a number"):
        smartinf.Pipeline(str(tmp_path / "a"))
    monkeypatch.setenv("SMARTINF_HOST_LINK_GBPS", "-2")
    with pytest.raises(ValueError, match="must be a positive number"):
        smartinf.Pipeline(str(tmp_path / "a"))
    monkeypatch.setenv("SMARTINF_HOST_LINK_GBPS", "0.01")  # 10 MB/s: 400 KB take >= 30 ms
    with smartinf.Pipeline(str(tmp_path / "b"), chunk=10_000) as pipe:
        pipe.add_subgroup(100_000)
        start = time.perf_counter()
        with pipe.step():
            pipe.update(0, np.ones(100_000, np.float32), np.empty(100_000, np.float32))
        assert time.perf_counter() - start >= 0.03
        assert pipe.stats["wait_host_link"] > 0


@pytest.mark.parametrize("value, error", [(0, ValueError), (float("inf"), ValueError),
                                          (True, TypeError), ("1", TypeError)])
def test_bad_storage_cap(tmp_path, value, error):
    with pytest.raises(error, match="storage_gbps"):
        smartinf.CpuDevice(str(tmp_path), storage_gbps=value)


def test_a_slow_device_does_not_hold_up_the_others(tmp_path):
    """Device 0 crawls (5 MB/s): queuing its 20 chunks returns at once, and device 1's
    sub-group is done while device 0 has done only a few of them."""
    slow = smartinf.CpuDevice(str(tmp_path / "slow"), storage_gbps=0.005)
    with smartinf.Pipeline([slow, str(tmp_path / "fast")], RULE, chunk=10_000, slots=2) as pipe:
        pipe.add_subgroup(200_000, init=np.zeros(200_000, np.float32))  # on the slow device
        pipe.add_subgroup(200_000)  # on the fast one
        assert [d["numel"] for d in pipe.device_stats] == [200_000, 200_000]
        before = pipe.device_stats[0]["chunks"]
        on_slow = pipe.update(0, np.ones(200_000, np.float32), np.empty(200_000, np.float32))
        on_fast = pipe.update(1, np.ones(200_000, np.float32), np.empty(200_000, np.float32))
        on_fast.wait()
        assert pipe.device_stats[0]["chunks"] - before <= 10  # 48 ms per chunk on the slow one
        assert not on_slow.done()
        pipe.discard()
