"""How far Adam's update moves from fp32 states' when its moments are stored in int8 or
int4, one moment at a time: where a quantized run's early iterations depart from fp32's.

    python bench/int4_update_error.py [--params 131072] [--spike 5] [--out F.json]

Adam (betas 0.9, 0.999) on Gaussian gradients whose scale varies by 128-param row over
orders of magnitude (log-normal, sigma 1.5) and, at step ``--spike``, 8x larger (the loss
spike of the GPT-2 XL runs). After each step the states are stored and read back through
the numpy references of the kernels (tests/quant8_reference.py, tests/quant4_reference.py:
bit for bit the stored values), and the next update is compared with fp32 states' as
||u - u_fp32|| / ||u_fp32||. Rows: both int8 moments; int4's first moment only, its
second only, both (the int4 format); and other 4-bit maps for the first moment (lpmm's
dynamic-exponent map in blocks of 32, powers of two and of sqrt(2)) to see whether a map
choice would do what a bit width does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import quant4_reference as q4  # noqa: E402
import quant8_reference as q8  # noqa: E402

B1, B2, EPS = 0.9, 0.999, 1e-8


def first_int4(m, mags=None, block=q4.BLOCK):
    """m through a signed 4-bit map of ``mags`` (the positive magnitudes; default lpmm's
    dynamic-exponent map, as kernels/quant4.h) in blocks of ``block``."""
    if mags is None:
        values, mids, signed_scale = q4.DYNAMIC, q4.DYNAMIC_MID, True
    else:
        values = np.concatenate([-mags[::-1], [0.0], mags]).astype(np.float32)
        mids, signed_scale = q4.midpoints(values), False
    out = np.empty_like(m)
    for lo in range(0, m.size, block):
        b = m[lo:lo + block]
        s = q4.extreme(b) if signed_scale else (np.abs(b).max() or np.float32(1))
        out[lo:lo + block] = values[q4.nearest(b / q4.divisor(s), mids)] * s
    return out


def second_int4(v):
    out = np.empty_like(v)
    for lo in range(0, v.size, q4.TILE):
        rows, cols = q4.tile_scales(v[lo:lo + q4.TILE])
        out[lo:lo + q4.TILE] = q4.decode_second(q4.encode_second(v[lo:lo + q4.TILE], rows, cols), rows, cols)
    return out


def both_int8(m, v):
    out_m, out_v = np.empty_like(m), np.empty_like(v)
    for lo in range(0, m.size, q8.BLOCK):
        mq, wq, ms, ws = q8.quantize_block(m[lo:lo + q8.BLOCK], np.sqrt(v[lo:lo + q8.BLOCK]))
        out_m[lo:lo + q8.BLOCK], out_v[lo:lo + q8.BLOCK] = q8.decode_m(mq, ms), q8.decode_w(wq, ws) ** 2
    return out_m, out_v


def updates(grads, store):
    """Adam's update directions (lr 1) with the states passed through ``store(m, v)``."""
    m = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    out = []
    for t, g in enumerate(grads, 1):
        m = (B1 * m + (1 - B1) * g).astype(np.float32)
        v = (B2 * v + (1 - B2) * g * g).astype(np.float32)
        out.append((m / (1 - B1 ** t)) / (np.sqrt(v / (1 - B2 ** t)) + EPS))
        m, v = store(m, v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=8 * q4.TILE)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--spike", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    if args.params % q4.TILE:
        p.error(f"--params must be a multiple of {q4.TILE} (whole tiles)")
    rng = np.random.default_rng(0)
    rows = np.exp(rng.normal(0, 1.5, args.params // q4.BLOCK)).repeat(q4.BLOCK)
    grads = [(rng.normal(0, 1, args.params) * rows * (8 if t == args.spike else 1)).astype(np.float32)
             for t in range(1, args.steps + 1)]
    pow2 = (2.0 ** -np.arange(7)[::-1]).astype(np.float32)
    sqrt2 = (2.0 ** (-np.arange(7)[::-1] / 2)).astype(np.float32)
    dynamic = q4.DYNAMIC[q4.DYNAMIC > 0]
    stores = {
        "int8 (both moments)": both_int8,
        "int4 first moment only": lambda m, v: (first_int4(m), v),
        "int4 second moment only": lambda m, v: (m, second_int4(v)),
        "int4 (both moments)": lambda m, v: (first_int4(m), second_int4(v)),
        "int8 first, int4 second": lambda m, v: (both_int8(m, v)[0], second_int4(v)),
        "first: lpmm map, blocks of 32": lambda m, v: (first_int4(m, dynamic, 32), v),
        "first: powers of 2, blocks of 32": lambda m, v: (first_int4(m, pow2, 32), v),
        "first: powers of sqrt(2), blocks of 32": lambda m, v: (first_int4(m, sqrt2, 32), v),
    }
    reference = updates(grads, lambda m, v: (m, v))
    result = {"params": args.params, "spike": args.spike, "betas": [B1, B2], "rows": {}}
    print(f"{'states':<40} " + " ".join(f"step {t:<2}" for t in range(2, args.steps + 1)))
    for name, store in stores.items():
        errors = [float(np.linalg.norm(u - r) / np.linalg.norm(r))
                  for u, r in zip(updates(grads, store), reference)][1:]
        result["rows"][name] = errors
        print(f"{name:<40} " + " ".join(f"{e:7.3f}" for e in errors))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
