"""A GPU budget of ``"auto"``: the bytes of the GPU's memory its states may take, measured by
the first step (what the first iteration's forward and backward left), or what a held run's
GPU states take when it is resumed. Shared by the DeepSpeed integration and
``smartinf.optim``, which both open their pipelines at the first step for it."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from smartinf import defaults
from smartinf.pipeline.checkpoint import STATES, manifest_copies, manifest_fields

logger = logging.getLogger("smartinf")


def free_and_total() -> tuple[int, int]:
    """The current GPU's free and total bytes, the total as a budget's margin counts it: at
    most ``SMARTINF_GPU_MEMORY`` (a smaller GPU emulated on a larger one, the rest held by a
    tensor, so in use already)."""
    free, total = torch.cuda.mem_get_info()
    emulated = defaults.gpu_memory()
    return free, min(total, emulated) if emulated else total


def measured(margin: Optional[int] = None) -> int:
    """At the first step, before its update: bytes of the current GPU's memory for states,
    what the first iteration (forward and backward, the framework's buffers, the
    activations) left: what is free now, less what it took at its peak beyond what torch
    still holds, less ``margin`` (None: ``defaults.GPU_MARGIN_SHARE`` of the GPU's memory: the
    devices' slots, the gathers prefetched from the second iteration, fragmentation; of
    ``SMARTINF_GPU_MEMORY`` where that is less: on a larger GPU emulating a smaller one the
    margin is the smaller one's); 0 where nothing is left; logged with its terms."""
    free, total = free_and_total()
    peak, held_now = torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved()
    margin = int(total * defaults.GPU_MARGIN_SHARE) if margin is None else margin
    budget = max(0, free - (peak - held_now) - margin)
    logger.warning("smartinf: a GPU budget of %.1f GB for states, measured by the first step: "
                   "%.1f GB free, less %.1f GB more that the first iteration took at its peak, "
                   "less %.1f GB of margin", budget / 1e9, free / 1e9, (peak - held_now) / 1e9,
                   margin / 1e9)
    return budget


def held(gpu_directory: str) -> Optional[int]:
    """The bytes a GPU's device directory's states take resident (one copy of each: what
    the run that made it had room for); None where it holds none."""
    fields = manifest_fields(gpu_directory)
    if fields is None:
        return None
    try:
        size = os.path.getsize(os.path.join(gpu_directory, STATES))
    except FileNotFoundError:
        return None
    return -(-size // manifest_copies(fields))
