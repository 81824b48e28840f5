"""Host staging for sub-group updates: ``depth`` buffer pairs, so the gradients of the
next sub-groups are gathered (and compressed) while the devices update earlier ones.
With N devices the depth is N + 1: every device has a sub-group in flight while the
next one is gathered."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def depth_for(devices: int) -> int:
    """Buffers that keep ``devices`` devices busy: one sub-group each, plus one gathering."""
    return devices + 1


class Staging:
    """``depth`` host buffer pairs (gradient in, params out) of ``size`` elements of up to
    4 bytes; pinned when CUDA is present so copies to and from the GPU run asynchronously.
    Each is allocated at its first use: sub-groups a GPU updates where their params are
    never stage through the host."""

    def __init__(self, size: int, depth: int = 2) -> None:
        self.size = size
        self.depth = depth
        self._grads: list = [None] * depth
        self._outs: list = [None] * depth

    def _buffer(self, buffers: list, i: int) -> torch.Tensor:
        if buffers[i] is None:
            buffers[i] = torch.empty(self.size * 4, dtype=torch.uint8,
                                     pin_memory=torch.cuda.is_available())
        return buffers[i]

    def grad(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._buffer(self._grads, i).view(dtype)[:numel]

    def out(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._buffer(self._outs, i).view(dtype)[:numel]


def pipelined(items: Sequence[Any], send: Callable[[Any, int], Any],
              finish: Callable[[Any, Any, int], None], depth: int = 2) -> None:
    """Runs ``send(item, buffer)`` for each item, cycling through buffers 0..depth-1, and
    ``finish(item, sent, buffer)`` before a buffer is reused and at the end, in order:
    up to ``depth`` items are in flight at once."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    pending: list = [None] * depth
    for i, item in enumerate(items):
        b = i % depth
        if pending[b] is not None:
            finish(*pending[b], b)
        pending[b] = (item, send(item, b))
    for k in range(depth):  # the rest, oldest first
        b = (len(items) + k) % depth
        if pending[b] is not None:
            finish(*pending[b], b)
