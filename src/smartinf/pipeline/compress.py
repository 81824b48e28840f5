"""SmartComp: top-k gradient compression (Smart-Infinity, HPCA'24).

The gradient of each parameter sub-group (a flat 1-D tensor) is compressed on its own
device (GPU when the model is on GPU, else CPU) into the indices and values of its k
largest magnitudes, so only about 6 B per kept element (int32 index + fp16/bf16 value)
cross the host link. The near-storage device decompresses (zeroes the gradient and
scatters the values) before the optimizer update; :func:`decompress` is the torch
reference of that step.

Error feedback (optional) keeps, per sub-group ``key``, what was not transmitted (the
dropped elements and the fp16/bf16 rounding error of the sent ones) and adds it to the
next gradient. The residuals live on the gradient's device in fp32: **4 B per gradient
element of every sub-group**, i.e. as much memory as an fp32 copy of all gradients.

NaN/inf are not hidden: topk ranks them as the largest magnitudes, so they are sent. The
caller checks overflow on the dense gradients before compressing (the optimizer does) and
skips compression on an overflowed step, which also keeps the residuals clean. With
``value_dtype=torch.float16`` finite magnitudes above 65504 become inf; use bfloat16 when
unscaled gradients can be that large.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, Hashable, Optional

import torch

logger = logging.getLogger("smartinf")

# Defaults: the only setting within 5 % of dense final loss on the demo GPT (numbers in
# docs/torch.md, SmartComp; rerun with bench/gpt_topk_accuracy.py).
DEFAULT_RATIO = 0.1
DEFAULT_ERROR_FEEDBACK = False

_VALUE_DTYPES = (torch.float16, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_NUMEL = 2**31 - 1  # indices are int32
#: torch's CPU topk of a 1-D tensor runs on one thread (0.42 s of a 23 M-param sub-group,
#: the demo's top-k step): on the CPU the k largest are chosen among the elements at or
#: above a threshold this many sampled magnitudes put below the k-th largest.
SAMPLE = 1 << 16


def largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest of ``mag`` (magnitudes; NaN ranks largest), in no
    order: ``torch.topk``'s (among equal values at the k-th, any). On a CPU tensor of many
    more elements than ``SAMPLE``, torch.topk runs on those at or above a sampled quantile
    with a margin far beyond the sample's error; where fewer than ``k`` are, on all."""
    n = mag.numel()
    if mag.is_cpu and n > 16 * SAMPLE and k < n // 4:
        picked = torch.randint(n, (SAMPLE,), generator=torch.Generator().manual_seed(0))
        sample = mag[picked].float().nan_to_num(nan=math.inf)
        below = max(0.0, 1.0 - 2.0 * k / n - 4.0 / math.sqrt(SAMPLE))
        candidates = ((mag >= torch.quantile(sample, below)) | mag.isnan()).nonzero().squeeze(1)
        if candidates.numel() >= k:  # (then the k largest are all among them)
            return candidates[torch.topk(mag[candidates], k, sorted=False)[1]]
    return torch.topk(mag, k, sorted=False)[1]


@dataclass(frozen=True)
class Compressed:
    """A compressed gradient: ``values`` at ``indices`` of a dense gradient of ``numel``.

    ``indices`` are int32, 1-D and strictly ascending; ``values`` are float16 or bfloat16
    of the same length, on the same device.
    """

    indices: torch.Tensor
    values: torch.Tensor
    numel: int

    def __post_init__(self) -> None:
        # Metadata only: checking the ascending order would synchronise with the GPU.
        if self.indices.dtype != torch.int32 or self.indices.dim() != 1:
            raise ValueError(f"indices must be a 1-D int32 tensor, got {self.indices.dtype} "
                             f"with shape {tuple(self.indices.shape)}")
        if self.values.dtype not in _VALUE_DTYPES or self.values.shape != self.indices.shape:
            raise ValueError(f"values must be float16/bfloat16 with the shape of indices "
                             f"{tuple(self.indices.shape)}, got {self.values.dtype} with shape "
                             f"{tuple(self.values.shape)}")
        if self.values.device != self.indices.device:
            raise ValueError(f"indices ({self.indices.device}) and values "
                             f"({self.values.device}) must be on the same device")
        if not 0 <= self.indices.numel() <= self.numel:
            raise ValueError(f"{self.indices.numel()} kept elements for numel={self.numel}")

    @property
    def nbytes(self) -> int:
        """Bytes that cross the host link: 4 per index + 2 per value (6 per kept element)."""
        return (self.indices.numel() * self.indices.element_size()
                + self.values.numel() * self.values.element_size())


