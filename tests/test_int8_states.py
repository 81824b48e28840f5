"""int8 (8-bit block-wise) states of Adam and Lion: the code's error bounds per block, the
updates bit for bit against the numpy reference of the same scheme
(tests/quant8_reference.py), the extents' bytes, the storage bytes, and directories that
keep one state dtype."""
import numpy as np
import pytest
import torch

import smartinf
from conftest import assert_stored_as, step_traffic_per_param, wide
import smartinf.optim as so
from quant8_reference import BLOCK, Int8Adam, Int8Lion

CHUNK = 1000  # blocks restart at every chunk: 256, 256, 256, 232, then the next chunk


def blocks(n):
    return [(lo, min(lo + BLOCK, c + CHUNK, n)) for c in range(0, n, CHUNK)
            for lo in range(c, min(c + CHUNK, n), BLOCK)]


def test_quantization_error_is_bounded_per_block(disk_dir):
    n = 2600
    rng = np.random.default_rng(0)
    param, m, v = rng.standard_normal(n).astype(np.float32), wide(rng, n, True), wide(rng, n, False)
    with smartinf.Pipeline(disk_dir, smartinf.Adam(), chunk=CHUNK, state_dtype="int8") as pipe:
        pipe.add_subgroup(n)
        with pipe.step():
            pipe.write_states(0, {"param": param, "exp_avg": m, "exp_avg_sq": v}, steps=3)
        got = pipe.read_states(0)
    assert np.array_equal(got["param"], param)  # master weights stay fp32
    w, w_got = np.sqrt(v), np.sqrt(got["exp_avg_sq"])
    for lo, hi in blocks(n):
        m_max, w_max = np.abs(m[lo:hi]).max(), w[lo:hi].max()
        # 3 mantissa bits: half a step is 1/16 of the value; below the smallest normal
        # (2^-14 / 2^-30 of the block max) half a subnormal step.
        m_bound = np.maximum(np.abs(m[lo:hi]) / 16, m_max * 2.0 ** -18) * (1 + 1e-6)
        w_bound = np.maximum(w[lo:hi] / 16, w_max * 2.0 ** -34) * (1 + 1e-6)
        assert np.all(np.abs(got["exp_avg"][lo:hi] - m[lo:hi]) <= m_bound)
        assert np.all(np.abs(w_got[lo:hi] - w[lo:hi]) <= w_bound)
        assert np.all((w_got[lo:hi] > 0) == (w[lo:hi] > 0))  # no positive root becomes 0
        assert np.abs(got["exp_avg"][lo:hi]).max() == m_max  # the block maximum is exact
    ref = Int8Adam(param, m, v, CHUNK).states()
    for k in ref:
        assert np.array_equal(got[k], ref[k]), k


@pytest.mark.parametrize("rule, decoupled", [
    (smartinf.AdamW(lr=1e-2, weight_decay=0.1), True),
    (smartinf.Adam(lr=3e-3, betas=(0.4, 0.99), weight_decay=0.05), False),  # lerp's other formula
])
def test_update_matches_the_reference_bit_for_bit(disk_dir, rule, decoupled):
    n = 2600
    rng = np.random.default_rng(1)
    init = rng.standard_normal(n).astype(np.float32)
    ref = Int8Adam(init, np.zeros(n, np.float32), np.zeros(n, np.float32), CHUNK)
    out = np.empty(n, np.float32)
    with smartinf.Pipeline(disk_dir, rule, chunk=CHUNK, state_dtype="int8") as pipe:
        pipe.add_subgroup(n, init=init)
        for t in range(1, 6):
            grad = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float32)
            with pipe.step():
                pipe.update(0, grad, out, grad_scale=0.5).wait()
            beta1, beta2 = rule.betas
            expected = ref.step(grad, t, rule.lr, beta1, beta2, rule.eps, rule.weight_decay,
                                decoupled, grad_scale=0.5)
            assert np.array_equal(out, expected), f"params differ at step {t}"
        got = pipe.read_states(0)
    for k, v in ref.states().items():
        assert np.array_equal(got[k], v), k


@pytest.mark.parametrize("rule, dtype, fp32, quantized", [
    # 4 (param) + 1 + 1 (codes) + 8 / 256 (two fp32 scales per block)
    (smartinf.AdamW(), "int8", 12, 6.03125),
    # 4 (param) + 1 (codes) + 4 / 256 (one fp32 scale per block)
    (smartinf.Lion(), "int8", 8, 5.015625),
    # 4 (param) + 2 x 0.5 (codes) + 4 / 128 (block scales) + 2 x 128 x 4 / 16384 (tile maxima)
    (smartinf.AdamW(), "int4", 12, 5.09375),
    # 4 (param) + 0.5 (codes) + 4 / 128
    (smartinf.Lion(), "int4", 8, 4.53125),
])
def test_storage_bytes_per_param(tmp_path, rule, dtype, fp32, quantized):
    """int8 and int4 states: a step moves these bytes per param each way."""
    n = 1 << 20
    moved = {d: step_traffic_per_param(tmp_path / d, rule, n, np.ones(n, np.float32),
                                       np.empty(n, np.float16), chunk=n, state_dtype=d)
             for d in ("fp32", dtype)}
    moved = {d: {k: m[k] for k in ("storage_read", "storage_write")} for d, m in moved.items()}
    assert moved["fp32"] == {"storage_read": fp32, "storage_write": fp32}
    # 1 Mi params a chunk fill 4 KiB pages exactly.
    assert moved[dtype] == {"storage_read": quantized, "storage_write": quantized}


