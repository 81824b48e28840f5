"""The host step's inf/NaN check without a pass of its own (issue 89): fused into the
gradients' gathering into staging where no update starts during backward (the CPU's default),
GradScaler's found_inf taken where it checked them, the norm only where clipping needs it.
Every case against torch's AdamW fed the same gradients, a skipped step leaving the stored
states and the params untouched."""
from __future__ import annotations

import math

import pytest
import torch

import smartinf.optim as so
from smartinf.optim import gradients
from test_optim import (assert_models_close, make_model, reference_grads, set_grads,
                        states_digest)


@pytest.fixture
def no_speculation(monkeypatch):
    """The CPU's default: no update during backward (tests/conftest.py turns it on)."""
    monkeypatch.setenv("SMARTINF_SPECULATE_ON_CPU", "0")


def pair(directory, subgroup_size, dtype=torch.float32):
    a, b = make_model(dtype), make_model(dtype)
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[directory], subgroup_size=subgroup_size,
                  chunk=256)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    return a, oa, b, ob


# 700: two sub-groups, both gathered and checked before the first update (staging holds
# two); 300: five, the last three checked where they are
@pytest.mark.parametrize("subgroup_size", [700, 300])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 3], ids=["first-param", "last-param"])
def test_fused_check_skips_inf_nan_anywhere_and_matches_torch(disk_dir, no_speculation,
                                                              subgroup_size, bad, where):
    a, oa, b, ob = pair(disk_dir, subgroup_size)
    assert oa._speculation is None and len(oa._plan) == (2 if subgroup_size == 700 else 5)
    for step in range(3):
        set_grads(a, reference_grads(b, step))
        oa.step()
        ob.step()
    assert not oa.last_step_skipped and oa.last_grad_norm is None  # (no norm taken)
    oa.pipeline.flush()
    before = states_digest(disk_dir)
    params = [p.detach().clone() for p in a.parameters()]
    grads = reference_grads(b, 3)
    grads[where].view(-1)[-1] = bad  # (the last element: a param's slice in the last sub-group)
    set_grads(a, grads)
    oa.step()
    assert oa.last_step_skipped and oa.skipped_steps == 1 and oa.pipeline.step_count == 3
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), params))
    oa.pipeline.flush()
    assert states_digest(disk_dir) == before
    for step in range(4, 6):
        set_grads(a, reference_grads(b, step))
        oa.step()
        ob.step()
    assert not oa.last_step_skipped and oa.pipeline.step_count == 5
    assert_models_close(a, b)
    oa.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_fused_check_of_16_bit_gradients(disk_dir, no_speculation, dtype, bad):
    """16-bit gradients' exponents (fp16's 5 bits, bf16's 8): inf/NaN found, the largest
    finite values (65504, 3.39e38) and subnormals not."""
    p = torch.nn.Parameter(torch.zeros(3000, dtype=dtype))
    ours = so.SGD([p], lr=1e-6, devices=[disk_dir], subgroup_size=1000, chunk=256)
    g = torch.zeros(3000, dtype=dtype)
    g[::7] = torch.finfo(dtype).max
    g[1::7] = -torch.finfo(dtype).max
    g[2::7] = torch.finfo(dtype).smallest_normal / 4
    p.grad = g.clone()
    ours.step()
    assert not ours.last_step_skipped
    for i in (5, 1500, 2999):
        bad_grad = g.clone()
        bad_grad[i] = bad
        p.grad = bad_grad
        ours.step()
        assert ours.last_step_skipped, i
    assert ours.skipped_steps == 3
    ours.close()


def test_gathered_gradients_stay_right_after_edits_through_staging(disk_dir, no_speculation):
    """A param edited between steps and an edit through opt.state go through staging before
    the updates: the gradients gathered there by the check are gathered again."""
    a, oa, b, ob = pair(disk_dir, 700)
    for step in range(2):
        set_grads(a, reference_grads(b, step))
        oa.step()
        ob.step()
    with torch.no_grad():
        for m in (a, b):
            m[0].weight.mul_(0.5)  # an edit of params: taken as the masters
    for p, q in zip(a.parameters(), b.parameters()):
        oa.state[p]["exp_avg"].mul_(0.25)
        ob.state[q]["exp_avg"].mul_(0.25)
    for step in range(2, 4):
        set_grads(a, reference_grads(b, step))
        oa.step()
        ob.step()
    assert_models_close(a, b)
    oa.close()


def test_gradscaler_check_is_not_done_again(disk_dir, no_speculation, monkeypatch):
    """Where GradScaler checked the gradients (its found_inf, as torch's fused optimizers
    take it) no pass checks them again; its inf skips the step."""
    a, oa, b, ob = pair(disk_dir, 700)

    def no_pass(*args, **kwargs):
        raise AssertionError("the gradients were checked again")
    for name in ("finite", "gather_checked", "total_norm"):
        monkeypatch.setattr(gradients, name, no_pass)
    for step in range(3):
        grads = reference_grads(b, step)
        set_grads(a, [g * 1024 for g in grads])
        oa.grad_scale, oa.found_inf = torch.tensor(1024.0), torch.tensor(0.0)  # (scaler.step's)
        oa.step()
        set_grads(b, grads)
        ob.step()
    assert_models_close(a, b)
    oa.grad_scale, oa.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    oa.step()
    assert oa.last_step_skipped and oa.pipeline.step_count == 3
    oa.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_walk_pieces_copies_checks_and_hashes_every_piece_of_every_part(threads, dtype):
    """The native walk under the check and the digest (store/host_pieces.h), at sizes the
    models above never reach: parts of several pieces and a short last one, an inf/NaN in
    any piece of any part found (and the largest finite value, the smallest non-finite's
    neighbour, not), the copies exact and each piece's hash the XXH3 of it."""
    from smartinf import _native
    piece = 4096
    magnitude, exponent = gradients._EXPONENT[dtype]
    sizes = [5 * piece // dtype.itemsize + 7, 3, piece // dtype.itemsize]
    srcs = [torch.randn(n).to(dtype) for n in sizes]
    srcs[0][-1] = torch.finfo(dtype).max  # (finite: the walk must not stop at it)
    dsts = [torch.empty_like(s) for s in srcs]
    walk = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size()) for d, s in zip(dsts, srcs)]
    ok, sums = _native.walk_pieces(walk, piece, threads, dtype.itemsize, magnitude, exponent,
                                   hash=True)
    assert ok and all(torch.equal(d.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                                  s.view(torch.int16 if dtype.itemsize == 2 else torch.int32))
                      for d, s in zip(dsts, srcs))
    for s, part_sums in zip(srcs, sums):
        nbytes = s.numel() * s.element_size()
        assert part_sums == [_native.checksum(s.data_ptr() + a, min(piece, nbytes - a))
                             for a in range(0, nbytes, piece)]
    for bad in (math.inf, -math.inf, math.nan):
        for p, at in ((0, 4 * piece // dtype.itemsize + 1), (2, 0), (0, sizes[0] - 2)):
            srcs[p][at] = bad
            assert not _native.walk_pieces([(0, a, n) for _, a, n in walk], piece, threads,
                                           dtype.itemsize, magnitude, exponent)[0]
            assert not gradients.finite(srcs)
            srcs[p][at] = 1.0
    assert _native.walk_pieces([(0, a, n) for _, a, n in walk], piece, threads,
                               dtype.itemsize, magnitude, exponent)[0]
