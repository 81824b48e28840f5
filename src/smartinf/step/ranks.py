"""Ranks that open one run's directories together (DeepSpeed's, FSDP2's) check their host
memory together (``opening_together``), and reopen at one durable step: a crash between the
ranks' commits leaves some one commit ahead, whose shadow copies still hold the others'
step, so they go back to it (before any sub-group is attached). Ranks further apart are
refused, naming each rank's step. Ranks restarted on other hosts than the disks holding
their directories are refused before any opens (``refuse_moved``)."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable

import torch

from smartinf import defaults
from smartinf.pipeline.checkpoint import manifest_fields
from smartinf.pipeline.devices import rank_directory
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


def refuse_moved(summed: Callable[[torch.Tensor], torch.Tensor], rank: int, world: int,
                 directory: str, if_exists: str) -> None:
    """Before any rank opens its directories (``directory``: this rank's first, where its run
    is held; ``rank%05d`` under a root the ranks share, or a path of its own): where a rank
    finds no run of its own while another rank holds one, or its host's root holds other
    ranks' runs, the ranks were restarted on other hosts than the disks that hold their
    directories (an elastic restart, a new allocation). Refused on every rank before
    anything is written, naming each such rank, the directory it expected and what its host
    holds: never a fresh start beside resumed ranks, nor two ranks' states mixed.
    ``if_exists="overwrite"``: a fresh start is asked for."""
    if if_exists == "overwrite" or world < 2:
        return
    root = os.path.dirname(directory)
    laid_out = directory == rank_directory(root, rank)  # (else no sibling to look for)
    seen = torch.zeros(world, world, dtype=torch.float64)  # [r, q]: rank r's host holds q's run
    for q in range(world) if laid_out else (rank,):
        path = rank_directory(root, q) if laid_out else directory
        seen[rank, q] = float(manifest_fields(path) is not None)
    seen = summed(seen).cpu()
    own = [bool(seen[r, r]) for r in range(world)]
    if all(own) or not any(seen.view(-1).tolist()):
        return  # every rank resumes its own, or none holds anything: a fresh start
    lost = [r for r in range(world) if not own[r] and (any(own) or seen[r].any())]
    if not lost:
        return
    said = []
    for r in lost:
        others = [q for q in range(world) if q != r and seen[r, q]]
        said.append(f"rank {r} found no run in its directory"
                    + (f" (its host's {root if r == rank else 'root'} holds the runs of ranks "
                       f"{', '.join(map(str, others))})" if others else ""))
    holding = [r for r in range(world) if own[r]]
    raise RuntimeError(
        f"{'; '.join(said)}, while ranks {', '.join(map(str, holding)) or 'none'} hold theirs "
        f"(rank {rank} expected {directory}): the ranks were restarted on other hosts than the "
        f"disks that hold their directories. Nothing was written. Start each rank where its "
        f"rank%05d directory is, or move the run through a checkpoint: "
        f"torch.distributed.checkpoint (FSDP2) or the optimizer's state_dict() loaded into "
        f"directories made with if_exists='overwrite' (docs/fsdp.md, 'Moving a run between "
        f"hosts')")


_leaving_cleanly = False


def leave_cleanly() -> None:
    """At interpreter exit, while it still runs (an ``atexit`` handler, registered once):
    Python's garbage collected and the default process group destroyed. A script that ends
    without ``destroy_process_group()`` otherwise aborted now and then with gloo ("terminate
    called without an active exception", SIGABRT after every step was written: a failed job
    to torchrun; 2 of 14 and 3 of 8 runs of the FSDP2 example here): the Python side's last
    references to a collective's work went in ``Py_FinalizeEx``'s collection, gloo's worker
    thread then destroyed the work, whose tensors take the GIL to drop their Python objects,
    and a thread taking the GIL during finalization exits (a core's stack:
    ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` ->
    ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``). Collected here, the work goes
    while threads may still take the GIL (25 of 25 runs exited 0)."""
    global _leaving_cleanly
    if _leaving_cleanly or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # (registered once; where a process group is)
    _leaving_cleanly = True
    import atexit
    import gc

    def destroy() -> None:
        gc.collect()  # (collectives' works dropped now, while their threads may take the GIL)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception as e:  # (exiting: said, not raised)
                logger.debug("destroy_process_group at exit: %s", e)
        gc.collect()
    atexit.register(destroy)
