"""The int4 state scheme of src/native/kernels/quant4.h (codes placed as
src/native/store/layout.h says) in numpy float32, operation for operation, so the native
updates (Adam's and Lion's) can be checked bit for bit against it.

First moment: blocks of 128, lpmm's 4-bit dynamic-exponent map, scale = the block's
largest magnitude with its sign (the positive one on a tie).
Second moment (v itself): 128 x 128 tiles of the chunk's flat params, row by row; element
(r, c)'s scale is min(row max r, column max c); the powers of two without zero, 2^(i - 15).
Nearest value, ties to the smaller one (the count of midpoints strictly below x)."""
import numpy as np

from quant8_reference import adam_first_moment

F = np.float32
BLOCK = 128
TILE = BLOCK * BLOCK
# lpmm's create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4), float32 bits
DYNAMIC = np.array([float.fromhex(h) for h in (
    "-0x1.c66666p-1", "-0x1.533334p-1", "-0x1.cp-2", "-0x1.b33332p-3",
    "-0x1.3d70a4p-4", "-0x1.0a3d72p-5", "-0x1.6872b0p-8", "0x0p+0",
    "0x1.6872b0p-8", "0x1.0a3d72p-5", "0x1.3d70a4p-4", "0x1.b33332p-3",
    "0x1.cp-2", "0x1.533334p-1", "0x1.c66666p-1", "0x1p+0")], np.float32)
POW2 = np.ldexp(np.float32(1), np.arange(16) - 15).astype(np.float32)


def midpoints(values):
    return ((values[:-1] + values[1:]) * F(0.5)).astype(np.float32)


DYNAMIC_MID, POW2_MID = midpoints(DYNAMIC), midpoints(POW2)


def nearest(x, mids):
    """Codes of x (float32): how many midpoints lie strictly below each value."""
    x = np.asarray(x, np.float32)
    return (x[..., None] > mids).sum(axis=-1).astype(np.uint8)


def divisor(s):
    s = np.asarray(s, np.float32)
    return np.where(s != 0, s, F(1)).astype(np.float32)


def extreme(m):
    """A first-moment block's scale: its largest magnitude, signed (positive on a tie)."""
    m = np.asarray(m, np.float32)
    a, negative = np.abs(m), np.signbit(m)
    pos = a[~negative].max() if (~negative).any() else F(0)
    neg = a[negative].max() if negative.any() else F(0)
    return F(-neg) if neg > pos else F(pos)


def encode_first(m, scale):
    return nearest(np.asarray(m, np.float32) / divisor(scale), DYNAMIC_MID)


def decode_first(codes, scale):
    return (DYNAMIC[codes] * F(scale)).astype(np.float32)


def chunk_spans(n, chunk, size):
    """(lo, hi) of every block (size 128) or tile (size 16384): they restart at each chunk."""
    return [(lo, min(lo + size, c + chunk, n)) for c in range(0, n, chunk)
            for lo in range(c, min(c + chunk, n), size)]


def tile_scales(v):
    """128 row maxima, 128 column maxima of a tile's values (v >= 0), 0 where it has none."""
    length = v.size
    padded = np.zeros(TILE, np.float32)
    padded[:length] = v
    grid = padded.reshape(BLOCK, BLOCK)
    return grid.max(axis=1).astype(np.float32), grid.max(axis=0).astype(np.float32)


def element_scales(rmax, cmax, length):
    """min(row max, column max) of each of a tile's `length` elements."""
    return np.minimum(rmax[:, None], cmax[None, :]).ravel()[:length].astype(np.float32)


def encode_second(v, rmax, cmax):
    v = np.asarray(v, np.float32)
    return nearest(v / divisor(element_scales(rmax, cmax, v.size)), POW2_MID)


def decode_second(codes, rmax, cmax):
    return (POW2[codes] * element_scales(rmax, cmax, codes.size)).astype(np.float32)


def pack(codes):
    """Two codes a byte, the low nibble for the even param; an odd count leaves the last
    byte's high nibble 0."""
    c = np.zeros(codes.size + codes.size % 2, np.uint8)
    c[:codes.size] = codes
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


