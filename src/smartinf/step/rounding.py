"""How smartinf rounds fp32 masters to bf16 params, in torch: to nearest, ties away from
zero -- the devices' rule (``kernels/numeric.h``), the one a split master can be rebuilt
from (``master="split"``). It differs from torch's ``.to(torch.bfloat16)`` (nearest-even)
only at exact ties, one value in 65536, by one bf16 ulp; wherever smartinf writes a master
into a bf16 param it rounds with this, so the params are the ones the devices emit."""
from __future__ import annotations

import torch


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, any device) rounded to bf16 as the devices round it."""
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    high = ((bits + 0x8000) >> 16) & 0xFFFF  # int32 wraps; the low 16 bits are the bf16
    high = (high - ((high & 0x8000) << 1)).to(torch.int16)  # as a signed 16-bit pattern
    out = high.view(torch.bfloat16)
    return torch.where(torch.isnan(x), torch.full_like(out, float("nan")), out)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 masters ``x`` as params of ``dtype``: bf16 by ``to_bf16``, others as torch."""
    return to_bf16(x) if dtype == torch.bfloat16 and x.dtype == torch.float32 else x.to(dtype)
