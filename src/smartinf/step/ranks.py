"""Ranks that open one run's directories together (DeepSpeed's, FSDP2's, DDP's and any
torchrun job's through ``smartinf.optim``) check their host memory together
(``opening_together``), open or fail together (``on_every_rank``), and reopen at one durable
step: a crash between the ranks' commits leaves some one commit ahead, whose shadow copies
still hold the others' step, so they go back to it (before any sub-group is attached). Ranks
further apart are refused, naming each rank's step. Ranks restarted on other hosts than the
disks holding their directories, a rank's directory missing, and a run reopened at another
world size are refused before any opens (``refuse_moved``; a process alone:
``refuse_alone_in_ranks_run``)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any, Callable, Optional

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
    """Every rank's ``pipeline`` at one durable step before any sub-group is attached: ranks
    one commit ahead of the lowest roll back to it (their shadow copies), said at warning
    level; ranks further apart (or of one copy) are refused on every rank, naming each
    rank's step. ``summed(t)``: ``t`` summed over the ranks (an all-reduce every rank
    calls)."""
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


def on_every_rank(action: Callable[[], Any], summed: Callable[[torch.Tensor], torch.Tensor],
                  undo: Callable[[Any], None] = lambda result: None) -> Any:
    """``action()`` run on every rank; where it raises on any, it raises on all (the rank's own
    error there, a ``RuntimeError`` on the others, their result given to ``undo``), so no rank
    is left waiting in the next collective for one that failed."""
    error: Optional[BaseException] = None
    try:
        result = action()
    except Exception as e:
        error, result = e, None
    failed = bool(summed(torch.tensor([float(error is not None)])).item())
    if error is not None:
        raise error
    if failed:
        undo(result)
        raise RuntimeError("another rank could not open its smartinf directories (its error "
                           "says why); nothing was changed here")
    return result


#: A rank's directory under the root its ranks share (``devices.rank_directory``).
RANK_DIRECTORY = re.compile(r"rank(\d{5})")


def runs_of_ranks(root: str) -> list[int]:
    """The ranks whose ``rank%05d`` directories under ``root`` hold a run (a manifest)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in map(RANK_DIRECTORY.fullmatch, names)
                  if m and manifest_fields(os.path.join(root, m.group(0))) is not None)


def refuse_alone_in_ranks_run(directory: str, if_exists: str) -> None:
    """A process alone (no process group, or a world of 1) opening ``directory`` where it holds
    no run of its own but ``rank%05d`` directories holding the runs of several ranks: a run
    made at a larger world size, reopened at 1, would otherwise start afresh beside it."""
    if if_exists == "overwrite" or manifest_fields(directory) is not None:
        return
    held = runs_of_ranks(directory)
    if held:
        raise RuntimeError(
            f"{directory} holds no run of its own but the directories of a run of several "
            f"ranks ({_listed(held)}), and this process opens it alone (world size 1): "
            f"nothing was written. {_WORLD_ADVICE}")


_WORLD_ADVICE = (
    "Reopen it at the world size it was made with, or move it through a checkpoint: "
    "torch.distributed.checkpoint (FSDP2) or a rank's optimizer state_dict() (DDP: every "
    "rank holds the same) loaded into directories made with if_exists='overwrite' "
    "(docs/fsdp.md, 'Moving a run between hosts'); if_exists='overwrite' starts afresh")


def _listed(ranks: list[int]) -> str:
    return "rank" + ("s " if len(ranks) > 1 else " ") + ", ".join(map(str, ranks))


