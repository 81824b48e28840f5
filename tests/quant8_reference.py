"""The int8 state scheme of src/native/kernels/quant8.h (codes placed as
src/native/store/layout.h says) in numpy float32, operation for operation, so the native
updates (Adam's and Lion's) can be checked bit for bit against it."""
import numpy as np

BLOCK = 256
SIGNED_BIAS, UNSIGNED_BIAS = 15, 31
F = np.float32


def adam_first_moment(param, grad, m_old, t, lr, beta1, beta2, weight_decay, decoupled,
                      grad_scale):
    """adam.h's start of a step on decoded moments, as the int8 and int4 references share
    it: (params after decoupled decay, the gradient (scaled, with L2 decay), the new first
    moment, -lr / bias1, sqrt(bias2))."""
    one_minus_beta1 = F(1.0 - beta1)
    neg_step = F(-(lr / (1.0 - beta1 ** t)))
    bias2_sqrt = F(np.sqrt(1.0 - beta2 ** t))
    g = np.asarray(grad, np.float32) * F(grad_scale)
    p = param
    if decoupled:
        p = p * F(1.0 - lr * weight_decay)
    else:
        g = g + F(weight_decay) * p
    if abs(one_minus_beta1) < 0.5:
        m = m_old + one_minus_beta1 * (g - m_old)
    else:
        m = g - (g - m_old) * (F(1.0) - one_minus_beta1)
    return p, g, m, neg_step, bias2_sqrt


