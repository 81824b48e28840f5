"""``state_dtype="auto"``: the state format, master and memory tier that a run's box holds,
and of those the fastest by the performance model (``placement.predict_placed``) with the
probe's record of the first directory (``python -m smartinf.probe DIR --record``); without
a record, the most precise format whose states all fit in memory, else the one with the
fewest bytes (a streamed step is storage-bound: its time follows its bytes). Explicit
settings win: a given ``master``, ``memory_budget``, ``commit_every``, ``copies`` or
``overlap`` is kept, and only formats allowing it are weighed. The durability is chosen
from the free space, each format the first of these its disk holds:

1. two copies (a crash at any instant reopens at the last durable commit; the fast one);
2. ``copies="log"``, forward recovery (one copy and a step's logged gradients: a crash at
   any instant reopens at the step before or finishes the logged one), for an fp32
   master streamed every step, on the host's cores (no GPU budget), overlap off;
3. one copy of states all resident (``copies=1``: a crash while a durable commit writes
   loses the states).

A format whose every instant is recoverable (1, 2) wins over one that is not (3). The
report says which durability the disk allows, at what predicted step, and what a larger
disk would give. A resumed run keeps its directory's format. Nothing fits: an ENOSPC
``OSError`` that lists what each format needs.

``python -m smartinf.plan --params 13e9 DIR...`` prints the choice and why.
"""
from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from smartinf import defaults
from smartinf.planning import space
from smartinf.pipeline.checkpoint import (LOG_FILES, MANIFEST, STATES, manifest_copies,
                                         manifest_fields, never_committed)
from smartinf.planning.io_schedule import find_record, load_record
from smartinf.planning.model import state_bytes_per_param
from smartinf.planning.placement import place, predict_placed, recorded_rates

logger = logging.getLogger("smartinf")

#: (state_dtype, master), most precise first; the split master is lossless (bf16 params only)
FORMATS = (("fp32", "fp32"), ("fp32", "split"), ("int8", "split"), ("int8", "fp32"),
           ("int4", "split"), ("int4", "fp32"))
#: host memory left to the rest of the run (model, DeepSpeed's buffers, the OS) where no
#: budget is given: this share of what is available, at least MIN_RESERVE
RESERVE_SHARE, MIN_RESERVE = 0.25, 4 << 30
#: steps per durable commit where states are resident (written in the background)
RESIDENT_COMMIT_EVERY = 10
#: what an all-resident budget adds to the states' bytes (sub-groups' partial last chunks)
BUDGET_SLACK = 0.05
#: the share of a GPU budget taken as left empty: it holds whole sub-groups only
GPU_FILL_SLACK = 0.05
#: predicted steps within this share of the fastest are a tie, won by the more precise format
TIE = 0.03
#: what each ``copies`` keeps, as the reports name it
DURABILITY = {2: "two copies", "log": "a log", 1: "one copy"}
#: copies="log": spare extents a device's states file holds (two a slot, of the pipeline's
#: default four; more slots take more, which the pipeline's own check before the first byte
#: counts exactly) and the gradient log's header
LOG_SPARE_CHUNKS, LOG_HEADER = 8, 1 << 20


