"""Pipeline against torch.optim, resume, shadow-copy safety, counters and bad input."""
import hashlib
import os
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest
import torch

import smartinf
from smartinf.pipeline.compress import Compressed, TopK, decompress
from smartinf.step.rounding import round_to
from conftest import ENGINES, TorchReference, assert_close_fp32

SIZES = [2500, 1000, 7, 3001]  # not multiples of the chunk, a full chunk, a tiny one
CHUNK = 1000


def make(rng, sizes=SIZES):
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


def grads_for(rng, sizes=SIZES):
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


def run_steps(pipe, ref, rng, steps, sizes=SIZES, out_dtype=np.float32, lr=None):
    outs = [np.empty(n, out_dtype) for n in sizes]
    for _ in range(steps):
        grads = grads_for(rng, sizes)
        with pipe.step():
            futures = [pipe.update(i, g, o, lr=lr) for i, (g, o) in enumerate(zip(grads, outs))]
        assert all(f.done() for f in futures)
        ref.step(grads, lr=lr)
    return outs


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize("rule", [smartinf.AdamW(lr=1e-2, weight_decay=0.1),
                                  smartinf.Adam(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)],
                         ids=["adamw", "adam"])
def test_matches_torch(disk_dir, engine, slots, rule):
    rng = np.random.default_rng(slots)
    inits = make(rng)
    ref = TorchReference(inits, rule)
    with smartinf.Pipeline(disk_dir, rule, slots=slots, chunk=CHUNK, io=engine) as pipe:
        assert pipe.engine == engine
        for x in inits:
            pipe.add_subgroup(x.size, init=x)
        outs = run_steps(pipe, ref, rng, steps=6)
        for i in range(len(SIZES)):
            expected = ref.states(i)
            assert_close_fp32(outs[i], expected["param"], f"out of sub-group {i}")
            stored = pipe.read_states(i)
            for name in ("param", "exp_avg", "exp_avg_sq"):
                assert_close_fp32(stored[name], expected[name], f"{name} of sub-group {i}")
            assert pipe.subgroup_steps(i) == 6
        assert pipe.step_count == 6


def test_several_devices_and_lr_schedule(tmp_path):
    rng = np.random.default_rng(7)
    rule = smartinf.AdamW(lr=3e-2)
    inits = make(rng)
    ref = TorchReference(inits, rule)
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    with smartinf.Pipeline(dirs, rule, chunk=CHUNK, slots=2) as pipe:
        for x in inits:
            pipe.add_subgroup(x.size, init=x)
        for lr in (3e-2, 1e-2, 5e-3):
            outs = run_steps(pipe, ref, rng, steps=1, lr=lr)
        for i, out in enumerate(outs):
            assert_close_fp32(out, ref.states(i)["param"], f"sub-group {i}")
    # Both directories hold sub-groups (balanced by size).
    for d in dirs:
        assert os.path.getsize(os.path.join(d, "states.bin")) > 0


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_grads_and_params(disk_dir, grad_dtype, out_dtype):
    """fp16/bf16 gradients are widened exactly; params out equal torch's fp32 result cast."""
    rng = np.random.default_rng(3)
    inits = make(rng)
    rule = smartinf.AdamW(lr=1e-2)
    ref = TorchReference(inits, rule)
    outs = [torch.empty(n, dtype=out_dtype) for n in SIZES]
    with smartinf.Pipeline(disk_dir, rule, chunk=CHUNK, param_dtype=out_dtype) as pipe:
        for x in inits:
            pipe.add_subgroup(x.size, init=torch.from_numpy(x))
        for _ in range(3):
            grads = [torch.from_numpy(g).to(grad_dtype) for g in grads_for(rng)]
            with pipe.step():
                for i, (g, o) in enumerate(zip(grads, outs)):
                    pipe.update(i, g, o)
            ref.step([g.float().numpy() for g in grads])
        for i, out in enumerate(outs):
            expected = torch.from_numpy(ref.states(i)["param"])
            stored = torch.from_numpy(pipe.read_states(i)["param"])
            assert_close_fp32(stored.numpy(), expected.numpy(), f"master of sub-group {i}")
            # The cast of our fp32 master is exact (bf16: ties away from zero, smartinf.step.rounding);
            # against torch's it is within one ulp.
            assert torch.equal(out, round_to(stored, out_dtype))
            ulp = (expected.to(out_dtype).float() - out.float()).abs()
            spacing = torch.finfo(out_dtype).eps * expected.abs().clamp_min(torch.finfo(out_dtype).tiny)
            assert torch.all(ulp <= spacing), f"sub-group {i} differs by more than one ulp"