class TopK:
    """Keeps the ``k(numel)`` largest-magnitude elements of each gradient.

    ratio: fraction of the elements kept, in (0, 1].
    value_dtype: torch.float16 or torch.bfloat16, the type of the sent values.
    error_feedback: carry what was not sent into the next ``compress`` of the same key
        (costs 4 B of fp32 per gradient element, see :attr:`residual_bytes`).
    """

    def __init__(self, ratio: float = DEFAULT_RATIO, value_dtype: torch.dtype = torch.float16,
                 error_feedback: bool = DEFAULT_ERROR_FEEDBACK) -> None:
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
            raise TypeError(f"ratio must be a number, got {type(ratio).__name__}")
        if not (0.0 < ratio <= 1.0):  # also rejects NaN
            raise ValueError(f"ratio={ratio!r} is outside (0, 1]")
        if value_dtype not in _VALUE_DTYPES:
            raise TypeError(f"value_dtype must be torch.float16 or torch.bfloat16, got {value_dtype!r}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        self.ratio = float(ratio)
        self.value_dtype = value_dtype
        self.error_feedback = error_feedback
        self._residuals: Dict[Hashable, torch.Tensor] = {}

    def k(self, numel: int) -> int:
        """Elements kept out of ``numel``: max(1, ceil(ratio*numel)), at most ``numel``."""
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        x = self.ratio * numel
        # 0.07 * 100 == 7.000000000000001 in binary: snap float noise before the ceil.
        nearest = round(x)
        k = nearest if abs(x - nearest) <= 1e-9 * max(1.0, x) else math.ceil(x)
        return min(numel, max(1, k))

    @torch.no_grad()
    def compress(self, grad: torch.Tensor, key: Optional[Hashable] = None) -> Compressed:
        """Top-k of ``grad`` (plus the residual of ``key`` with error feedback).

        grad: 1-D contiguous fp32/fp16/bf16 tensor, on any device; the result is there too.
        key: the sub-group's identity (hashable); required with error feedback.
        """
        self._check_grad(grad)
        numel = grad.numel()
        if self.error_feedback:
            acc = self._accumulate(grad, key)
        else:
            acc = grad
        k = self.k(numel)
        # a selection, not a full sort (``largest``), then sort only the k kept
        idx, _ = torch.sort(largest(acc.abs(), k))
        kept = acc[idx]
        values = kept.to(self.value_dtype)
        if self.error_feedback:
            # Not transmitted: the dropped elements (already in acc) and the rounding error.
            acc[idx] = kept - values.float()
        return Compressed(idx.to(torch.int32), values, numel)

    def reset(self) -> None:
        """Drops all error-feedback residuals."""
        if self._residuals:
            logger.debug("TopK: dropping %d residuals (%d B)", len(self._residuals),
                         self.residual_bytes)
        self._residuals.clear()

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The fp32 residual of ``key`` (not sent yet), or None; updated in place."""
        return self._residuals.get(key)

    @property
    def residual_bytes(self) -> int:
        """Memory held by the residuals now: 4 B per element of every sub-group seen."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def _accumulate(self, grad: torch.Tensor, key: Optional[Hashable]) -> torch.Tensor:
        """grad + residual of ``key``, computed in place in the (fp32) residual."""
        if key is None:
            raise ValueError("key is required with error_feedback=True: pass the sub-group's "
                             "identity (e.g. its index) to compress()")
        residual = self._residuals.get(key)
        if residual is None:
            residual = grad.to(torch.float32, copy=True)
            self._residuals[key] = residual
            logger.debug("TopK: new residual for key %r: %d elements on %s (%d B)",
                         key, residual.numel(), residual.device, residual.numel() * 4)
            return residual
        if residual.numel() != grad.numel():
            raise ValueError(f"key {key!r} had {residual.numel()} elements, now "
                             f"{grad.numel()}: use one key per sub-group, or reset()")
        if residual.device != grad.device:
            raise ValueError(f"key {key!r} has its residual on {residual.device}, the gradient "
                             f"is on {grad.device}: keep a sub-group on one device, or reset()")
        return residual.add_(grad)

    @staticmethod
    def _check_grad(grad: torch.Tensor) -> None:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
        if grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"grad must be float32, float16 or bfloat16, got {grad.dtype}: "
                            f"cast it first (e.g. grad.float())")
        if grad.dim() != 1:
            raise ValueError(f"grad must be 1-D (a flat sub-group), got shape "
                             f"{tuple(grad.shape)}: flatten it first (grad.reshape(-1))")
        if not grad.is_contiguous():
            raise ValueError("grad must be contiguous: call grad.contiguous() first")
        if grad.numel() > _MAX_NUMEL:
            raise ValueError(f"grad has {grad.numel()} elements, more than int32 indices "
                             f"address ({_MAX_NUMEL}): use smaller sub-groups")


@torch.no_grad()
def decompress(c: Compressed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense gradient of ``c``: zeros with ``c.values`` at ``c.indices``, on c's device."""
    if not isinstance(c, Compressed):
        raise TypeError(f"c must be a Compressed, got {type(c).__name__}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    out = torch.zeros(c.numel, dtype=dtype, device=c.indices.device)
    out.index_copy_(0, c.indices.long(), c.values.to(dtype))
    return out