@dataclass(frozen=True)
class Choice:
    """What ``choose`` picked: the settings (``settings()``), the bytes it holds (host
    memory for resident states; each directory's states files, and with ``copies="log"`` its
    gradient log), the model's step where a probe record gave the rates, and why."""

    state_dtype: str
    master: str
    memory_budget: int
    commit_every: int
    copies: "int | str"
    ram_bytes: int
    disk_bytes: dict
    step_s: Optional[float]
    why: str
    weighed: list = field(default_factory=list)
    commit_waits: bool = True
    gpu_bytes: int = 0  # the states the GPU's budget holds
    gpu_later: bool = False  # the GPU's budget measured after this choice (its first step)

    def settings(self) -> dict:
        log = {"overlap": False} if self.copies == "log" else {}  # (a log runs without)
        put_off = {} if self.commit_waits else {"commit_waits": False}
        return {"state_dtype": self.state_dtype, "master": self.master,
                "memory_budget": self.memory_budget, "commit_every": self.commit_every,
                "copies": self.copies, **log, **put_off}

    def report(self) -> str:
        disks = ", ".join(f"{d}: {space._size(b)}" for d, b in self.disk_bytes.items())
        step = f"; predicted step {self.step_s:.2f} s" if self.step_s is not None else ""
        # (the GPU's share named: a GPU user read "host memory 33.6 MB" alone as states streamed)
        gpu = f", GPU memory {space._size(self.gpu_bytes)}" if self.gpu_bytes else \
            ", GPU memory: what the first step leaves (measured then; the host's share shrinks)" \
            if self.gpu_later else ""
        return (f"smartinf auto: state_dtype={self.state_dtype!r}, master={self.master!r}, "
                f"memory_budget={space._size(self.memory_budget)} a device, commit_every="
                f"{self.commit_every}, copies={self.copies!r}{step}; host memory "
                f"{space._size(self.ram_bytes)}{gpu}, disk {disks}. "
                f"{self.why}" + ("" if self.commit_waits else "; a durable commit due while the "
                                 "last is still being written is put off (commit_waits=False)"))


def _disk_need(params: float, state_bytes: float, directories: Sequence[str],
               copies: "int | str" = 2, grad_bytes: int = 2) -> dict:
    """Bytes each directory's files take for an even share of the states: ``copies`` copies
    (the committed one and the one a step writes, or the one written in place), or with
    ``"log"`` one, its spare extents and a step's gradients of ``grad_bytes`` a param."""
    share = params / len(directories)
    if copies == "log":
        spares = LOG_SPARE_CHUNKS * (defaults.chunk() or defaults.CHUNK) * state_bytes
        nbytes = share * (state_bytes + grad_bytes) + spares + LOG_HEADER
    else:
        nbytes = copies * share * state_bytes
    return {d: int(math.ceil(nbytes)) for d in directories}


def _held_run(directories: Sequence[str]) -> Optional[dict]:
    """The format of the run the first directory holds (``state_dtype``, ``master``,
    ``copies``, from its manifest; its durable ``step``), and the bytes every directory's
    states files and logs hold, its devices' sub-directories' too (the GPU's ``gpu/`` and ``gpu-host/``, the small
    tensors' ``fp32-moments/``: at 13 B ``gpu-host/`` holds most) (``held``: space a resumed
    or overwritten run takes back); None where it holds none."""
    found = manifest_fields(directories[0])
    if found is None:
        return None
    fields = {"state_dtype": "fp32", "master": "fp32"}  # before version 7
    fields.update({k: v for k, v in found.items() if k in fields})
    step = int(found["step"]) if found.get("step", "").isdigit() else 0
    return dict(fields, copies=manifest_copies(found), step=step,
                held={d: _held_bytes(d) for d in directories})


def _held_bytes(directory: str) -> int:
    """The bytes the states files and logs of ``directory`` and of the device directories
    in it (those holding a manifest, at any depth) take on disk (0 where it is missing)."""
    held = 0
    for entry in (os.scandir(directory) if os.path.isdir(directory) else ()):
        if entry.name in (STATES, *LOG_FILES) and entry.is_file():
            held += entry.stat().st_blocks * 512
        elif entry.is_dir() and os.path.isfile(os.path.join(entry.path, MANIFEST)):
            held += _held_bytes(entry.path)
    return held


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (a directory the pipeline will make)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _disk_fits(need: dict, share: int = 1, held: Optional[dict] = None) -> Optional[str]:
    """None where every file system holds what its directories need (of its free space and
    what their states files hold already, ``held``, the ``share``-th: ranks of one host each
    take as much), else why not."""
    by_device: dict = {}
    for d, nbytes in need.items():
        reused = (held or {}).get(d, 0)
        d = _existing(d)
        dev = os.stat(d).st_dev
        total, first, back = by_device.get(dev, (0, d, 0))
        by_device[dev] = (total + nbytes, first, back + reused)
    for total, first, back in by_device.values():
        free = (shutil.disk_usage(first).free + back) // share
        if total > free:
            return f"needs {space._size(total)} on {first}'s file system, {space._size(free)} free"
    return None


