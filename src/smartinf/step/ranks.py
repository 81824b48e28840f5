"""Ranks that open one run's directories together (DeepSpeed's, FSDP2's) check their host
memory together (``opening_together``), and reopen at one durable step: a crash between the
ranks' commits leaves some one commit ahead, whose shadow copies still hold the others'
step, so they go back to it (before any sub-group is attached). Ranks further apart are
refused, naming each rank's step."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from smartinf import defaults
from smartinf.planning import space

logger = logging.getLogger("smartinf")


def opening_together(summed: Callable[[torch.Tensor], torch.Tensor], rank: int,
                     world: int) -> contextlib.AbstractContextManager:
    """``space.ranks_opening`` for ranks about to open their pipelines: this host's ranks
    (``defaults.local_ranks``), and the least host memory any rank has available, measured
    before any opens (``summed`` is a collective: none goes on before all have measured),
    so that the ranks decide alike."""
    free = torch.zeros(world, dtype=torch.float64)  # each rank's entry, the others' zeros
    free[rank] = float(space.available_memory())
    least = int(summed(free).min().item())
    return space.ranks_opening(defaults.local_ranks(), least)


def agree_on_step(pipeline: Any, summed: Callable[[torch.Tensor], torch.Tensor], rank: int,
                  world: int, directories: Any, copies: Any) -> None:
    """``summed(t)``: ``t`` summed over the ranks (an all-reduce every rank calls)."""
    held = torch.zeros(world, 2, dtype=torch.float64)  # each rank's row, the others' zeros
    held[rank] = torch.tensor([pipeline.durable_step_count, pipeline.previous_step_count],
                              dtype=torch.float64)
    held = summed(held).cpu().tolist()
    steps, previous = [int(s) for s, _ in held], [int(p) for _, p in held]
    low = min(steps)
    if all(s == low or p == low for s, p in zip(steps, previous)):
        if steps[rank] != low:
            pipeline.roll_back_to(low)
            logger.warning("rank %d's directories %s were one commit ahead of the other ranks' "
                           "(step %d; a crash between the ranks' commits): rolled back to step "
                           "%d", rank, directories, steps[rank], low)
        return
    which = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
    why = ("of one copy (copies=1), which holds no earlier step to bring them together"
           if copies == 1 else "more than one commit apart")
    raise RuntimeError(f"the ranks' directories {directories} hold different durable steps "
                       f"({which}), {why}: load a checkpoint or use fresh directories")