@pytest.mark.parametrize("rule", [smartinf.Adam(), smartinf.Lion()], ids=["adam", "lion"])
def test_a_directory_keeps_its_state_dtype(tmp_path, rule):
    for made, asked in (("fp32", "int8"), ("int8", "fp32")):
        d = str(tmp_path / made)
        with smartinf.Pipeline(d, rule, chunk=CHUNK, state_dtype=made) as pipe:
            pipe.add_subgroup(10)
        with pytest.raises(ValueError, match=f"made with state dtype {made}, not {asked}"):
            smartinf.Pipeline(d, rule, chunk=CHUNK, state_dtype=asked)


@pytest.mark.parametrize("kwargs, match", [
    (dict(state_dtype="int2"), "state_dtype='int2': expected one of fp32, int8, int4"),
    (dict(state_dtype="int4", optimizer=smartinf.SGD(lr=0.1)), "int4 states are for adam, adamw, lion; sgd"),
    # the rules whose row in kernels/rules.h allows int8, named from the registry
    (dict(state_dtype="int8", optimizer=smartinf.SGD(lr=0.1, momentum=0.9)),
     "int8 states are for adam, adamw, lion; sgd keeps fp32 states"),
    (dict(state_dtype="int8", optimizer=smartinf.Adagrad()), "int8 states are for .*; adagrad keeps"),
    (dict(state_dtype="int8", optimizer=smartinf.Adam(amsgrad=True)), "adam_amsgrad keeps fp32"),
])
def test_bad_state_dtype(tmp_path, kwargs, match):
    optimizer = kwargs.pop("optimizer", None)
    with pytest.raises(ValueError, match=match):
        smartinf.Pipeline(str(tmp_path), optimizer, **kwargs)


def test_the_relative_error_bound_holds_above_the_smallest_normal(disk_dir):
    """What docs/state-formats.md states: at most 1/16 relative error from 2^-14 of the block maximum
    (2^-30 for the root of exp_avg_sq) up; below, at most 2^-18 of the maximum, absolute
    (2^-33 for the root: a positive root rounds up to a step, never to 0), which is a larger
    relative error (up to 1/3 near 2^-16)."""
    exponents = np.linspace(0, -40, 8 * BLOCK)  # a block each: the maximum 1, then smaller
    values = (2.0 ** exponents).astype(np.float32).reshape(-1, BLOCK)
    values[:, 0] = 1.0
    m = values.ravel()
    n = m.size
    with smartinf.Pipeline(disk_dir, smartinf.Adam(), chunk=BLOCK * 4, state_dtype="int8") as pipe:
        pipe.add_subgroup(n)
        with pipe.step():
            pipe.write_states(0, {"param": np.zeros(n, np.float32), "exp_avg": -m,
                                  "exp_avg_sq": m * m}, steps=1)
        got = pipe.read_states(0)
    for decoded, normal, floor in ((-got["exp_avg"], 2.0 ** -14, 2.0 ** -18),
                                   (np.sqrt(got["exp_avg_sq"]), 2.0 ** -30, 2.0 ** -33)):
        rel = np.abs(decoded - m) / m
        above = m >= normal
        assert rel[above].max() <= 1 / 16 * (1 + 1e-6)
        assert np.all(np.abs(decoded - m)[~above] <= floor * (1 + 1e-6))
        assert rel[~above & (m > 2 * floor)].max() > 1 / 16  # the bound needs its range


# -- Lion: one int8 moment (exp_avg, coded as Adam's) ------------------------------------
LION = smartinf.Lion(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)


def lion_grads(seed, n, steps):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float32)
            for _ in range(steps)]


@pytest.mark.parametrize("rule, grad_scale", [
    (LION, 0.5),
    (smartinf.Lion(lr=3e-4, betas=(0.5, 0.9), maximize=True), 0.25),  # a negated scale
])
def test_lion_update_matches_the_reference_bit_for_bit(disk_dir, rule, grad_scale):
    n = 2600
    init = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    ref = Int8Lion(init, np.zeros(n, np.float32), CHUNK)
    out = np.empty(n, np.float32)
    with smartinf.Pipeline(disk_dir, rule, chunk=CHUNK, state_dtype="int8") as pipe:
        pipe.add_subgroup(n, init=init)
        for t, grad in enumerate(lion_grads(3, n, 6), 1):
            with pipe.step():
                pipe.update(0, grad, out, grad_scale=grad_scale).wait()
            sign = -1.0 if rule.maximize else 1.0
            expected = ref.step(grad, rule.lr, *rule.betas, rule.weight_decay, sign * grad_scale)
            assert np.array_equal(out, expected), f"params differ at step {t}"
        got = pipe.read_states(0)
    assert set(got) == {"param", "exp_avg"}
    for k, v in ref.states().items():
        assert np.array_equal(got[k], v), k


