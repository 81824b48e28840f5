"""Updates from and into the caller's parts (``Pipeline.update`` with lists, ``takes_parts``):
a model's gradients read and its params written where they lie, no flat buffer on either side
(issue 89: the host step's gather and scatter were 16 of the 23 M step's 28 B a param beyond
torch's). Bit for bit the flat update's, wherever parts and chunks are cut."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import smartinf

CHUNK = 1000
SIZE = 3 * CHUNK + 7  # (chunks cut parts, and the last one short)


def cuts(rng, n):
    """Part boundaries of [0, n): some inside a chunk, one on a chunk's edge, one part empty."""
    inner = sorted(set(rng.integers(1, n, 5).tolist()) | {CHUNK, 2 * CHUNK + 1})
    return [0, *inner, inner[-1], n]  # (the repeated last cut: an empty part)


@pytest.mark.parametrize("budget", [0, "1MiB"], ids=["streamed", "resident"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float32)], ids=["fp32", "bf16", "fp16-grad"])
def test_parts_update_bit_for_bit_as_flat(tmp_path, budget, dtypes):
    grad_dtype, out_dtype = dtypes
    rng = np.random.default_rng(0)
    init = rng.standard_normal(SIZE).astype(np.float32)
    rule = smartinf.AdamW(lr=1e-2, weight_decay=0.1)
    kwargs = dict(chunk=CHUNK, memory_budget=budget, commit_every=2,
                  param_dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[out_dtype])
    with smartinf.Pipeline(str(tmp_path / "flat"), rule, **kwargs) as flat, \
            smartinf.Pipeline(str(tmp_path / "parts"), rule, **kwargs) as parted:
        for pipe in (flat, parted):
            pipe.add_subgroup(SIZE, init=init)
        assert parted.takes_parts(0)
        for step in range(5):  # (through a durable commit, and twins where resident)
            grad = torch.from_numpy(rng.standard_normal(SIZE).astype(np.float32)).to(grad_dtype)
            out_flat = torch.empty(SIZE, dtype=out_dtype)
            c = cuts(rng, SIZE)
            grads = [grad[a:b].clone() for a, b in zip(c, c[1:])]  # (each in its own memory)
            outs = [torch.full((b - a,), -7.0, dtype=out_dtype) for a, b in zip(c, c[1:])]
            with flat.step():
                flat.update(0, grad, out_flat)
            with parted.step():
                parted.update(0, grads, outs)
            assert torch.equal(torch.cat(outs), out_flat), f"step {step}"
        a, b = flat.read_states(0), parted.read_states(0)
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_parts_refused_clearly(tmp_path):
    rule = smartinf.AdamW(lr=1e-2)
    with smartinf.Pipeline(str(tmp_path / "q"), rule, chunk=CHUNK, state_dtype="int8") as quantized, \
            smartinf.Pipeline(str(tmp_path / "f"), rule, chunk=CHUNK) as pipe:
        for p in (quantized, pipe):
            p.add_subgroup(SIZE)
        g = torch.zeros(SIZE)
        with pytest.raises(ValueError, match="cannot take its gradient and params in parts"):
            quantized.update(0, [g], [torch.empty(SIZE)])
        with pytest.raises(ValueError, match="the sub-group has 3007"):
            pipe.update(0, [g[:10]], [torch.empty(10)])
        with pytest.raises(ValueError, match="one params part for each"):
            pipe.update(0, [g[:7], g[7:]], [torch.empty(SIZE)])
        shared = torch.empty(SIZE)
        with pytest.raises(ValueError, match="overlap"):
            pipe.update(0, [shared[:7], g[7:]], [torch.empty(7), shared[:SIZE - 7]])
        with pytest.raises(TypeError, match="one dtype"):
            pipe.update(0, [g[:7], g[7:].half()], [torch.empty(7), torch.empty(SIZE - 7)])


# -- smartinf.optim: the host step's default -----------------------------------------------

@pytest.fixture
def no_speculation(monkeypatch):
    """The CPU's default: no update during backward (tests/conftest.py turns it on)."""
    monkeypatch.setenv("SMARTINF_SPECULATE_ON_CPU", "0")