def _log_refusal(gpu_budget: int, memory_budget: Optional[int], commit_every: Optional[int],
                 overlap: Optional[bool]) -> Optional[str]:
    """Why explicit settings leave ``copies="log"`` out (None: they allow it)."""
    why = [what for what, given in (
        ("a GPU budget (a GPU's sub-groups keep no log)", gpu_budget),
        ("a memory_budget (a log's states stream every step)", memory_budget),
        (f"commit_every={commit_every} (a log commits every step)", (commit_every or 1) > 1),
        ("overlap (a step's log is sealed before its first update)", overlap))
        if given]
    return ", ".join(why) or None


def _pick(rows: list, weighed: int) -> tuple:
    """The row auto takes of ``rows`` (of ``weighed`` formats), and why."""
    if all(r["step_s"] is not None for r in rows):
        fastest = min(r["step_s"] for r in rows)
        return next(r for r in rows if r["step_s"] <= fastest * (1 + TIE)), (
            f"the fastest by the model with the probe's record ({len(rows)} of {weighed} "
            f"formats fit the disk; ties within {TIE:.0%} go to the more precise)")
    whole = [r for r in rows if r["resident"] >= 1.0]
    if whole:
        return whole[0], ("no probe record (python -m smartinf.probe DIR --record) for a "
                          "predicted step: the most precise format left whose states all "
                          "fit in host memory")
    return min(rows, key=lambda r: r["moved"]), (
        "no probe record (python -m smartinf.probe DIR --record) for a predicted step: no "
        "format's states all fit in host memory: the one with the fewest bytes, as a "
        "streamed step's time follows its bytes")