def test_lion_states_round_trip_and_reopen(disk_dir):
    """write_states codes fp32 states as the reference does; a reopened directory goes on
    from the same bits."""
    n = 2600
    rng = np.random.default_rng(4)
    param, m = rng.standard_normal(n).astype(np.float32), wide(rng, n, True)
    ref = Int8Lion(param, m, CHUNK)
    out = np.empty(n, np.float32)
    grads = lion_grads(5, n, 4)
    with smartinf.Pipeline(disk_dir, LION, chunk=CHUNK, state_dtype="int8") as pipe:
        pipe.add_subgroup(n)
        with pipe.step():
            pipe.write_states(0, {"param": param, "exp_avg": m}, steps=2)
        got = pipe.read_states(0)
        for k, v in ref.states().items():
            assert np.array_equal(got[k], v), k
        with pipe.step():
            pipe.update(0, grads[0], out).wait()
        assert np.array_equal(out, ref.step(grads[0], LION.lr, *LION.betas, LION.weight_decay))
    with smartinf.Pipeline(disk_dir, LION, chunk=CHUNK, state_dtype="int8") as pipe:
        pipe.add_subgroup(n)
        assert pipe.resumed(0) and pipe.step_count == 2
        for grad in grads[1:]:
            with pipe.step():
                pipe.update(0, grad, out).wait()
            assert np.array_equal(out, ref.step(grad, LION.lr, *LION.betas, LION.weight_decay))
        got = pipe.read_states(0)
    for k, v in ref.states().items():
        assert np.array_equal(got[k], v), k


@pytest.mark.parametrize("rule", [smartinf.AdamW(), LION], ids=["adamw", "lion"])
def test_extents_hold_the_layout_of_store_layout_h(disk_dir, rule):
    """The committed extents' bytes, as store/layout.h places them: fp32 params, each
    moment's codes, padding to 4 B, each moment's block scales (Adam's is the layout
    directories have always had)."""
    n = 2600
    rng = np.random.default_rng(6)
    param, m, v = rng.standard_normal(n).astype(np.float32), wide(rng, n, True), wide(rng, n, False)
    states = {"param": param, "exp_avg": m, "exp_avg_sq": v}
    ref = Int8Lion(param, m, CHUNK) if rule is LION else Int8Adam(param, m, v, CHUNK)
    assert_stored_as(disk_dir, rule, "int8", CHUNK, states, ref)


def test_lion_through_smartinf_optim(disk_dir, tmp_path, monkeypatch):
    """smartinf.optim.Lion(state_dtype="int8"): the reference's params, a state_dict of the
    decoded momentum that a fresh int8 optimizer codes back to the same bits, and a resume."""
    monkeypatch.setenv("SMARTINF_SMALL_TENSOR", "0")  # a small tensor: its moments quantised too
    n = 2600
    init = torch.randn(n, generator=torch.Generator().manual_seed(7))
    kw = dict(lr=LION.lr, betas=LION.betas, weight_decay=LION.weight_decay, chunk=CHUNK,
              state_dtype="int8")
    ref = Int8Lion(init.numpy(), np.zeros(n, np.float32), CHUNK)
    grads = lion_grads(8, n, 7)

    def step(opt, p, grad):
        p.grad = torch.from_numpy(grad.copy())
        opt.step()

    a = torch.nn.Parameter(init.clone())
    oa = so.Lion([a], devices=[disk_dir], **kw)
    for grad in grads[:3]:
        step(oa, a, grad)
        assert np.array_equal(a.detach().numpy(), ref.step(grad, LION.lr, *LION.betas, LION.weight_decay))
    saved = oa.state_dict()
    entry = saved["state"][0]
    assert entry["exp_avg"].dtype == torch.float32
    assert np.array_equal(entry["exp_avg"].numpy(), ref.states()["exp_avg"])

    c = torch.nn.Parameter(a.detach().clone())
    oc = so.Lion([c], devices=[str(tmp_path / "fresh")], **kw)
    oc.load_state_dict(saved)
    for grad in grads[3:5]:
        step(oa, a, grad)
        step(oc, c, grad)
        assert np.array_equal(a.detach().numpy(), ref.step(grad, LION.lr, *LION.betas, LION.weight_decay))
        assert torch.equal(a, c)
    oc.close()
    oa.close()

    b = torch.nn.Parameter(a.detach().clone())
    ob = so.Lion([b], devices=[disk_dir], if_exists="resume", **kw)
    for grad in grads[5:]:
        step(ob, b, grad)
        assert np.array_equal(b.detach().numpy(), ref.step(grad, LION.lr, *LION.betas, LION.weight_decay))
    ob.close()