def refuse_moved(summed: Callable[[torch.Tensor], torch.Tensor], rank: int, world: int,
                 directory: str, if_exists: str) -> None:
    """Before any rank opens its directories (``directory``: this rank's first, where its run
    is held; ``rank%05d`` under a root the ranks share, or a path of its own): where a rank
    finds no run of its own while another rank holds one, or its host's root holds other
    ranks' runs, the ranks were restarted on other hosts than the disks that hold their
    directories (an elastic restart, a new allocation), or a rank's directory is missing, or
    the world size changed (a root holding ``rank%05d`` runs beyond this world's ranks, or a
    run of its own, made by a process alone; ranks from some rank on all without one: said
    as either, as nothing records the world size a run was made at). Refused on every rank
    before anything is written, naming each such rank, the directory it expected and what
    its host holds: never a fresh start beside resumed ranks, nor two ranks' states mixed.
    ``if_exists="overwrite"``: a fresh start is asked for."""
    if if_exists == "overwrite" or world < 2:
        return
    root = os.path.dirname(directory)
    laid_out = directory == rank_directory(root, rank)  # (else no sibling to look for)
    # [r, q]: rank r's host holds q's run; [r, world]: the ranks its root's runs name (the
    # highest, plus one); [r, world + 1]: its root holds a run of one process
    seen = torch.zeros(world, world + 2, dtype=torch.float64)
    held = runs_of_ranks(root) if laid_out else []
    for q in range(world) if laid_out else (rank,):
        seen[rank, q] = float(q in held if laid_out else manifest_fields(directory) is not None)
    seen[rank, world] = float(max(held, default=-1) + 1)
    seen[rank, world + 1] = float(laid_out and manifest_fields(root) is not None)
    seen = summed(seen).cpu()
    made_by, alone = int(seen[:, world].max()), bool(seen[:, world + 1].any())
    own = [bool(seen[r, r]) for r in range(world)]
    if made_by > world or alone and not any(own):
        made = f"at least {made_by} ranks (their rank%05d directories)" if made_by > world \
            else "a process alone (its manifest in the root)"
        raise RuntimeError(f"the run in {root} was made by {made}, and this job has {world} "
                           f"ranks: the world size changed. Nothing was written. {_WORLD_ADVICE}")
    seen = seen[:, :world].contiguous()
    if all(own) or not any(seen.view(-1).tolist()):
        return  # every rank resumes its own, or none holds anything: a fresh start
    lost = [r for r in range(world) if not own[r] and (any(own) or seen[r].any())]
    if not lost:
        return
    holding = [r for r in range(world) if own[r]]
    if all(own[q] or not seen[:, q].any() for q in range(world)):  # no run away from its rank
        raise RuntimeError(_missing(lost, holding, world, rank, directory))
    said = []
    for r in lost:
        others = [q for q in range(world) if q != r and seen[r, q]]
        said.append(f"rank {r} found no run in its directory"
                    + (f" (its host's {root if r == rank else 'root'} holds the runs of ranks "
                       f"{', '.join(map(str, others))})" if others else ""))
    raise RuntimeError(
        f"{'; '.join(said)}, while ranks {', '.join(map(str, holding)) or 'none'} hold theirs "
        f"(rank {rank} expected {directory}): the ranks were restarted on other hosts than the "
        f"disks that hold their directories. Nothing was written. Start each rank where its "
        f"rank%05d directory is, or move the run through a checkpoint: "
        f"torch.distributed.checkpoint (FSDP2) or the optimizer's state_dict() loaded into "
        f"directories made with if_exists='overwrite' (docs/fsdp.md, 'Moving a run between "
        f"hosts')")


def _missing(lost: list[int], holding: list[int], world: int, rank: int, directory: str) -> str:
    """Why ranks ``lost`` hold no run that any host holds, while ``holding`` hold theirs."""
    # (a run of one process is in the root itself: ranks 0 .. k-1 holding theirs, k > 1)
    grown = len(holding) > 1 and holding == list(range(len(holding))) and \
        lost == list(range(len(holding), world))
    why = (f"the run was made by {len(holding)} ranks and this job has {world} (the world "
           f"size changed), or the directories of {_listed(lost)} were lost"
           if grown else f"the directories of {_listed(lost)} were lost or moved")
    return (f"{_listed(lost)} found no run in {'their' if len(lost) > 1 else 'its'} "
            f"directory, and no rank's host holds one, while {_listed(holding)} "
            f"{'hold theirs' if len(holding) > 1 else 'holds its own'} (rank {rank} expected "
            f"{directory}): {why}. Nothing was written: resuming would start "
            f"{'them' if len(lost) > 1 else 'it'} afresh beside the others. Restore the "
            f"missing directories, or {_WORLD_ADVICE[0].lower()}{_WORLD_ADVICE[1:]}")


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
