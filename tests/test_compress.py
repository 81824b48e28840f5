import math

import numpy as np
import pytest
import torch

from smartinf.pipeline import compress
from smartinf.pipeline.compress import Compressed, TopK, decompress

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device (torch.cuda.is_available() is False)")
VALUE_DTYPES = [torch.float16, torch.bfloat16]


def _grad(n, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return g.to(dtype=dtype, device=device)


def _brute_force_topk(g, k):
    """Indices of the k largest |g|, by a full argsort (no ties in random data)."""
    order = np.argsort(-np.abs(g.double().cpu().numpy()), kind="stable")
    return set(order[:k].tolist())


def _assert_valid_topk(g, c, k):
    """Kept set is a valid top-k: k distinct ascending int32 indices, every kept |x| >=
    every dropped |x|, values = g[idx] rounded to the value dtype."""
    idx = c.indices.cpu().long()
    assert c.indices.dtype == torch.int32 and c.indices.numel() == k
    assert torch.all(idx[1:] > idx[:-1])
    mag = g.float().abs().cpu()
    dropped = torch.ones(g.numel(), dtype=torch.bool)
    dropped[idx] = False
    if dropped.any() and k:
        assert mag[idx].min() >= mag[dropped].max()
    assert torch.equal(c.values.cpu(), g.cpu()[idx].to(c.values.dtype))


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keeps_exactly_the_k_largest(value_dtype, grad_dtype):
    g = _grad(1000, dtype=grad_dtype)
    comp = TopK(ratio=0.05, value_dtype=value_dtype)
    c = comp.compress(g)
    k = comp.k(1000)
    assert k == 50
    _assert_valid_topk(g, c, k)
    if grad_dtype == torch.float32:  # low-precision randn can tie
        assert set(c.indices.tolist()) == _brute_force_topk(g, k)
    assert c.values.dtype == value_dtype and c.numel == 1000
    assert c.nbytes == 6 * k
    dense = decompress(c)
    assert dense.dtype == torch.float32 and dense.shape == (1000,)
    expected = torch.zeros(1000)
    expected[c.indices.long()] = g[c.indices.long()].to(value_dtype).float()
    assert torch.equal(dense, expected)
    assert torch.count_nonzero(dense) == k  # randn has no zeros
    assert decompress(c, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("ratio, n, k", [
    (0.01, 1000, 10), (0.01, 1001, 11), (0.3, 7, 3), (0.07, 100, 7), (0.29, 100, 29),
    (0.01, 1, 1), (0.01, 5, 1), (1e-9, 3, 1), (1.0, 13, 13), (0.999, 13, 13), (0.5, 0, 0),
])
def test_k_rounding(ratio, n, k):
    assert TopK(ratio).k(n) == k


def test_ratio_one_keeps_everything():
    g = _grad(37)
    c = TopK(ratio=1.0).compress(g)
    assert torch.equal(c.indices, torch.arange(37, dtype=torch.int32))
    assert torch.equal(decompress(c), g.half().float())


def test_tiny_and_empty_gradients():
    c = TopK(ratio=0.01).compress(torch.tensor([0.5, -3.0, 2.0]))
    assert c.indices.tolist() == [1] and c.values.tolist() == [-3.0]
    empty = TopK(ratio=0.5).compress(torch.zeros(0))
    assert empty.indices.numel() == 0 and empty.nbytes == 0
    assert decompress(empty).shape == (0,)


def test_ties_give_a_valid_topk():
    g = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5, -2.0, 1.0, 0.0])
    comp = TopK(ratio=3 / 8)
    c = comp.compress(g)
    _assert_valid_topk(g, c, 3)
    assert 5 in c.indices.tolist()  # the unique largest is always kept
    assert not {4, 7} & set(c.indices.tolist())
    same = TopK(ratio=0.5).compress(torch.full((10,), -0.25))
    _assert_valid_topk(torch.full((10,), -0.25), same, 5)