class Int4States:
    """One sub-group's int4 states (per chunk: blocks and tiles), with `moments` = 1 (Lion:
    exp_avg) or 2 (Adam: exp_avg, exp_avg_sq); codes kept unpacked, one a param."""

    def __init__(self, param, moments, chunk):
        self.chunk, self.moments = chunk, moments
        self.param = np.array(param, np.float32)
        n = self.param.size
        self.blocks = chunk_spans(n, chunk, BLOCK)
        self.tiles = chunk_spans(n, chunk, TILE)
        self.mq = np.zeros(n, np.uint8)
        self.ms = np.zeros(len(self.blocks), np.float32)
        if moments > 1:
            self.vq = np.zeros(n, np.uint8)
            self.rmax = np.zeros((len(self.tiles), BLOCK), np.float32)
            self.cmax = np.zeros((len(self.tiles), BLOCK), np.float32)

    def store(self, m, v=None):
        for b, (lo, hi) in enumerate(self.blocks):
            self.ms[b] = extreme(m[lo:hi])
            self.mq[lo:hi] = encode_first(m[lo:hi], self.ms[b])
        if v is not None:
            for t, (lo, hi) in enumerate(self.tiles):
                self.rmax[t], self.cmax[t] = tile_scales(v[lo:hi])
                self.vq[lo:hi] = encode_second(v[lo:hi], self.rmax[t], self.cmax[t])

    def exp_avg(self):
        m = np.empty(self.param.size, np.float32)
        for b, (lo, hi) in enumerate(self.blocks):
            m[lo:hi] = decode_first(self.mq[lo:hi], self.ms[b])
        return m

    def exp_avg_sq(self):
        v = np.empty(self.param.size, np.float32)
        for t, (lo, hi) in enumerate(self.tiles):
            v[lo:hi] = decode_second(self.vq[lo:hi], self.rmax[t], self.cmax[t])
        return v

    def extent(self, lo, hi, master=True):
        """The bytes of the chunk [lo, hi) as store/layout.h lays them out after the master:
        (fp32 params), each moment's packed codes padded to 4 B, the first moment's block
        scales, then (Adam) per tile 128 row maxima and 128 column maxima."""
        def padded(b):
            return b + bytes(-len(b) % 4)
        first = next(b for b, (a, _) in enumerate(self.blocks) if a == lo)
        last = next(b for b, (_, z) in enumerate(self.blocks) if z == hi) + 1
        out = self.param[lo:hi].tobytes() if master else b""
        out += padded(pack(self.mq[lo:hi]).tobytes())
        if self.moments > 1:
            out += padded(pack(self.vq[lo:hi]).tobytes())
        out += self.ms[first:last].tobytes()
        if self.moments > 1:
            t0 = next(t for t, (a, _) in enumerate(self.tiles) if a == lo)
            t1 = next(t for t, (_, z) in enumerate(self.tiles) if z == hi) + 1
            out += np.concatenate([self.rmax[t0:t1], self.cmax[t0:t1]], axis=1).tobytes()
        return out


def bf16_round(x):
    """fp32 -> bf16 (as uint16 bits): to nearest, ties away from zero (kernels/numeric.h)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


class Int4Adam(Int4States):
    """Adam/AdamW on int4 states: fp32 params (masters), codes and scales, updated as adam4 does."""

    def __init__(self, param, exp_avg, exp_avg_sq, chunk):
        super().__init__(param, 2, chunk)
        self.store(np.asarray(exp_avg, np.float32), np.asarray(exp_avg_sq, np.float32))

    def states(self):
        return {"param": self.param.copy(), "exp_avg": self.exp_avg(), "exp_avg_sq": self.exp_avg_sq()}

    def step(self, grad, t, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale=1.0):
        """One step (adam.h's formula on decoded moments); returns the fp32 params out."""
        p, g, m, neg_step, bias2_sqrt = adam_first_moment(
            self.param, grad, self.exp_avg(), t, lr, beta1, beta2, weight_decay, decoupled,
            grad_scale)
        one_minus_beta2 = F(1.0 - beta2)
        v = self.exp_avg_sq() * F(beta2) + one_minus_beta2 * g * g
        denom = np.sqrt(v) / bias2_sqrt + F(eps)
        self.param = (p + neg_step * (m / denom)).astype(np.float32)
        self.store(m.astype(np.float32), v.astype(np.float32))
        return self.param.copy()


class Int4Lion(Int4States):
    """Lion with an int4 momentum, updated as lion4 does."""

    def __init__(self, param, exp_avg, chunk):
        super().__init__(param, 1, chunk)
        self.store(np.asarray(exp_avg, np.float32))

    def states(self):
        return {"param": self.param.copy(), "exp_avg": self.exp_avg()}

    def step(self, grad, lr, beta1, beta2, weight_decay, grad_scale=1.0):
        """One step (lion.h's element on the decoded momentum); returns the fp32 params out."""
        g = np.asarray(grad, np.float32) * F(grad_scale)
        m = self.exp_avg()
        c = m * F(beta1) + g * F(1.0 - beta1)
        sign = (c > 0).astype(np.float32) - (c < 0).astype(np.float32)
        self.param = (self.param * F(1.0 - lr * weight_decay) + F(-lr) * sign).astype(np.float32)
        self.store((m * F(beta2) + g * F(1.0 - beta2)).astype(np.float32))
        return self.param.copy()