def encode_magnitude(a, bias):
    a = np.asarray(a, np.float32)
    subnormal = a < F(2.0 ** (1 - bias))
    as_ = np.where(subnormal, a, F(0))
    sub = ((as_ * F(2.0 ** (bias + 2)) + F(2 ** 23)) - F(2 ** 23)).astype(np.uint32)
    b = a.view(np.uint32)
    mant = b & np.uint32(0x7FFFFF)
    rounded = (mant + np.uint32(0x7FFFF) + ((mant >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    with np.errstate(over="ignore"):
        normal = (((b >> np.uint32(23)) - np.uint32(127) + np.uint32(bias)) << np.uint32(3)) + rounded
    return np.where(subnormal, sub, normal).astype(np.uint32)


def decode_magnitude(code, bias):
    code = np.asarray(code, np.uint32)
    e, f = code >> np.uint32(3), code & np.uint32(7)
    sub = f.astype(np.float32) * F(2.0 ** -(bias + 2))
    with np.errstate(over="ignore"):
        normal = (((e - np.uint32(bias) + np.uint32(127)) << np.uint32(23)) | (f << np.uint32(20)))
    return np.where(e == 0, sub, normal.astype(np.uint32).view(np.float32))


def quantize_signed(m):
    """(codes, scale) of one block of a signed moment (exp_avg)."""
    m_max = F(np.max(np.abs(m)))
    if m_max > 0:
        mq = encode_magnitude(np.abs(m) * (F(1) / m_max), SIGNED_BIAS) | \
            np.where(np.signbit(m), np.uint32(0x80), np.uint32(0))
    else:
        mq = np.zeros(m.shape, np.uint32)
    return mq.astype(np.uint8), m_max


def quantize_unsigned(w):
    """(codes, scale) of one block of a root (sqrt(exp_avg_sq)): a positive one never codes 0."""
    w_max = F(np.max(w))
    if w_max > 0:
        wq = encode_magnitude(w * (F(1) / w_max), UNSIGNED_BIAS)
        wq = np.where((w > 0) & (wq == 0), np.uint32(1), wq)
    else:
        wq = np.zeros(w.shape, np.uint32)
    return wq.astype(np.uint8), w_max


def quantize_block(m, w):
    """(m codes, w codes, m scale, w scale) of one block of exp_avg and sqrt(exp_avg_sq)."""
    mq, m_max = quantize_signed(m)
    wq, w_max = quantize_unsigned(w)
    return mq, wq, m_max, w_max


def chunk_blocks(n, chunk):
    """(lo, hi) of every block: blocks restart at each chunk."""
    return [(lo, min(lo + BLOCK, c + chunk, n)) for c in range(0, n, chunk)
            for lo in range(c, min(c + chunk, n), BLOCK)]


def decode_m(mq, scale):
    a = decode_magnitude(mq.astype(np.uint32) & np.uint32(0x7F), SIGNED_BIAS) * F(scale)
    return np.where(mq & 0x80, -a, a).astype(np.float32)


def decode_w(wq, scale):
    return (decode_magnitude(wq, UNSIGNED_BIAS) * F(scale)).astype(np.float32)


class Int8Adam:
    """Per chunk and block: fp32 params, codes and scales, updated as the kernel does."""

    def __init__(self, param, exp_avg, exp_avg_sq, chunk):
        self.chunk = chunk
        self.param = np.array(param, np.float32)
        n = self.param.size
        self.blocks = chunk_blocks(n, chunk)
        self.mq = np.zeros(n, np.uint8)
        self.wq = np.zeros(n, np.uint8)
        self.ms = np.zeros(len(self.blocks), np.float32)
        self.ws = np.zeros(len(self.blocks), np.float32)
        self._store(np.asarray(exp_avg, np.float32), np.sqrt(np.asarray(exp_avg_sq, np.float32)))

    def _store(self, m, w):
        for b, (lo, hi) in enumerate(self.blocks):
            self.mq[lo:hi], self.wq[lo:hi], self.ms[b], self.ws[b] = quantize_block(m[lo:hi], w[lo:hi])

    def states(self):
        m = np.empty(self.param.size, np.float32)
        w = np.empty(self.param.size, np.float32)
        for b, (lo, hi) in enumerate(self.blocks):
            m[lo:hi] = decode_m(self.mq[lo:hi], self.ms[b])
            w[lo:hi] = decode_w(self.wq[lo:hi], self.ws[b])
        return {"param": self.param.copy(), "exp_avg": m, "exp_avg_sq": w * w}

    def step(self, grad, t, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale=1.0):
        """One step (adam.h's formula on decoded moments); returns the fp32 params out."""
        p, g, m, neg_step, bias2_sqrt = adam_first_moment(
            self.param, grad, self.states()["exp_avg"], t, lr, beta1, beta2, weight_decay,
            decoupled, grad_scale)
        one_minus_beta2 = F(1.0 - beta2)
        w_dec = np.empty_like(m)
        for b, (lo, hi) in enumerate(self.blocks):
            w_dec[lo:hi] = decode_w(self.wq[lo:hi], self.ws[b])
        v = (w_dec * w_dec) * F(beta2) + one_minus_beta2 * g * g
        root = np.sqrt(v)
        denom = root / bias2_sqrt + F(eps)
        self.param = (p + neg_step * (m / denom)).astype(np.float32)
        self._store(m, root)
        return self.param.copy()

    def extent(self, lo, hi):
        """The bytes of the chunk [lo, hi) as store/layout.h lays them out: param, both code
        arrays, padding to 4 B, both scale arrays."""
        first = next(b for b, (a, _) in enumerate(self.blocks) if a == lo)
        last = next(b for b, (_, z) in enumerate(self.blocks) if z == hi) + 1
        codes = self.param[lo:hi].tobytes() + self.mq[lo:hi].tobytes() + self.wq[lo:hi].tobytes()
        return codes + bytes(-len(codes) % 4) + self.ms[first:last].tobytes() + \
            self.ws[first:last].tobytes()


class Int8Lion:
    """Lion with an int8 momentum: fp32 params, exp_avg's codes and scales, updated as the
    kernel (lion8) does."""

    def __init__(self, param, exp_avg, chunk):
        self.param = np.array(param, np.float32)
        n = self.param.size
        self.blocks = chunk_blocks(n, chunk)
        self.mq = np.zeros(n, np.uint8)
        self.ms = np.zeros(len(self.blocks), np.float32)
        self._store(np.asarray(exp_avg, np.float32))

    def _store(self, m):
        for b, (lo, hi) in enumerate(self.blocks):
            self.mq[lo:hi], self.ms[b] = quantize_signed(m[lo:hi])

    def states(self):
        m = np.empty(self.param.size, np.float32)
        for b, (lo, hi) in enumerate(self.blocks):
            m[lo:hi] = decode_m(self.mq[lo:hi], self.ms[b])
        return {"param": self.param.copy(), "exp_avg": m}

    def step(self, grad, lr, beta1, beta2, weight_decay, grad_scale=1.0):
        """One step (lion.h's element on the decoded momentum); returns the fp32 params out."""
        g = np.asarray(grad, np.float32) * F(grad_scale)
        m = self.states()["exp_avg"]
        c = m * F(beta1) + g * F(1.0 - beta1)
        sign = (c > 0).astype(np.float32) - (c < 0).astype(np.float32)  # +0 for 0, as in C
        self.param = (self.param * F(1.0 - lr * weight_decay) + F(-lr) * sign).astype(np.float32)
        self._store(m * F(beta2) + g * F(1.0 - beta2))
        return self.param.copy()

    def extent(self, lo, hi):
        """The bytes of the chunk [lo, hi) as store/layout.h lays them out: param, codes,
        padding to 4 B, scales."""
        first = next(b for b, (a, _) in enumerate(self.blocks) if a == lo)
        last = next(b for b, (_, z) in enumerate(self.blocks) if z == hi) + 1
        codes = self.param[lo:hi].tobytes() + self.mq[lo:hi].tobytes()
        return codes + bytes(-len(codes) % 4) + self.ms[first:last].tobytes()
