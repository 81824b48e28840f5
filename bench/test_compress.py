"""SmartComp: top-k compression time on the gradient's device vs the host-link time saved.

Per 10^8 gradient elements (``SMARTINF_BENCH_TOPK_NUMEL``; CUDA when present, else the
CPU): the time of ``TopK(ratio).compress`` and, measured in the same run, the time the
dense gradient would take over the device->host link minus that of the compressed pairs.
Compression pays off where ``saved / compress`` > 1.
"""
from __future__ import annotations

import time

import pytest
import torch

from conftest import env_int
from smartinf.pipeline.compress import TopK, largest

NUMEL = env_int("SMARTINF_BENCH_TOPK_NUMEL", 10**8)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUNDS = 5


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _link_bps(nbytes: int) -> float:
    """Device->host copy bandwidth into pinned memory (a plain memcpy on the CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dst.copy_(src)
    return nbytes / min(_timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(ROUNDS))


@pytest.mark.parametrize("ratio", [0.01, 0.001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_vs_link_time(benchmark, summary, ratio, dtype):
    grad = torch.randn(NUMEL, dtype=dtype, device=DEVICE)
    topk = TopK(ratio)
    topk.compress(grad)  # warm-up: kernels, allocator
    seconds = []
    benchmark.pedantic(lambda: seconds.append(_timed(lambda: topk.compress(grad))),
                       rounds=ROUNDS, iterations=1)
    compress_s = min(seconds)
    dense = NUMEL * grad.element_size()
    packed = topk.k(NUMEL) * 6
    bps = _link_bps(dense)
    saved_s = (dense - packed) / bps
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "numel": NUMEL, "grad_dtype": str(dtype), "ratio": ratio,
              "compress_s": compress_s, "compress_s_per_1e8": compress_s * 1e8 / NUMEL,
              "dense_bytes": dense, "compressed_bytes": packed, "link_bytes_per_s": bps,
              "link_s_saved": saved_s, "saved_over_compress": saved_s / compress_s}
    benchmark.extra_info.update(result)
    summary.setdefault("topk", {})[f"{DEVICE}_{str(dtype)[6:]}_{ratio}"] = result


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_cpu_selection_vs_torch_topk(benchmark, summary, ratio):
    """On the CPU: ``compress.largest`` (sampled candidates, then torch.topk among them)
    against torch.topk over the whole gradient, alternated in one run, on the demo GPT's
    sub-group size (23 M) unless ``SMARTINF_BENCH_TOPK_CPU_NUMEL`` says otherwise; the same
    set of indices."""
    numel = env_int("SMARTINF_BENCH_TOPK_CPU_NUMEL", 23_000_000)
    mag = torch.randn(numel, generator=torch.Generator().manual_seed(0)).abs()
    k = TopK(ratio).k(numel)
    ours, theirs = [], []
    for _ in range(ROUNDS):
        theirs.append(_timed(lambda: torch.topk(mag, k, sorted=False)))
        ours.append(_timed(lambda: largest(mag, k)))
    benchmark.pedantic(lambda: largest(mag, k), rounds=1, iterations=1)
    assert set(largest(mag, k).tolist()) == set(torch.topk(mag, k, sorted=False)[1].tolist())
    result = {"numel": numel, "ratio": ratio, "largest_s": min(ours), "torch_topk_s": min(theirs),
              "speedup": min(theirs) / min(ours)}
    benchmark.extra_info.update(result)
    summary.setdefault("topk_cpu_selection", {})[str(ratio)] = result