def choose(params: int, directories: Sequence[str], *, bf16_params: bool = True,
           memory: Optional[int] = None, gpu_budget: int = 0,
           master: Optional[str] = None, memory_budget: Optional[int] = None,
           commit_every: Optional[int] = None, copies: "int | str | None" = None,
           overlap: Optional[bool] = None, figures: Optional[dict] = None, ranks: int = 1,
           if_exists: str = "overwrite", host_buffers: int = 0,
           gpu_budget_later: bool = False, state_dtype: Optional[str] = None,
           processes: int = 1, commit_waits: Optional[bool] = None) -> Choice:
    """The settings for ``params`` params over ``directories`` (one device each); ``memory``:
    host memory the states may hold in all (None: what is available less a reserve);
    ``gpu_budget``: bytes of GPU memory for states; ``master``, ``memory_budget`` (bytes a
    device), ``commit_every``, ``copies``, ``overlap``: explicit settings, kept; ``figures``:
    a probe record (None: the one found for the first directory, if any); ``ranks``:
    processes of this host making the same choice for as many params each (each gets that
    share of the host's memory and of each file system's free space); ``if_exists``: what
    the pipeline will do with a run the directories hold: ``"resume"`` takes its format
    (state dtype, master and copies are fixed for a directory); either way the bytes its
    states files hold count as free; ``host_buffers``: bytes of host memory each rank's run
    holds besides the states (the DeepSpeed integration's pinned gradient and param copies
    with ``overlap`` on a GPU: 51 GB at 13 B), taken from ``memory`` where it is not given,
    less the share of the params whose states the GPU's budget holds (their sub-groups have
    none); that share's states take no host memory either; ``gpu_budget_later``: a GPU
    budget is sized after this choice (DeepSpeed's ``"auto"``: weighed as none here, but its
    sub-groups keep no log); ``state_dtype``: the one format of the moments weighed (None:
    every format, ``"auto"``); ``processes``: the run's (every host's ranks): an interval
    chosen for a process alone is put off rather than waited for where the disk still writes
    the last (``commit_waits`` False, unless given; ranks would put it off each by its own
    disk and reopen at durable steps more than a commit apart)."""
    if params <= 0 or not directories:
        raise ValueError("choose needs a positive param count and at least one directory")
    if copies not in (None, 1, 2, "log"):
        raise ValueError(f"copies={copies!r}: expected 1, 2 or 'log'")
    log_refused = _log_refusal(gpu_budget or gpu_budget_later, memory_budget, commit_every, overlap)
    if copies == "log" and log_refused:
        raise ValueError(f"copies='log' runs streamed on the host's cores with an fp32 master, "
                         f"durable every step, overlap off; {log_refused} given: leave it "
                         f"out, or take copies=2")
    if figures is None:
        record = find_record(_existing(directories[0]))
        figures = load_record(record, "move it away") if record else None
    buffers = host_buffers
    if memory is None:
        available = space.available_memory()
        memory = max(0, (available - max(MIN_RESERVE, int(available * RESERVE_SHARE))) // ranks)
    else:
        buffers = 0  # given: the run's buffers are the caller's to have left out
    devices = len(directories)
    grad_bytes = 2 if bf16_params else 4  # a log holds the step's gradients in their dtype
    run = _held_run(directories)
    held = run["held"] if run else None
    formats = FORMATS
    if run and if_exists == "resume":  # its format is fixed: the pipeline refuses another
        formats = [(run["state_dtype"], run["master"])]
        state_dtype = master = None  # (one given otherwise: the pipeline refuses it, naming both)
        copies = run["copies"] if copies is None else copies
    weighed, larger, one_copy = [], [], []
    for fmt_dtype, fmt_master in formats:
        if (fmt_master == "split" and not bf16_params) or master not in (None, fmt_master) \
                or state_dtype not in (None, fmt_dtype) \
                or (copies == "log" and fmt_master != "fp32"):
            continue
        per_param = state_bytes_per_param(fmt_dtype, fmt_master)
        states = params * per_param
        # The GPU's budget fills first, with whole sub-groups (GPU_FILL_SLACK of it may stay
        # empty): its states take no host memory, and its sub-groups no host buffers.
        in_ram = states - min(states, int(gpu_budget * (1 - GPU_FILL_SLACK)))
        memory_here = max(0, memory - int(buffers * in_ram / states))
        # a device's states, all resident: with room for each sub-group's partial last chunk
        # (the model's bytes per param are whole chunks'; 7 B through DeepSpeed fell 0.6 GB
        # short of an exact budget, and that sub-group streamed every step)
        whole = math.ceil(in_ram * (1 + BUDGET_SLACK) / devices) + (16 << 20)
        # and, as far as the memory holds them, the twins a background commit copies
        # sub-groups into (given from what is left of the budget): without one, the next
        # update of a sub-group being written waits for its write (7 B: 10.5 s at each
        # commit; 13 B on the H100 machine: 25.7 s without, 7.7 s with 30 GB of twins)
        twinned = 2 * whole
        budget = memory_budget if memory_budget is not None else min(twinned, memory_here // devices)
        resident = 1.0 if budget >= whole or not in_ram else min(1.0, budget * devices / in_ram)
        rates = recorded_rates(figures, fmt_dtype, fmt_master) if figures else None

        def row(kept, budget, resident, every):
            need = _disk_need(params, per_param, directories, kept, grad_bytes)
            step_s = None
            if rates is not None:
                placed = place(params, per_param, gpu_budget, budget * devices)
                step_s = predict_placed(placed, **rates, state_bytes=per_param,
                                        commit_every=every).step_s
                if kept == "log":  # the step's gradients are written before its updates
                    step_s += params * grad_bytes / rates["write_bps"]
            return dict(state_dtype=fmt_dtype, master=fmt_master, memory_budget=budget,
                        commit_every=every, copies=kept, resident=resident,
                        ram_bytes=budget * devices, gpu_bytes=states - in_ram,
                        disk_bytes=need, step_s=step_s,
                        refused=_disk_fits(need, ranks, held), whole=whole,
                        moved=per_param * 2 + (grad_bytes if kept == "log" else 0))

        every = commit_every or (RESIDENT_COMMIT_EVERY if resident > 0 else 1)
        two = row(2, budget, resident, every)
        larger.append(two)
        # each format's durability: the first of two copies, a log, one copy its disk holds
        options = [two] if copies in (None, 2) else []
        if copies in (None, "log") and fmt_master == "fp32" and not log_refused:
            options.append(row("log", 0, 0.0 if in_ram else 1.0, 1))
        if copies == 1 or (copies is None and resident >= 1.0):
            options.append(row(1, budget, resident, every))
        taken = next((r for r in options if r["refused"] is None), None)
        one_copy += [r for r in options if r["copies"] == 1 and r["refused"] is None]
        if taken is None:
            taken = dict(options[0], refused=options[0]["refused"] if len(options) == 1 else
                         "; ".join(f"{DURABILITY[r['copies']]}: {r['refused']}" for r in options))
            if copies is None and resident < 1.0:
                taken["refused"] += " (one copy would need every state resident: more host memory)"
        taken["two_copies"] = two["refused"] if taken["copies"] != 2 else None
        weighed.append(taken)
    fitting = [r for r in weighed if r["refused"] is None]
    exact = [r for r in fitting if r["copies"] != 1]
    if exact:  # one copy only where no format's every instant is recoverable
        fitting = exact
    if not fitting:
        raise OSError(errno.ENOSPC, "no state format's states fit the directories: " + "; ".join(
            f"{r['state_dtype']}/{r['master']}: {r['refused']}" for r in weighed)
            + f". Host memory for states: {space._size(memory)} a process"
            + (f", less up to {space._size(buffers)} of the run's host buffers" if buffers else "")
            + ". Give more directories (file systems) or a larger one, or more host memory.")
    best, why = _pick(fitting, len(weighed))
    if run and if_exists == "resume":
        why = (f"the run in {directories[0]} never committed a step: it starts at step 0 "
               f"from the model's weights, in the run's format; " if never_committed(directories[0])
               else f"resumes the run in {directories[0]} in its format, at its durable "
               f"step {run['step']}; ") + why
    why += _ruled_out(best, weighed, fitting)
    less = weighed[weighed.index(best) + 1:]
    refused = [f"{r['state_dtype']}/{r['master']} ({r['refused']})" for r in less if r["refused"]]
    if refused:
        why += "; less precise ones refused for the disk: " + ", ".join(refused)
    why += _durability(best, larger, one_copy, len(weighed), ranks)
    if best["resident"] < 1.0:
        why += f"; {best['resident']:.0%} of the states resident, the rest streamed"
    elif memory_budget is None:
        share = best["memory_budget"] / best["whole"] - 1  # of the states, with a twin
        why += ("; room for every sub-group's twin: background commits hold no update back"
                if share >= 1 else f"; room for twins of {share:.0%} of the states: the "
                f"updates of the other sub-groups wait for their background commit writes"
                if share > 0.01 else "; no room for twins: an update waits for its "
                "sub-group's background commit write")
    if commit_waits is None:
        commit_waits = commit_every is not None or processes > 1 or best["commit_every"] == 1
    return Choice(best["state_dtype"], best["master"], best["memory_budget"], best["commit_every"],
                  best["copies"], best["ram_bytes"], best["disk_bytes"], best["step_s"], why, weighed,
                  commit_waits, int(best["gpu_bytes"]), gpu_budget_later and not gpu_budget)


def _ruled_out(best: dict, weighed: list, fitting: list) -> str:
    """Why each format more precise than ``best`` (``weighed`` runs most precise first) was
    not taken."""
    why = []
    for r in weighed[:weighed.index(best)]:
        name = f"{r['state_dtype']}/{r['master']}"
        if r["refused"]:
            why.append(f"{name}: refused for the disk ({r['refused']})")
        elif r not in fitting:
            why.append(f"{name}: only one copy fits the disk (two {r['two_copies']}), and "
                       f"{best['state_dtype']}/{best['master']} keeps every instant "
                       f"recoverable")
        elif r["step_s"] is not None:
            why.append(f"{name}: predicted step {r['step_s']:.2f} s")
        else:
            why.append(f"{name}: {r['resident']:.0%} of its states fit host memory")
    return "; more precise formats ruled out: " + "; ".join(why) if why else ""


def _durability(best: dict, larger: list, one_copy: list, weighed: int, ranks: int) -> str:
    """What a crash costs with ``best``'s copies; where two copies did not fit, what a disk
    holding them would give (``larger``: every format's row with two), and beside a log,
    what one copy of states all resident would (``one_copy``: the rows whose disk holds)."""
    every = best["commit_every"]
    if best["copies"] == 2:
        return (f"; two copies: a crash at any instant reopens at the last durable commit "
                f"(every {every} step{'s' if every > 1 else ''})")
    if best["copies"] == "log":
        said = (f"; copies='log': the disk holds one copy of these states and a step's "
                f"gradients{', not two copies (which ' + best['two_copies'] + ')' if best['two_copies'] else ''}"
                f": durable every step, and a crash at any instant reopens at the step before "
                f"or finishes the logged one; the states stream every step, overlap off")
        if one_copy:
            one, _ = _pick(one_copy, weighed)
            step = f" (predicted step {one['step_s']:.2f} s)" if one["step_s"] is not None else ""
            said += (f"; one copy of {one['state_dtype']}/{one['master']} all resident{step} "
                     f"would fit too, but a crash during its commits would lose the states: "
                     f"copies=1 takes it")
    else:
        said = (f"; copies=1: the disk holds one copy of these states"
                f"{', not two (which ' + best['two_copies'] + ')' if best['two_copies'] else ''}"
                f": durable at each commit (every {every} steps), but a crash while a commit "
                f"writes them loses them (the reopen refuses the directory)")
    if not best["two_copies"]:
        return said
    two, _ = _pick(larger, weighed)
    step = f", predicted step {two['step_s']:.2f} s" if two["step_s"] is not None else ""
    return said + (f"; a disk with {space._size(ranks * sum(two['disk_bytes'].values()))} free "
                   f"would give two copies of {two['state_dtype']}/{two['master']}{step}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m smartinf.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="one directory per device")
    parser.add_argument("--params", type=float, required=True, help="param count, e.g. 13e9")
    parser.add_argument("--fp32-params", action="store_true", help="params in fp32 (no split master)")
    parser.add_argument("--memory", type=float, help="host memory the states may hold, bytes")
    parser.add_argument("--gpu-budget", type=float, default=0, help="GPU memory for states, bytes")
    args = parser.parse_args(argv)
    try:
        choice = choose(int(args.params), args.dirs, bf16_params=not args.fp32_params,
                        memory=None if args.memory is None else int(args.memory),
                        gpu_budget=int(args.gpu_budget))
    except (OSError, ValueError) as e:
        print(f"smartinf.planning.plan: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
        return 1
    print(choice.report())
    for r in choice.weighed:
        step = f"{r['step_s']:.2f} s" if r["step_s"] is not None else "-"
        print(f"  {r['state_dtype']:>4}/{r['master']:<5} resident {r['resident']:>4.0%}  "
              f"disk {space._size(sum(r['disk_bytes'].values())):>8} ({DURABILITY[r['copies']]})  "
              f"step {step:>8}  "
              f"{'refused: ' + r['refused'] if r['refused'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