def test_fp16_conversions_match_torch(disk_dir):
    """Every fp16 value widens as torch does; fp32 -> fp16 rounds to nearest even, as torch;
    fp32 -> bf16 to nearest, ties away from zero (the split master's rule), as
    smartinf.step.rounding.to_bf16, which differs from torch only at ties."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)]
    rng = np.random.default_rng(0)
    # Values around every fp16 binade, ties, subnormals, overflow, and specials.
    floats = np.concatenate([
        finite.astype(np.float32),
        (finite.astype(np.float32) * np.float32(1 + 2 ** -11)),  # exact ties
        rng.standard_normal(20000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 20, 20000),
        np.array([65504, 65520, 65519.99, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 0.0, -0.0,
                  np.inf, -np.inf], np.float32),
    ]).astype(np.float32)
    # lr = 0 and zero grads: the kernel passes the master through, so out = cast(init).
    rule = smartinf.AdamW(lr=0.0, weight_decay=0.0)
    with smartinf.Pipeline(disk_dir, rule, chunk=1 << 16) as pipe:
        sg = pipe.add_subgroup(floats.size, init=floats)
        zeros = np.zeros(floats.size, np.float32)
        for dtype in (torch.float16, torch.bfloat16):
            out = torch.empty(floats.size, dtype=dtype)
            pipe.update(sg, zeros, out).wait()
            pipe.discard()
            expected = round_to(torch.from_numpy(floats), dtype)
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), dtype
            if dtype == torch.bfloat16:
                differ = out.view(torch.int16) != torch.from_numpy(floats).to(dtype).view(torch.int16)
                assert np.all(floats.view(np.uint32)[differ.numpy()] & 0xFFFF == 0x8000)
        # beta1 = 0 makes exp_avg the widened gradient itself.
        pipe.optimizer = smartinf.AdamW(lr=0.0, betas=(0.0, 0.999), weight_decay=0.0)
        grad = torch.from_numpy(finite.copy())
        sg2 = pipe.add_subgroup(finite.size)
        with pipe.step():
            pipe.update(sg2, grad, np.empty(finite.size, np.float32))
        widened = pipe.read_states(sg2)["exp_avg"]
        # (by value: the moment update turns -0.0 into +0.0, as torch's lerp does)
        assert np.array_equal(widened, grad.float().numpy())


def test_grad_scale_unscales(disk_dir):
    rng = np.random.default_rng(11)
    inits = make(rng, [3000])
    rule = smartinf.Adam(lr=1e-2)
    ref = TorchReference(inits, rule)
    with smartinf.Pipeline(disk_dir, rule, chunk=CHUNK) as pipe:
        pipe.add_subgroup(3000, init=inits[0])
        out = np.empty(3000, np.float32)
        g = rng.standard_normal(3000).astype(np.float32)
        with pipe.step():
            pipe.update(0, g * np.float32(1024.0), out, grad_scale=1 / 1024)
        ref.step([g])
        assert_close_fp32(out, ref.states(0)["param"], "unscaled update")


def test_reopen_continues_identically(disk_dir):
    rng = np.random.default_rng(5)
    inits = make(rng)
    rule = smartinf.AdamW(lr=1e-2, weight_decay=0.1)
    ref = TorchReference(inits, rule)
    with smartinf.Pipeline(disk_dir, rule, chunk=CHUNK, slots=2) as pipe:
        for x in inits:
            pipe.add_subgroup(x.size, init=x)
        run_steps(pipe, ref, rng, steps=3)
    with smartinf.Pipeline(disk_dir, rule, chunk=CHUNK, slots=3) as pipe:
        assert pipe.step_count == 3
        for x in inits:  # same calls as a fresh run: the stored states win over init
            pipe.add_subgroup(x.size, init=np.zeros_like(x))
        outs = run_steps(pipe, ref, rng, steps=3)
        for i, out in enumerate(outs):
            assert pipe.subgroup_steps(i) == 6
            assert_close_fp32(out, ref.states(i)["param"], f"sub-group {i} after reopening")


def test_discarded_step_leaves_committed_state(disk_dir):
    rng = np.random.default_rng(9)
    x = rng.standard_normal(2500).astype(np.float32)
    with smartinf.Pipeline(disk_dir, chunk=CHUNK) as pipe:
        sg = pipe.add_subgroup(x.size, init=x)
        out = np.empty(x.size, np.float32)
        with pytest.raises(RuntimeError, match="boom"):
            with pipe.step():
                pipe.update(sg, np.ones(x.size, np.float32), out).wait()
                assert not np.array_equal(out, x)
                raise RuntimeError("boom")
        assert pipe.step_count == 0 and pipe.subgroup_steps(sg) == 0
        assert np.array_equal(pipe.read_states(sg)["param"], x)
        with pipe.step():  # and the sub-group can be updated again
            pipe.update(sg, np.ones(x.size, np.float32), out)
        assert pipe.subgroup_steps(sg) == 1


def test_a_waited_update_lets_its_buffers_go(disk_dir):
    """Until it is done an update holds its gradient and out alive (the caller may drop
    them); once waited for, not until the step's commit: a step of many sub-groups would
    hold every flat gradient the front-end made."""
    x = np.random.default_rng(3).standard_normal(2500).astype(np.float32)
    with smartinf.Pipeline(disk_dir, chunk=CHUNK) as pipe:
        sgs = [pipe.add_subgroup(x.size, init=x) for _ in range(2)]
        with pipe.step():
            grad, out = torch.ones(x.size), torch.empty(x.size)
            held = weakref.ref(grad), weakref.ref(out)
            future = pipe.update(sgs[0], grad, out)
            del grad, out
            future.wait()
            assert held[0]() is None and held[1]() is None
            pipe.update(sgs[1], torch.ones(x.size), torch.empty(x.size))  # (dropped: held)
        assert [pipe.subgroup_steps(sg) for sg in sgs] == [1, 1]


CRASH = textwrap.dedent("""
    import os, sys, numpy as np, smartinf
    d, steps = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(1)
    inits = [rng.standard_normal(n).astype(np.float32) for n in (2500, 1000, 7)]
    pipe = smartinf.Pipeline(d, smartinf.AdamW(lr=1e-2), chunk=1000, slots=2)
    for x in inits:
        pipe.add_subgroup(x.size, init=x)
    outs = [np.empty(x.size, np.float32) for x in inits]
    for s in range(steps + 1):
        grads = [rng.standard_normal(x.size).astype(np.float32) for x in inits]
        futures = [pipe.update(i, g, o) for i, (g, o) in enumerate(zip(grads, outs))]
        if s == steps:  # die in the middle of the step: write-backs in flight, no commit
            futures[0].wait()
            os.kill(os.getpid(), 9)
        pipe.commit()
