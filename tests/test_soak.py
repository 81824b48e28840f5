"""Soak: 1000 steps of a small pipeline (two devices, compressed and dense updates,
state reads) with the resident memory and the open file descriptors sampled every 100
steps: both stay flat after the first 100 (a leak of one buffer, descriptor or thread
per step would show)."""
import os

import numpy as np
import torch

import smartinf
from smartinf.pipeline.compress import Compressed

STEPS = 1000
SIZES = [3000, 2000]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_memory_and_descriptors_stay_flat(tmp_path):
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    index = np.arange(0, SIZES[1], 7, dtype=np.int32)
    sparse = Compressed(torch.from_numpy(index), torch.randn(index.size, dtype=torch.float16), SIZES[1])
    outs = [np.empty(n, np.float16) for n in SIZES]
    samples = []
    with smartinf.Pipeline([str(tmp_path / "a"), str(tmp_path / "b")], chunk=1000, slots=2) as pipe:
        for n in SIZES:
            pipe.add_subgroup(n)
        for step in range(1, STEPS + 1):
            with pipe.step():
                pipe.update(0, grads[0], outs[0], lr=1e-4)
                pipe.update(1, sparse if step % 2 else grads[1], outs[1], lr=1e-4)
            if step % 10 == 0:
                pipe.read_states(step % 2)
            if step % 100 == 0:
                samples.append((step, rss_bytes(), open_fds()))
        assert pipe.step_count == STEPS
    print("\nsoak (step, rss MiB, fds):", [(s, round(r / 2**20, 1), f) for s, r, f in samples])
    rss = [r for _, r, _ in samples]
    assert max(rss) - rss[0] < 2 << 20, f"resident memory grew by {(max(rss) - rss[0]) / 2**20:.1f} MiB"
    assert len({f for _, _, f in samples}) == 1, "open file descriptors changed"
