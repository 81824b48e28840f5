"""The update kernel's time against the gradients' magnitude: fp32 AdamW over resident states
(256 Mi params, all cores but one), gradients N(0, s^2) for several s, alternating, twice.
On CPUs that take a microcode assist for subnormal operands or results (many Intel cores),
gradients whose squares fall below 2^-126 (s ~ 1e-20) slow the kernel down; this says by
how much on the machine at hand.

    python bench/kernel_magnitudes.py [DIR]
"""
import sys
import tempfile
import time

import numpy as np

import smartinf

N = 1 << 28
SCALES = (1.0, 1e-3, 1e-20, 1e-30)


def main() -> None:
    directory = tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None)
    pipe = smartinf.Pipeline([directory], smartinf.AdamW(lr=1e-3), memory_budget=N * 12 + (64 << 20),
                             overlap=False, commit_every=1000)
    pipe.add_subgroup(N, init=np.random.default_rng(0).standard_normal(N, np.float32))
    out = np.empty(N, np.float32)
    grads = {s: (np.random.default_rng(1).standard_normal(N, np.float32) * np.float32(s))
             for s in SCALES}
    times: dict = {s: [] for s in SCALES}
    for _ in range(2):
        for s in SCALES:
            before = pipe.stats["busy_compute"]
            t = time.perf_counter()
            with pipe.step():
                pipe.update(0, grads[s], out).wait()
            times[s].append((time.perf_counter() - t, pipe.stats["busy_compute"] - before))
    for s in SCALES:
        print(f"grad scale {s:g}: step {min(t for t, _ in times[s]):.3f} s, kernel "
              f"{min(k for _, k in times[s]):.3f} s ({N / min(k for _, k in times[s]) / 1e9:.2f} Gparam/s)")
    pipe.discard()
    pipe.close()


if __name__ == "__main__":
    main()