""")


def test_killed_mid_step_resumes_from_last_commit(disk_dir, tmp_path):
    # Reference: the same run stopped cleanly after 2 steps.
    clean = str(tmp_path / "clean")
    os.makedirs(clean)
    script = str(tmp_path / "crash.py")
    with open(script, "w") as f:
        f.write(CRASH)
    crashed = subprocess.run([sys.executable, script, disk_dir, "2"])
    assert crashed.returncode == -9
    reference = subprocess.run([sys.executable, script, clean, "2"])
    assert reference.returncode == -9
    with smartinf.Pipeline(disk_dir, smartinf.AdamW(lr=1e-2), chunk=1000) as a, \
            smartinf.Pipeline(clean, smartinf.AdamW(lr=1e-2), chunk=1000) as b:
        assert a.step_count == b.step_count == 2
        for n in (2500, 1000, 7):
            a.add_subgroup(n)
            b.add_subgroup(n)
        for i in range(3):
            sa, sb = a.read_states(i), b.read_states(i)
            assert a.subgroup_steps(i) == 2
            for k in sa:
                assert np.array_equal(sa[k], sb[k])


def test_rolls_back_a_device_committed_ahead(tmp_path, caplog):
    """A crash between two devices' commits: the one ahead is rolled back, data intact."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    rng = np.random.default_rng(2)
    inits = make(rng, [3000, 3000])
    with smartinf.Pipeline(dirs, chunk=CHUNK) as pipe:
        for x in inits:
            pipe.add_subgroup(x.size, init=x)
        run_steps(pipe, TorchReference(inits, pipe.optimizer), rng, 1, [3000, 3000])
        before = [pipe.read_states(i) for i in range(2)]
        old_manifest = open(os.path.join(dirs[1], "manifest"), "rb").read()
        run_steps(pipe, TorchReference(inits, pipe.optimizer), rng, 1, [3000, 3000])
    with open(os.path.join(dirs[1], "manifest"), "wb") as f:  # b never saw step 2's commit
        f.write(old_manifest)
    with caplog.at_level("WARNING", logger="smartinf"):
        with smartinf.Pipeline(dirs, chunk=CHUNK) as pipe:
            assert pipe.step_count == 1
            for x in inits:
                pipe.add_subgroup(x.size)
            for i in range(2):
                assert pipe.subgroup_steps(i) == 1
                for k, v in pipe.read_states(i).items():
                    assert np.array_equal(v, before[i][k])
    assert "rolled back" in caplog.text


