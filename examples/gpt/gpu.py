"""A smaller GPU emulated on a larger one (the examples' ``--gpu-memory``): the rest of its
memory held by a tensor made first, so that a GPU budget of ``"auto"`` places the states as
it would on the smaller GPU."""
from __future__ import annotations

import os
from typing import Optional

import torch

from smartinf.defaults import parse_bytes


def hold_back(gpu_memory: Optional[str], device: torch.device) -> Optional[torch.Tensor]:
    """The tensor holding all but ``gpu_memory`` (``"80GiB"``) of ``device``'s memory, to
    keep until the end of the run (None: none asked for); refused where it is not smaller.
    smartinf is told the smaller GPU's size (``SMARTINF_GPU_MEMORY``): a budget of "auto"
    keeps the margin a GPU of that size would."""
    if not gpu_memory:
        return None
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
    emulated = parse_bytes(gpu_memory, "--gpu-memory")
    if not 0 < emulated < total:
        raise SystemExit(f"--gpu-memory {gpu_memory} emulates a smaller GPU on this one: give "
                         f"less than its {total} bytes" if total else
                         "--gpu-memory emulates a smaller GPU on a CUDA GPU: there is none here")
    os.environ["SMARTINF_GPU_MEMORY"] = str(emulated)
    return torch.empty(total - emulated, dtype=torch.uint8, device=device)
