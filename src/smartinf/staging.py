"""Host staging for sub-group updates: two buffer pairs, so the gradient of the next
sub-group is gathered (and compressed) while the device updates the current one."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class Staging:
    """Two host buffer pairs (gradient in, params out) of ``size`` elements of up to 4
    bytes; pinned when CUDA is present so copies to and from the GPU run asynchronously."""

    def __init__(self, size: int) -> None:
        pin = torch.cuda.is_available()
        self.size = size
        self._grads = [torch.empty(size * 4, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._outs = [torch.empty(size * 4, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]

    def grad(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._grads[i].view(dtype)[:numel]

    def out(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._outs[i].view(dtype)[:numel]


def double_buffered(items: Sequence[Any], send: Callable[[Any, int], Any],
                    finish: Callable[[Any, Any, int], None]) -> None:
    """Runs ``send(item, buffer)`` for each item, alternating buffers 0 and 1, and
    ``finish(item, sent, buffer)`` before a buffer is reused and at the end, in order:
    item i+1 is sent while item i is still in flight."""
    pending: list = [None, None]
    for i, item in enumerate(items):
        b = i % 2
        if pending[b] is not None:
            finish(*pending[b], b)
        pending[b] = (item, send(item, b))
    for b in (len(items) % 2, 1 - len(items) % 2):
        if pending[b] is not None:
            finish(*pending[b], b)
