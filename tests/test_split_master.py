"""A split fp32 master for bf16 params (master="split"): the devices keep each master's low
16 bits, the params are the high ones. Training with it gives the same bits as with fp32
masters (params, masters, states) for every rule, state dtype, tier and device count; params
that come back other than emitted are taken as the masters with a warning; the bytes stored
are the layout's; directories keep their master format; the front-ends work unchanged."""
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import smartinf
from conftest import step_traffic_per_param
import smartinf.optim as so
from smartinf.pipeline.compress import TopK
from smartinf.pipeline.pipeline import ParamsChangedWarning
from smartinf.step.rounding import to_bf16

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples.gpt
from examples.gpt.data import Language, batches  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

CHUNK = 5000  # two full chunks and a partial one below: pieces, blocks and tiles cut across


def bits(x) -> np.ndarray:
    x = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(x).view(np.uint32 if x.dtype == np.float32 else np.uint16)


def run(directory, master, *, rule=None, steps=12, numel=12_345, seed=0, sizes=None,
        edit_at=None, **settings):
    """Trains sub-groups of ``sizes`` bf16 params from the same init and gradients; returns
    the params and every state (the masters rebuilt from the params with a split master)."""
    sizes = sizes or [numel]
    rng = np.random.default_rng(seed)
    pipe = smartinf.Pipeline(directory, rule or smartinf.AdamW(lr=1e-2, weight_decay=0.1),
                             chunk=CHUNK, master=master, **settings)
    params = []
    for n in sizes:
        init = to_bf16(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
        pipe.add_subgroup(n, init.float())
        params.append(init.clone())
    for step in range(steps):
        if edit_at == step:
            params[0][CHUNK + 7] += 1.0  # one param of the second chunk edited in the model
        with pipe.step():
            futures = []
            for sg, n in enumerate(sizes):
                grad = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
                futures.append(pipe.update(sg, grad, params[sg]))
            for f in futures:
                f.wait()
    states = [pipe.read_states(sg, params=params[sg]) if master == "split"
              else pipe.read_states(sg) for sg in range(len(sizes))]
    stats = pipe.stats
    pipe.close()
    return params, states, stats


def assert_same_bits(a, b):
    (pa, sa, _), (pb, sb, _) = a, b
    for x, y in zip(pa, pb):
        assert np.array_equal(bits(x.view(torch.int16)), bits(y.view(torch.int16)))
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(bits(x[k]), bits(y[k])), k


def test_bf16_rounds_to_nearest_ties_away_from_zero_on_both_sides(disk_dir):
    """The devices' bf16 rounding and smartinf.step.rounding.to_bf16 agree on every class of value,
    and differ from torch's nearest-even exactly at the ties it rounds towards zero."""
    rng = np.random.default_rng(1)
    high = rng.integers(0, 1 << 16, 4000).astype(np.uint32)
    low = np.concatenate([np.full(1000, 0x8000), rng.integers(0, 1 << 16, 3000)]).astype(np.uint32)
    x = ((high << 16) | low).view(np.float32)
    x = x[np.isfinite(x)]
    x = np.concatenate([x, np.float32([0.0, -0.0, 3.4028235e38, -3.4028235e38,  # these round to inf
                                       np.float32(1.0) + np.float32(2 ** -8)])])
    with smartinf.Pipeline(disk_dir, smartinf.SGD(lr=0.0), chunk=CHUNK) as pipe:
        pipe.add_subgroup(len(x), x)
        out = torch.empty(len(x), dtype=torch.bfloat16)
        with pipe.step():
            pipe.update(0, np.zeros(len(x), np.float32), out).wait()
    ours = to_bf16(torch.from_numpy(x))
    assert torch.equal(out.view(torch.int16), ours.view(torch.int16))
    nearest_even = torch.from_numpy(x).to(torch.bfloat16)
    differ = (ours.view(torch.int16) != nearest_even.view(torch.int16)).numpy()
    tie = (x.view(np.uint32) & 0xFFFF) == 0x8000
    assert differ.any() and np.all(tie[differ])  # only ties, and some of them
    special = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert torch.isnan(to_bf16(special[:1])).all() and torch.isinf(to_bf16(special[1:])).all()


@pytest.mark.parametrize("rule", [
    smartinf.AdamW(lr=1e-2, weight_decay=0.1),
    smartinf.Adam(lr=3e-3, betas=(0.4, 0.99), weight_decay=0.05, amsgrad=True),
    smartinf.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    smartinf.Adagrad(lr=0.05),
    smartinf.Lion(lr=1e-3, weight_decay=0.1, maximize=True),
], ids=lambda r: r.name)
def test_a_split_master_trains_bit_for_bit_as_an_fp32_one(tmp_path, rule):
    assert_same_bits(run(tmp_path / "fp32", "fp32", rule=rule),
                     run(tmp_path / "split", "split", rule=rule))


@pytest.mark.parametrize("settings", [
    dict(state_dtype="int8"),
    dict(state_dtype="int4"),
    dict(compute_threads=2),
    dict(memory_budget=200_000, commit_every=3),  # half the sub-groups resident
    # all resident with their twins: the first update after a background commit starts from
    # the twin (the kernel copies the states; the params checksum comes before it)
    dict(memory_budget="1MiB", commit_every=3),
    dict(state_dtype="int8", memory_budget="1MiB", commit_every=2),
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_split_masters_with_quantized_moments_tiers_and_threads(tmp_path, settings):
    kw = dict(sizes=[12_345, 9_000], steps=10, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checksum read from the wrong copy warns of edits
        fp32, split = run(tmp_path / "fp32", "fp32", **kw), run(tmp_path / "split", "split", **kw)
    assert_same_bits(fp32, split)
    if settings.get("memory_budget") == "1MiB":
        assert split[2]["twin_copies"] > 0 and split[2]["background_commits"] > 0


def test_two_devices_and_topk_gradients(tmp_path):
    def two(name):
        return [tmp_path / name / "a", tmp_path / name / "b"]
    rule = smartinf.AdamW(lr=1e-2)
    a = run(two("fp32"), "fp32", rule=rule, sizes=[7000, 6000, 5000])
    b = run(two("split"), "split", rule=rule, sizes=[7000, 6000, 5000])
    assert_same_bits(a, b)
    numel = 12_345
    compressor = TopK(0.1)
    for master in ("fp32", "split"):
        with smartinf.Pipeline(tmp_path / f"topk-{master}", rule, chunk=CHUNK, master=master) as pipe:
            pipe.add_subgroup(numel, torch.ones(numel))
            out = torch.ones(numel, dtype=torch.bfloat16)
            g = torch.Generator().manual_seed(3)
            for _ in range(5):
                c = compressor.compress(torch.randn(numel, generator=g).to(torch.bfloat16))
                with pipe.step():
                    pipe.update(0, c, out).wait()
            if master == "fp32":
                expected = out.clone()
            else:
                assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_the_split_master_stores_two_bytes_per_param(tmp_path):
    """Storage bytes per step: fp32 AdamW 24 B per param; with a split master 20; int8
    moments 12.06 and with the split master 8.06 (4x less than ZeRO-Infinity's 32); 4-bit
    ones with it ~6.2. Plus 2 B per param host -> device (the params sent in)."""
    numel, chunk = 1 << 20, 1 << 18
    expected = {("fp32", "fp32"): 24, ("fp32", "split"): 20, ("int8", "fp32"): 12.06,
                ("int8", "split"): 8.06, ("int4", "split"): 6.19}
    for (dtype, master), per_param in expected.items():
        t = step_traffic_per_param(tmp_path / f"{dtype}-{master}", smartinf.AdamW(), numel,
                                   torch.zeros(numel, dtype=torch.bfloat16),
                                   torch.zeros(numel, dtype=torch.bfloat16), chunk=chunk,
                                   master=master, state_dtype=dtype)
        moved = t["storage_read"] + t["storage_write"]
        assert abs(moved - per_param) < 0.05, (dtype, master, moved)  # + 4 KiB alignment
        assert t["host_to_device"] == (4 if master == "split" else 2)  # bf16 gradient (+ params)


def test_params_changed_since_emitted_become_the_masters_with_a_warning(tmp_path):
    """An edited param (weights loaded, a param changed by hand) is noticed by its chunk's
    checksum: that chunk's params are taken as the masters, as they are; the other chunks
    keep their exact masters."""
    with pytest.warns(ParamsChangedWarning, match=r"sub-groups \[0\] \(1 chunks\)"):
        split = run(tmp_path / "split", "split", edit_at=4, steps=8)
    fp32 = run(tmp_path / "fp32", "fp32", edit_at=4, steps=8)
    (ps, ss, _), (pf, sf, _) = split, fp32
    lo, hi = CHUNK, 2 * CHUNK  # the edited chunk: its masters restarted from the params
    for k in ss[0]:
        same = bits(ss[0][k]) == bits(sf[0][k])
        assert same[:lo].all() and same[hi:].all(), k
        if k == "param":  # fp32 masters ignore the edit; the split one took it
            assert not same[lo:hi].all()
    assert ps[0][CHUNK + 7] != pf[0][CHUNK + 7]
    # taken as the master: after the edit the chunk trains from the edited params
    assert abs(float(ps[0][CHUNK + 7]) - float(pf[0][CHUNK + 7]) - 1.0) < 0.1


def test_directories_keep_their_master_format(disk_dir):
    numel = 3000
    with smartinf.Pipeline(disk_dir, smartinf.AdamW(), chunk=CHUNK, master="split") as pipe:
        pipe.add_subgroup(numel, torch.ones(numel))
        with pytest.raises(ValueError, match="bfloat16 params; sub-group 0's params are not bfloat16"):
            pipe.update(0, np.zeros(numel, np.float32), np.zeros(numel, np.float32))
        with pytest.raises(KeyError):
            pipe.read_states(0)["param"]  # the masters need the params
    with pytest.raises(ValueError, match="made with master split, not fp32"):
        smartinf.Pipeline(disk_dir, smartinf.AdamW(), chunk=CHUNK)
    with smartinf.Pipeline(disk_dir, smartinf.AdamW(), chunk=CHUNK, master="split") as pipe:
        pipe.add_subgroup(numel)
        params = torch.ones(numel, dtype=torch.bfloat16)
        assert np.array_equal(pipe.read_states(0, params=params)["param"], np.ones(numel, np.float32))
    manifest = (Path(disk_dir) / "manifest").read_text()
    assert "\nmaster split\n" in manifest
    with pytest.raises(ValueError, match="master='maybe'"):
        smartinf.Pipeline(disk_dir, smartinf.AdamW(), master="maybe")


def test_write_states_splits_the_masters_it_is_given(disk_dir):
    """load_state_dict's path: fp32 masters written are split; the params to send are the
    masters rounded (to_bf16), and they rebuild the masters exactly."""
    numel = 4000
    master = np.random.default_rng(2).standard_normal(numel).astype(np.float32)
    with smartinf.Pipeline(disk_dir, smartinf.AdamW(), chunk=CHUNK, master="split") as pipe:
        pipe.add_subgroup(numel)
        with pipe.step():
            pipe.write_states(0, {"param": master}, steps=5)
        params = to_bf16(torch.from_numpy(master))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ParamsChangedWarning)
            got = pipe.read_states(0, params=params)["param"]
        assert np.array_equal(bits(got), bits(master))
        with pytest.warns(ParamsChangedWarning):  # other params: taken as the masters
            other = params.clone()
            other[0] = -other[0]
            pipe.read_states(0, params=other)


def gpt_run(tmp_path, name, master, steps, state_dtype="fp32"):
    lang = Language()
    model = GPT(GPTConfig(lang.vocab_size, 32, 64, 2, 4), seed=0).to(torch.bfloat16)
    opt = so.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, devices=[tmp_path / name],
                   master=master, state_dtype=state_dtype, max_grad_norm=1.0,
                   subgroup_size=20_000)
    losses, data = [], batches(lang, 4, 32, 0)
    for x, y in (next(data) for _ in range(steps)):
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_the_demo_gpt_in_bf16_trains_bit_for_bit_through_smartinf_optim(tmp_path, state_dtype):
    """120 steps of the demo GPT in bf16 (smartinf.optim.AdamW, clipping, several sub-groups):
    losses, params and the exported states (state_dict, fp32 masters included) are the same
    bits with the split master as with fp32 masters."""
    mf, of, lf = gpt_run(tmp_path, "fp32", "fp32", 120, state_dtype)
    ms, os_, ls = gpt_run(tmp_path, "split", "split", 120, state_dtype)
    assert lf == ls and lf[-1] < lf[0]
    for a, b in zip(mf.parameters(), ms.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    sf, ss = of.state_dict()["state"], os_.state_dict()["state"]
    assert sf.keys() == ss.keys()
    for i in sf:
        for k in ("exp_avg", "exp_avg_sq", "fp32_master"):
            assert torch.equal(sf[i][k].view(torch.int32), ss[i][k].view(torch.int32)), (i, k)
    # the exported masters are torch's format: load them into a fresh split optimizer
    model2 = GPT(GPTConfig(Language().vocab_size, 32, 64, 2, 4), seed=1).to(torch.bfloat16)
    model2.load_state_dict(ms.state_dict())
    opt2 = so.AdamW(model2.parameters(), lr=3e-3, weight_decay=0.1, devices=[tmp_path / "again"],
                    master="split", state_dtype=state_dtype, subgroup_size=20_000)
    opt2.load_state_dict(os_.state_dict())
    s2 = opt2.state_dict()["state"]
    for i in ss:
        assert torch.equal(ss[i]["fp32_master"].view(torch.int32), s2[i]["fp32_master"].view(torch.int32))
    for o in (of, os_, opt2):
        o.close()


def test_smartinf_optim_refuses_a_split_master_for_other_dtypes(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="this model also has torch.float32 params"):
        so.AdamW(model.parameters(), devices=[tmp_path], master="split")


def test_weights_loaded_into_the_model_after_a_step_are_taken_with_a_warning(tmp_path):
    model, opt, _ = gpt_run(tmp_path, "split", "split", 3)
    other = GPT(GPTConfig(Language().vocab_size, 32, 64, 2, 4), seed=5).to(torch.bfloat16)
    model.load_state_dict(other.state_dict())
    x, y = next(batches(Language(), 4, 32, 1))
    torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
    with pytest.warns(ParamsChangedWarning):
        opt.step()
    masters = opt.state_dict()["state"]
    # the masters continue from the loaded weights: one AdamW step away from them
    for p, q in zip(model.parameters(), other.parameters()):
        assert (p.float() - q.float()).abs().max() < 0.05
    assert masters
    opt.close()


def _legacy_sums(directory: Path, params: torch.Tensor) -> int:
    """Rewrites the stored params checksums of a directory's single sub-group to the
    definition directories had before the pieces (XXH3 of each chunk's whole bytes), with the
    chunks' extent checksums made unknown (0) so that the bytes changed are not refused:
    as a directory written by an earlier version reads. Returns how many were rewritten."""
    import re
    import zlib
    from smartinf import _native
    flat = params.contiguous().view(torch.int16).numpy()
    data = bytearray((directory / "states.bin").read_bytes())
    rewritten = 0
    for lo in range(0, flat.size, CHUNK):
        chunk = flat[lo:lo + CHUNK]
        pieces = np.array([_native.checksum(chunk[i:].ctypes.data, min(1 << 14, chunk.size - i) * 2)
                           for i in range(0, chunk.size, 1 << 14)], np.uint64)
        new = _native.checksum(pieces.ctypes.data, pieces.nbytes).to_bytes(8, "little")
        old = _native.checksum(chunk.ctypes.data, chunk.nbytes).to_bytes(8, "little")
        at = data.find(new)
        assert at >= 0 and data.find(new, at + 1) < 0  # the committed extent's, once
        data[at:at + 8] = old
        rewritten += 1
    (directory / "states.bin").write_bytes(bytes(data))
    path = directory / "manifest"
    text = path.read_bytes()
    body = text[:text.rindex(b"crc32 ")]
    body = re.sub(rb"^(sums \d+ \d+)((?: [0-9a-f]+)+)$",
                  lambda m: m.group(1) + b" %016x" % 0 * len(m.group(2).split()), body, flags=re.M)
    path.write_bytes(body + b"crc32 %08x\n" % zlib.crc32(body))
    return rewritten


def test_directories_with_whole_chunk_params_checksums_resume_without_adopting(tmp_path):
    """The params checksum is now the XXH3 of its pieces' XXH3s (hashed by the update's
    threads); a directory written before holds each chunk's whole-bytes XXH3: its params
    are not taken for edited ones at the next step (no warning, no chunk adopted), and the
    run continues bit for bit as one that never changed definition."""
    def two_runs(directory: Path, legacy: bool):
        rng = np.random.default_rng(3)
        init = to_bf16(torch.from_numpy(rng.standard_normal(12_345).astype(np.float32)))
        params = init.clone()
        grads = [torch.from_numpy(rng.standard_normal(12_345).astype(np.float32)).to(torch.bfloat16)
                 for _ in range(2)]
        rule = smartinf.AdamW(lr=1e-2, weight_decay=0.1)
        with smartinf.Pipeline(directory, rule, chunk=CHUNK, master="split") as pipe:
            pipe.add_subgroup(12_345, init.float())
            with pipe.step():
                pipe.update(0, grads[0], params).wait()
        if legacy:
            assert _legacy_sums(directory, params) == 3
        with warnings.catch_warnings():
            warnings.simplefilter("error", ParamsChangedWarning)
            with smartinf.Pipeline(directory, rule, chunk=CHUNK, master="split") as pipe:
                pipe.add_subgroup(12_345)
                with pipe.step():
                    pipe.update(0, grads[1], params).wait()
                stats = pipe.stats
        return params, stats
    legacy, stats = two_runs(tmp_path / "legacy", True)
    plain, _ = two_runs(tmp_path / "plain", False)
    assert stats.get("foreign_chunks", 0) == 0
    assert torch.equal(legacy.view(torch.int16), plain.view(torch.int16))


def test_a_resumed_split_master_refuses_params_other_than_its_steps(tmp_path):
    """The directories hold the masters' low halves: the first step after a resume with
    params other than the ones its last step emitted (a model built afresh, weights not
    loaded) is discarded and refused before it commits; with the right ones it goes on."""
    params, _, _ = run(tmp_path, "split", steps=3)
    emitted = params[0]
    fresh = to_bf16(torch.from_numpy(np.random.default_rng(0).standard_normal(12_345).astype(np.float32)))
    grad = torch.ones(12_345, dtype=torch.bfloat16)
    with smartinf.Pipeline(tmp_path, smartinf.AdamW(lr=1e-2, weight_decay=0.1), chunk=CHUNK,
                           master="split") as pipe:
        pipe.add_subgroup(12_345)
        with pytest.raises(ValueError, match=r"sub-groups \[0\] were resumed from .* at step 3"):
            with pipe.step():
                pipe.update(0, grad, fresh.clone()).wait()
        assert pipe.step_count == 3  # nothing committed
    with smartinf.Pipeline(tmp_path, smartinf.AdamW(lr=1e-2, weight_decay=0.1), chunk=CHUNK,
                           master="split") as pipe:
        pipe.add_subgroup(12_345)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ParamsChangedWarning)
            with pipe.step():
                pipe.update(0, grad, emitted.clone()).wait()
        assert pipe.step_count == 4


def test_xxh3_by_lanes_is_libxxhash(tmp_path):
    """The lane-by-lane XXH3 a GPU hashes a split master's params with (store/xxh3_lanes.h,
    compiled here for the host) gives libxxhash's value for every long input."""
    import shutil
    import subprocess
    root = Path(__file__).resolve().parents[1]
    cxx = shutil.which("g++") or pytest.skip("no C++ compiler here")
    exe = tmp_path / "xxh3_lanes_match"
    built = subprocess.run([cxx, "-std=c++17", "-O2", f"-I{root / 'src' / 'native'}",
                            f"-I{root / 'third_party' / 'xxhash'}", "-DXXH_INLINE_ALL",
                            str(root / "tests" / "native" / "xxh3_lanes_match.cc"),
                            "-o", str(exe)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout[-4000:]
    assert ran.stdout.strip().endswith(", 0 differ")
    assert int(ran.stdout.split()[-4]) > 5000  # cases run