def test_counters_match_traffic_model(disk_dir):
    """Storage: 24 B/param per step (+ 4 KiB alignment); host link: grad in + params out."""
    sizes = [1 << 14, 5000]
    chunk = 4096
    with smartinf.Pipeline(disk_dir, chunk=chunk) as pipe:
        for n in sizes:
            pipe.add_subgroup(n)
        before = pipe.stats
        with pipe.step():
            for i, n in enumerate(sizes):
                pipe.update(i, np.zeros(n, np.float16), torch.empty(n, dtype=torch.bfloat16))
        after = pipe.stats
    delta = {k: after[k] - before[k] for k in before}
    numel = sum(sizes)
    aligned = sum(((min(chunk, n - c) * 12 + 4095) // 4096) * 4096
                  for n in sizes for c in range(0, n, chunk))
    assert delta["storage_read"] == delta["storage_write"] == aligned
    assert aligned <= numel * 12 + 4096 * sum(-(-n // chunk) for n in sizes)
    assert delta["host_to_device"] == numel * 2
    assert delta["device_to_host"] == numel * 2
    assert delta["chunks"] == sum(-(-n // chunk) for n in sizes)
    assert delta["step"] == 1
    for stage in ("load", "compute", "device_to_host", "writeback", "host_to_device"):
        assert delta[f"busy_{stage}"] > 0


def test_update_time_waited_for_and_hidden(disk_dir):
    """update_s: wall time with an update in flight (two at once counted once);
    update_wait_s: time a caller waited for one; update_hidden_s the rest. An update waited
    for only once done adds no wait: all of it hidden; one waited for at once (commit, or
    wait()) adds at most as much wait as it runs (waiting counts only while an update runs)."""
    sizes = [1 << 16, 1 << 15]
    grads = [np.full(n, 1e-3, np.float32) for n in sizes]
    outs = [np.empty(n, np.float32) for n in sizes]
    with smartinf.Pipeline(disk_dir, chunk=4096) as pipe:
        for n in sizes:
            pipe.add_subgroup(n)

        def delta(run):
            before = pipe.stats
            run()
            after = pipe.stats
            return {k: after[k] - before[k] for k in ("update_s", "update_wait_s", "update_hidden_s")}

        def not_waited():
            with pipe.step():
                futures = [pipe.update(i, g, o) for i, (g, o) in enumerate(zip(grads, outs))]
                while not all(f.done() for f in futures):
                    time.sleep(1e-3)
        got = delta(not_waited)
        assert got["update_s"] > 0 and got["update_wait_s"] == 0
        assert got["update_hidden_s"] == pytest.approx(got["update_s"])
        got = delta(lambda: [pipe.update(i, g, o).wait() for i, (g, o) in enumerate(zip(grads, outs))]
                    and pipe.commit())
        assert 0 < got["update_wait_s"] <= got["update_s"] and got["update_hidden_s"] >= 0
        assert got["update_wait_s"] + got["update_hidden_s"] == pytest.approx(got["update_s"])


@pytest.mark.parametrize("where", ["shm_dir", "no_direct_dir"])
def test_memory_file_systems(request, where, caplog):
    """tmpfs, and a file system without O_DIRECT (buffered fallback, one warning)."""
    directory = request.getfixturevalue(where)
    rng = np.random.default_rng(4)
    inits = make(rng)
    rule = smartinf.AdamW()
    ref = TorchReference(inits, rule)
    with smartinf.Pipeline(directory, rule, chunk=CHUNK) as pipe:
        for x in inits:
            pipe.add_subgroup(x.size, init=x)
        outs = run_steps(pipe, ref, rng, 2)
        for i, out in enumerate(outs):
            assert_close_fp32(out, ref.states(i)["param"], f"sub-group {i} in {where}")
    fallback = [r for r in caplog.records if "no O_DIRECT" in r.getMessage()]
    if where == "no_direct_dir":
        assert len(fallback) == 1 and directory in fallback[0].getMessage()


def test_memory_is_fixed_by_slots_not_model(disk_dir):
    """RSS grows by the K slots, not with the number of parameters updated."""
    script = textwrap.dedent("""
        import sys, numpy as np, smartinf
        def rss():
            return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
        n, d = int(sys.argv[1]), sys.argv[2]
        grad, out = np.zeros(1 << 20, np.float32), np.empty(1 << 20, np.float16)
        base = rss()
        with smartinf.Pipeline(d, chunk=1 << 18, slots=2) as pipe:
            for _ in range(n):
                pipe.add_subgroup(1 << 20)
            with pipe.step():
                for i in range(n):
                    pipe.update(i, grad, out).wait()
            print(rss() - base)
    """)
    growth = []
    for n, sub in ((4, "small"), (48, "large")):  # 4 Mi vs 48 Mi params
        d = os.path.join(disk_dir, sub)
        os.makedirs(d)
        res = subprocess.run([sys.executable, "-c", script, str(n), d], capture_output=True,
                             text=True, check=True)
        growth.append(int(res.stdout.strip()))
    slot_bytes = 2 * ((1 << 18) * 20)
    assert growth[1] < growth[0] + slot_bytes, growth  # 12x the params, not 12x the memory


# -- bad input: a specific error each, and nothing on disk changes -----------------------

@pytest.fixture
def committed(disk_dir):
    x = np.arange(2500, dtype=np.float32)
    pipe = smartinf.Pipeline(disk_dir, chunk=CHUNK)
    pipe.add_subgroup(x.size, init=x)
    with pipe.step():
        pipe.update(0, np.ones(x.size, np.float32), np.empty(x.size, np.float32))
    yield pipe, disk_dir
    pipe.close()


def _snapshot(d):
    return {name: hashlib.sha256(open(os.path.join(d, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(d))}


@pytest.mark.parametrize("call, error, match", [
    (lambda p: p.update(0, np.ones(2500, np.float64), np.empty(2500, np.float32)), TypeError, "grad has dtype float64"),
    (lambda p: p.update(0, np.ones(2499, np.float32), np.empty(2500, np.float32)), ValueError, "grad has 2499 elements"),
    (lambda p: p.update(0, np.ones(2500, np.float32), np.empty(2501, np.float16)), ValueError, "out has 2501 elements"),
    (lambda p: p.update(0, np.ones(5000, np.float32)[::2], np.empty(2500, np.float32)), ValueError, "grad is not contiguous"),
    (lambda p: p.update(0, torch.ones(2500).t()[None].expand(2, 2500)[0], torch.empty(50, 50).t()), ValueError, "out is not contiguous"),
    (lambda p: p.update(0, torch.ones(2500, device="meta"), np.empty(2500, np.float32)), ValueError, "grad is on meta"),
    (lambda p: p.update(0, [1.0] * 2500, np.empty(2500, np.float32)), TypeError, "numpy array or a CPU torch tensor"),
    (lambda p: p.update(0, np.ones(2500, np.float32), np.empty(2500, np.int32)), TypeError, "out has dtype int32"),
    (lambda p: p.update(1, np.ones(2500, np.float32), np.empty(2500, np.float32)), IndexError, "unknown sub-group 1"),
    (lambda p: p.update("0", np.ones(2500, np.float32), np.empty(2500, np.float32)), TypeError, "sub-group id must be an int"),
    (lambda p: p.update(0, np.ones(2500, np.float32), np.empty(2500, np.float32), lr=float("nan")), ValueError, "lr=nan"),
    (lambda p: p.update(0, np.ones(2500, np.float32), np.empty(2500, np.float32), grad_scale=0.0), ValueError, "grad_scale"),
    (lambda p: p.update(0, *(lambda a: (a[:2500], a[1000:3500]))(np.ones(4000, np.float32))), ValueError, "overlap"),
    (lambda p: p.add_subgroup(0), ValueError, "numel must be positive"),
    (lambda p: p.add_subgroup(10, init=np.ones(10, np.float16)), TypeError, "init has dtype float16"),
    (lambda p: p.read_states(3), IndexError, "unknown sub-group 3"),
    (lambda p: p.update(0, Compressed(torch.tensor([5, 3], dtype=torch.int32), torch.ones(2, dtype=torch.float16), 2500),
                        np.empty(2500, np.float32)), ValueError, "does not ascend strictly"),
    (lambda p: p.update(0, Compressed(torch.tensor([3, 2500], dtype=torch.int32), torch.ones(2, dtype=torch.float16), 2501),
                        np.empty(2500, np.float32)), ValueError, "is of 2501 params"),
    (lambda p: p.update(0, Compressed(torch.tensor([-1, 3], dtype=torch.int32), torch.ones(2, dtype=torch.float16), 2500),
                        np.empty(2500, np.float32)), ValueError, "outside the sub-group"),
    (lambda p: p.update(0, np.ones(2500, np.float32), np.empty(2500, np.float32), momentum=0.9), TypeError, "unknown hyper-parameters"),
    (lambda p: p.write_states(0, {"exp_avg": np.zeros(2500, np.float32)}, 1), ValueError, "must include 'param'"),
    (lambda p: p.write_states(0, {"param": np.zeros(2500, np.float32), "sum": np.zeros(2500, np.float32)}, 1), ValueError, "unknown states"),
    (lambda p: p.write_states(0, {"param": np.zeros(2500, np.float32)}, -1), ValueError, "steps must be"),
    (lambda p: p.write_states(0, {"param": np.zeros(2499, np.float32)}, 1), ValueError, "param has 2499 elements"),
])
def test_bad_input(committed, call, error, match):
    pipe, d = committed
    before = _snapshot(d)
    with pytest.raises(error, match=match):
        call(pipe)
    assert _snapshot(d) == before
    assert pipe.step_count == 1


def test_update_twice_in_a_step_is_refused(committed):
    pipe, d = committed
    g, out = np.ones(2500, np.float32), np.empty(2500, np.float32)
    pipe.update(0, g, out)
    with pytest.raises(ValueError, match="already updated in this step"):
        pipe.update(0, g, out)
    pipe.commit()
    assert pipe.subgroup_steps(0) == 2


def test_closed_pipeline(committed):
    pipe, d = committed
    pipe.close()
    with pytest.raises(ValueError, match="closed"):
        pipe.update(0, np.ones(2500, np.float32), np.empty(2500, np.float32))
    with pytest.raises(ValueError, match="closed"):
        pipe.add_subgroup(10)
    assert pipe.stats["step"] == 1  # the last counters stay readable


@pytest.mark.parametrize("kwargs, match", [
    ({"optimizer": smartinf.Adam()}, "optimizer adamw, not adam"),
    ({"chunk": 2000}, "chunk 1000, not 2000"),
])
def test_reopen_with_other_settings_is_refused(committed, kwargs, match):
    pipe, d = committed
    pipe.close()
    before = _snapshot(d)
    args = {"chunk": CHUNK, **kwargs}
    with pytest.raises(ValueError, match=match):
        smartinf.Pipeline(d, **args)
    assert _snapshot(d) == before


def test_reopen_with_other_layout_is_refused(committed):
    pipe, d = committed
    pipe.close()
    before = _snapshot(d)
    with smartinf.Pipeline(d, chunk=CHUNK) as again:
        with pytest.raises(ValueError, match="with 2500 params, not 2000"):
            again.add_subgroup(2000)
    assert _snapshot(d) == before


def test_corrupt_manifest_is_refused(committed):
    pipe, d = committed
    pipe.close()
    path = os.path.join(d, "manifest")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text.replace("step 1", "step 7"))
    with pytest.raises(ValueError, match="checksum mismatch"):
        smartinf.Pipeline(d, chunk=CHUNK)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"slots": 0}, ValueError, "slots=0"),
    ({"chunk": 0}, ValueError, "chunk=0"),
    ({"slots": 2.0}, TypeError, "slots must be an int"),
    ({"io": "aio"}, ValueError, "io='aio'"),
    ({"optimizer": "adam"}, TypeError, "optimizer must be"),
    ({"param_dtype": "int8"}, ValueError, "not supported"),
])
def test_bad_settings(disk_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        smartinf.Pipeline(disk_dir, **kwargs)
    assert os.listdir(disk_dir) == []


def test_unwritable_directory(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("running as root without chattr +i support: cannot make a directory unwritable")
    else:
        d.chmod(0o500)
    try:
        with pytest.raises(OSError) as info:
            smartinf.Pipeline(str(d))
        assert str(d) in str(info.value)
        assert os.listdir(d) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        d.chmod(0o700)


def test_compressed_update_equals_dense_update_of_the_kept_gradient(disk_dir, tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(2500).astype(np.float32)
    g = torch.from_numpy(rng.standard_normal(2500).astype(np.float32))
    c = TopK(0.1, value_dtype=torch.bfloat16).compress(g)
    out_c, out_d = np.empty(2500, np.float32), np.empty(2500, np.float32)
    with smartinf.Pipeline(disk_dir, chunk=CHUNK) as a, \
            smartinf.Pipeline(str(tmp_path / "dense"), chunk=CHUNK) as b:
        for pipe in (a, b):
            pipe.add_subgroup(2500, init=x)
        before = a.stats["host_to_device"]
        with a.step(), b.step():
            a.update(0, c, out_c).wait()
            b.update(0, decompress(c), out_d).wait()
        assert a.stats["host_to_device"] - before == 250 * 6  # int32 index + bf16 value
        np.testing.assert_array_equal(out_c, out_d)
        for name, value in b.read_states(0).items():
            np.testing.assert_array_equal(a.read_states(0)[name], value, name)


def test_written_states_become_current_at_commit(committed):
    pipe, d = committed
    states = {"param": np.full(2500, 2.0, np.float32), "exp_avg": np.full(2500, 0.5, np.float32)}
    committed_param = pipe.read_states(0)["param"]
    pipe.write_states(0, states, 7)
    np.testing.assert_array_equal(pipe.read_states(0)["param"], committed_param)  # not yet
    pipe.commit()
    got = pipe.read_states(0)
    np.testing.assert_array_equal(got["param"], states["param"])
    np.testing.assert_array_equal(got["exp_avg"], states["exp_avg"])
    np.testing.assert_array_equal(got["exp_avg_sq"], np.zeros(2500, np.float32))  # initial value
    assert pipe.subgroup_steps(0) == 7


def test_an_empty_compressed_gradient_is_a_zero_gradient(tmp_path):
    """Top-k of nothing kept (which Compressed accepts): the update of a zero gradient."""
    n, rule = 2500, smartinf.AdamW(lr=1e-2, weight_decay=0.1)
    init = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    outs = {}
    for name, grad in [("dense", np.zeros(n, np.float32)),
                       ("empty", Compressed(torch.empty(0, dtype=torch.int32),
                                            torch.empty(0, dtype=torch.float16), n))]:
        with smartinf.Pipeline(str(tmp_path / name), rule, chunk=1000) as pipe:
            pipe.add_subgroup(n, init=init)
            outs[name] = np.empty(n, np.float32)
            with pipe.step():
                pipe.update(0, grad, outs[name]).wait()
    assert np.array_equal(outs["empty"], outs["dense"]) and not np.array_equal(outs["dense"], init)


def test_a_directory_keeps_its_chunk_when_none_is_given(tmp_path, monkeypatch):
    """Unset (no chunk=, no SMARTINF_CHUNK), the chunk is the run's own where the directory
    holds one (a run made before the default changed reopens), else the default."""
    monkeypatch.delenv("SMARTINF_CHUNK", raising=False)
    pipe = smartinf.Pipeline(smartinf.CpuDevice(str(tmp_path / "a")), smartinf.AdamW(), chunk=4096)
    pipe.add_subgroup(10_000, None)
    pipe.close()
    pipe = smartinf.Pipeline(smartinf.CpuDevice(str(tmp_path / "a")), smartinf.AdamW())
    assert pipe.settings.chunk == 4096
    pipe.add_subgroup(10_000, None)
    assert pipe.resumed(0)
    pipe.close()
    pipe = smartinf.Pipeline(smartinf.CpuDevice(str(tmp_path / "b")), smartinf.AdamW())
    assert pipe.settings.chunk == smartinf.defaults.CHUNK
    pipe.close()


def test_device_of_names_where_each_sub_group_is_updated(tmp_path):
    devices = [smartinf.CpuDevice(str(tmp_path / "a")), smartinf.CpuDevice(str(tmp_path / "b"))]
    pipe = smartinf.Pipeline(devices, smartinf.AdamW(), state_dtype="int8", small_sizes=[7])
    pipe.add_subgroup(1000, None)
    pipe.add_subgroup(1000, None)
    pipe.add_subgroup(7, None, small=True)
    assert [pipe.device_of(sg) for sg in range(3)] == [devices[0], devices[1], None]
    pipe.close()