LARGE = 32 * compress.SAMPLE  # a CPU sub-group whose top-k is chosen among sampled candidates


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.2])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_large_cpu_gradient_keeps_exactly_the_k_largest(ratio, grad_dtype):
    """Candidates above a sampled threshold, then torch.topk among them: the set a full sort
    gives (float32: no ties), a valid top-k with bf16's ties; NaN and inf sent."""
    g = _grad(LARGE, seed=3, dtype=grad_dtype)
    g[LARGE // 2] = -math.inf
    comp = TopK(ratio=ratio)
    c = comp.compress(g)
    k = comp.k(LARGE)
    _assert_valid_topk(g, c, k)
    assert LARGE // 2 in set(c.indices.tolist())
    if grad_dtype == torch.float32:
        assert set(c.indices.tolist()) == _brute_force_topk(g, k)
    g[5] = math.nan
    assert 5 in set(comp.compress(g).indices.tolist())


def test_a_sample_that_misleads_falls_back_to_the_whole_gradient():
    """Where fewer than k elements clear the sampled threshold (here every sampled one is
    large and few others are), the k largest are chosen among all elements."""
    sampled = torch.randint(LARGE, (compress.SAMPLE,), generator=torch.Generator().manual_seed(0))
    g = _grad(LARGE, seed=4) * 1e-3
    g[sampled] = 10.0
    k = sampled.unique().numel() + 1000
    idx = compress.largest(g.abs(), k)
    assert idx.numel() == k == idx.unique().numel()
    kept = torch.zeros(LARGE, dtype=torch.bool)
    kept[idx] = True
    assert g.abs()[kept].min() >= g.abs()[~kept].max()
    assert set(sampled.tolist()) <= set(idx.tolist())


def test_nan_and_inf_are_sent_not_hidden():
    g = _grad(100)
    g[3], g[70] = math.nan, -math.inf
    dense = decompress(TopK(ratio=0.05).compress(g))
    assert math.isnan(dense[3]) and dense[70] == -math.inf


def test_without_error_feedback_nothing_is_kept():
    comp = TopK(ratio=0.1)
    g = _grad(200)
    first = comp.compress(g, key="a")
    second = comp.compress(g, key="a")
    assert torch.equal(first.indices, second.indices) and torch.equal(first.values, second.values)
    assert comp.residual_bytes == 0 and comp.residual("a") is None


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
def test_error_feedback_conserves_the_gradient_sum(value_dtype):
    comp = TopK(ratio=0.05, value_dtype=value_dtype, error_feedback=True)
    n, steps = 500, 20
    grads = [_grad(n, seed=s) for s in range(steps)]
    sent = torch.zeros(n, dtype=torch.float64)
    for g in grads:
        sent += decompress(comp.compress(g, key=0)).double()
    total = torch.stack(grads).double().sum(0)
    residual = comp.residual(0).double()
    err = (sent + residual - total).abs().max().item()
    assert err <= 1e-5 * steps * total.abs().max().item()
    assert residual.abs().max() > 0.1  # most of the gradient is still in the residual


def test_error_feedback_selects_on_the_accumulated_gradient():
    comp = TopK(ratio=0.25, error_feedback=True)
    g = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert comp.compress(g, key="w").indices.tolist() == [0]
    # residual [0, 3, 2, 1] + [0.5, 0, 0, 1.5] -> 3 wins although the new gradient is small there
    c = comp.compress(torch.tensor([0.5, 0.0, 0.0, 1.5]), key="w")
    assert c.indices.tolist() == [1] and c.values.tolist() == [3.0]
    assert comp.residual("w").tolist() == [0.5, 0.0, 2.0, 2.5]


def test_error_feedback_keeps_the_rounding_error():
    comp = TopK(ratio=1.0, error_feedback=True)
    g = _grad(300)
    c = comp.compress(g, key="x")
    rounding = g - decompress(c)
    assert torch.count_nonzero(rounding) > 0  # fp16 cannot hold randn exactly
    assert torch.equal(comp.residual("x"), rounding)


def test_residual_bytes_and_reset():
    comp = TopK(ratio=0.1, error_feedback=True)
    comp.compress(_grad(100), key="a")
    comp.compress(_grad(50, dtype=torch.float16), key=("b", 1))
    assert comp.residual("b") is None and comp.residual(("b", 1)).dtype == torch.float32
    assert comp.residual_bytes == 4 * 150
    comp.compress(_grad(100, seed=1), key="a")
    assert comp.residual_bytes == 4 * 150  # reused, not grown
    comp.reset()
    assert comp.residual_bytes == 0 and comp.residual("a") is None
    # After reset the key starts afresh, with any size.
    comp.compress(_grad(10), key="a")
    assert comp.residual_bytes == 40


@pytest.mark.parametrize("grad, error, match", [
    ([1.0, 2.0], TypeError, "grad must be a torch.Tensor"),
    (np.ones(4, np.float32), TypeError, "grad must be a torch.Tensor"),
    (torch.ones(4, dtype=torch.int32), TypeError, "float32, float16 or bfloat16"),
    (torch.ones(4, dtype=torch.float64), TypeError, r"grad.float\(\)"),
    (torch.ones(2, 3), ValueError, r"1-D.*reshape\(-1\)"),
    (torch.tensor(1.0), ValueError, "1-D"),
    (torch.ones(8)[::2], ValueError, r"contiguous\(\)"),
    (torch.empty(2**31, device="meta"), ValueError, "use smaller sub-groups"),
])
def test_bad_gradients(grad, error, match):
    with pytest.raises(error, match=match):
        TopK().compress(grad)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"ratio": 0.0}, ValueError, r"ratio=0.0 is outside \(0, 1\]"),
    ({"ratio": 1.5}, ValueError, "ratio=1.5"),
    ({"ratio": -0.1}, ValueError, "ratio=-0.1"),
    ({"ratio": math.nan}, ValueError, "ratio=nan"),
    ({"ratio": "0.1"}, TypeError, "ratio must be a number"),
    ({"ratio": True}, TypeError, "ratio must be a number"),
    ({"value_dtype": torch.float32}, TypeError, "value_dtype"),
    ({"value_dtype": "float16"}, TypeError, "value_dtype"),
    ({"error_feedback": 1}, TypeError, "error_feedback must be a bool"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        TopK(**kwargs)


def test_bad_k_argument():
    with pytest.raises(ValueError, match="numel must be a non-negative int"):
        TopK().k(-1)


def test_error_feedback_key_errors():
    comp = TopK(ratio=0.1, error_feedback=True)
    with pytest.raises(ValueError, match="key is required"):
        comp.compress(_grad(10))
    comp.compress(_grad(10), key=7)
    before = comp.residual(7).clone()
    with pytest.raises(ValueError, match="had 10 elements, now 11"):
        comp.compress(_grad(11), key=7)
    assert torch.equal(comp.residual(7), before)  # a refused call changes nothing


def test_compressed_checks_its_fields():
    idx, val = torch.tensor([1, 3], dtype=torch.int32), torch.ones(2, dtype=torch.float16)
    assert Compressed(idx, val, 4).nbytes == 12
    with pytest.raises(ValueError, match="int32"):
        Compressed(idx.long(), val, 4)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        Compressed(idx, val.float(), 4)
    with pytest.raises(ValueError, match="shape of indices"):
        Compressed(idx, val[:1], 4)
    with pytest.raises(ValueError, match="2 kept elements for numel=1"):
        Compressed(idx, val, 1)
    with pytest.raises(TypeError, match="c must be a Compressed"):
        decompress((idx, val, 4))


@CUDA
@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
def test_cuda_matches_cpu(value_dtype):
    g = _grad(4096, seed=3)
    comp = TopK(ratio=0.01, value_dtype=value_dtype)
    c = comp.compress(g.cuda())
    assert c.indices.is_cuda and c.values.is_cuda
    _assert_valid_topk(g, c, comp.k(4096))
    assert set(c.indices.tolist()) == _brute_force_topk(g, comp.k(4096))
    dense = decompress(c)
    assert dense.is_cuda
    assert torch.equal(dense.cpu(), decompress(comp.compress(g)))


@CUDA
def test_cuda_error_feedback():
    comp = TopK(ratio=0.05, error_feedback=True)
    grads = [_grad(1000, seed=s) for s in range(5)]
    sent = torch.zeros(1000, dtype=torch.float64)
    for g in grads:
        sent += decompress(comp.compress(g.cuda(), key="p")).double().cpu()
    assert comp.residual("p").is_cuda and comp.residual_bytes == 4000
    total = torch.stack(grads).double().sum(0)
    err = (sent + comp.residual("p").double().cpu() - total).abs().max().item()
    assert err <= 1e-5 * 5 * total.abs().max().item()
    with pytest.raises(ValueError, match="keep a sub-group on one device"):
        comp.compress(grads[0], key="p")