def model_with_odd_params():
    """A weight stored transposed (not contiguous: its sub-group gathered and its params
    copied back), the rest taken in place."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 9))
    m[2].weight = torch.nn.Parameter(m[2].weight.detach().t().contiguous().t())
    return m


@pytest.mark.parametrize("subgroup_size", [500, 100_000], ids=["cut", "whole"])
def test_the_host_step_updates_the_model_in_place_as_torch(disk_dir, no_speculation, monkeypatch,
                                                           subgroup_size):
    from test_optim import assert_models_close, reference_grads, set_grads
    import smartinf.optim as so
    from smartinf.optim import gradients
    a, b, ref = model_with_odd_params(), model_with_odd_params(), model_with_odd_params()
    oa = so.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, devices=[disk_dir],
                  subgroup_size=subgroup_size, chunk=256)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    assert oa._in_place, "the host's sub-groups take the model's tensors where they lie"
    taken = []
    in_place = gradients.in_place
    monkeypatch.setattr(gradients, "in_place", lambda *args: taken.append(in_place(*args)) or taken[-1])
    for step in range(6):
        grads = reference_grads(ref, step)
        set_grads(a, grads)
        set_grads(b, grads)
        before = [p._version for p in a.parameters()]
        oa.step()
        ob.step()
        assert all(p._version > v for p, v in zip(a.parameters(), before)
                   if p.grad is not None), "each param written is marked written"
        if step == 4:  # an edit between steps is still seen (the digest taken in place)
            with torch.no_grad():
                a[0].weight.data[3, 5] = 0.25
                b[0].weight.data[3, 5] = 0.25
    assert_models_close(a, b)
    transposed = {sg.id for sg in oa._plan if any(s.param is a[2].weight for s in sg.slices)}
    assert all(set(t) == {sg.id for sg in oa._plan} - transposed for t in taken)
    assert bool(taken[0]) == (subgroup_size == 500)  # (whole: the one holds the transposed)
    oa.close()


def test_a_failed_step_puts_back_the_params_its_updates_wrote_in_place(disk_dir, no_speculation):
    """An I/O error partway through a step whose updates write the model's params as they run:
    every param is back at the step before (restored from the stored masters, those of
    sub-groups updated before the error and of the one it hit), and the step taken again
    matches torch's."""
    import errno
    from smartinf import _native as native
    from test_optim import assert_models_close, make_model, reference_grads, set_grads
    import smartinf.optim as so
    a, b, ref = make_model(), make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], subgroup_size=500, chunk=256,
                  memory_budget=0, commit_every=1)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(2):
        set_grads(a, reference_grads(ref, step))
        set_grads(b, reference_grads(ref, step))
        oa.step()
        ob.step()
    before = [p.detach().clone() for p in a.parameters()]
    set_grads(a, reference_grads(ref, 2))
    native.arm_fault("io.read", "error", after=3, errno=errno.EIO)
    try:
        with pytest.raises(OSError):
            oa.step()
    finally:
        native.disarm_fault()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
    set_grads(b, reference_grads(ref, 2))
    oa.step()
    ob.step()
    assert_models_close(a, b)
    oa.close()


def test_a_gradient_in_a_params_memory_is_gathered_not_refused(disk_dir, no_speculation):
    """A gradient set to a view of a param's own storage (odd, but torch steps it): that
    sub-group is gathered as before, not updated in place, and steps as torch's."""
    import smartinf.optim as so
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(300))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa = so.AdamW(a, lr=1e-2, devices=[disk_dir], subgroup_size=100_000, chunk=256)
    ob = torch.optim.AdamW(b, lr=1e-2)
    for params in (a, b):
        params[0].grad = torch.randn(600, generator=torch.Generator().manual_seed(1))
    a[1].grad = a[0].detach()[300:]  # (its values as b's gradient holds them)
    b[1].grad = b[0].detach()[300:].clone()
    oa.step()
    ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach())
    oa.close()
