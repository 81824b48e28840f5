"""``state_dtype="auto"``: the state format, master and memory tier that a run's box holds,
and of those the fastest by the performance model (``model.predict_placed``) with the
probe's record of the first directory (``python -m smartinf.probe DIR --record``); without
a record, the most precise format whose states all fit in memory, else the one with the
fewest bytes (a streamed step is storage-bound: its time follows its bytes). Explicit
settings win: a given ``master``, ``memory_budget`` or ``copies`` is kept, and only formats
allowing it are weighed. Each directory keeps two copies of its states where its disk holds
them (a crash at any instant reopens at the last durable commit); only where no format's
two copies fit, one copy of a format whose states are all resident (``copies=1``: a crash
while a durable commit writes loses the states; the report says so, and what free space
two copies need). A resumed run keeps its directory's format. Nothing fits: an ENOSPC
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

from . import space
from .checkpoint import MANIFEST, STATES, manifest_copies, manifest_fields
from .devices import GPU_HOST_DIRECTORY
from .io_schedule import find_record, load_record
from .model import BOTH_WAYS_SHARE, place, predict_placed, recorded_rates, state_bytes_per_param

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


@dataclass(frozen=True)
class Choice:
    """What ``choose`` picked: the settings (``settings()``), the bytes it holds (host
    memory for resident states; each directory's states files: two copies of every chunk),
    the model's step where a probe record gave the rates, and why."""

    state_dtype: str
    master: str
    memory_budget: int
    commit_every: int
    copies: int
    ram_bytes: int
    disk_bytes: dict
    step_s: Optional[float]
    why: str
    weighed: list = field(default_factory=list)

    def settings(self) -> dict:
        return {"state_dtype": self.state_dtype, "master": self.master,
                "memory_budget": self.memory_budget, "commit_every": self.commit_every,
                "copies": self.copies}

    def report(self) -> str:
        disks = ", ".join(f"{d}: {space._size(b)}" for d, b in self.disk_bytes.items())
        step = f"; predicted step {self.step_s:.2f} s" if self.step_s is not None else ""
        return (f"smartinf auto: state_dtype={self.state_dtype!r}, master={self.master!r}, "
                f"memory_budget={space._size(self.memory_budget)} a device, commit_every="
                f"{self.commit_every}, copies={self.copies}{step}; host memory {space._size(self.ram_bytes)}, disk {disks}. "
                f"{self.why}")


def _disk_need(params: float, state_bytes: float, directories: Sequence[str],
               copies: int = 2) -> dict:
    """Bytes each directory's states files take: ``copies`` copies (the committed one and
    the one a step writes, or the one written in place) of an even share of the states."""
    share = copies * params * state_bytes / len(directories)
    return {d: int(math.ceil(share)) for d in directories}


def _held_run(directories: Sequence[str]) -> Optional[dict]:
    """The format of the run the first directory holds (``state_dtype``, ``master``,
    ``copies``, from its manifest), and the bytes every directory's states file holds
    (``held``: space a resumed or overwritten run takes back); None where it holds none."""
    found = manifest_fields(directories[0])
    if found is None:
        return None
    fields = {"state_dtype": "fp32", "master": "fp32"}  # before version 7
    fields.update({k: v for k, v in found.items() if k in fields})
    held = {}
    for d in directories:
        try:
            held[d] = os.stat(os.path.join(d, STATES)).st_blocks * 512
        except FileNotFoundError:
            held[d] = 0
    return dict(fields, copies=manifest_copies(found), held=held)


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


def choose(params: int, directories: Sequence[str], *, bf16_params: bool = True,
           memory: Optional[int] = None, gpu_budget: int = 0,
           master: Optional[str] = None, memory_budget: Optional[int] = None,
           commit_every: Optional[int] = None, copies: Optional[int] = None,
           figures: Optional[dict] = None, ranks: int = 1, if_exists: str = "overwrite",
           host_buffers: int = 0) -> Choice:
    """The settings for ``params`` params over ``directories`` (one device each); ``memory``:
    host memory the states may hold in all (None: what is available less a reserve);
    ``gpu_budget``: bytes of GPU memory for states; ``master``, ``memory_budget`` (bytes a
    device), ``commit_every``, ``copies``: explicit settings, kept; ``figures``: a probe record (None:
    the one found for the first directory, if any); ``ranks``: processes of this host making
    the same choice for as many params each (each gets that share of the host's memory and
    of each file system's free space); ``if_exists``: what the pipeline will do with a run
    the directories hold: ``"resume"`` takes its format (state dtype, master and copies are
    fixed for a directory); either way the bytes its states files hold count as free;
    ``host_buffers``: bytes of host memory each rank's run holds besides the states (the
    DeepSpeed integration's pinned gradient and param copies with ``overlap`` on a GPU: 51 GB
    at 13 B), taken from ``memory`` where it is not given, less the share of the params whose
    states the GPU's budget holds (their sub-groups have none); that share's states take no
    host memory either."""
    if params <= 0 or not directories:
        raise ValueError("choose needs a positive param count and at least one directory")
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
    run = _held_run(directories)
    formats = FORMATS
    if run and if_exists == "resume":  # its format is fixed: the pipeline refuses another
        formats = [(run["state_dtype"], run["master"])]
        copies = run["copies"] if copies is None else copies
    weighed, fitting = [], []
    for state_dtype, fmt_master in formats:
        if (fmt_master == "split" and not bf16_params) or master not in (None, fmt_master):
            continue
        per_param = state_bytes_per_param(state_dtype, fmt_master)
        states = params * per_param
        # The GPU's budget fills first, with whole sub-groups (GPU_FILL_SLACK of it may stay
        # empty): its states take no host memory, and its sub-groups no host buffers.
        in_ram = states - min(states, int(gpu_budget * (1 - GPU_FILL_SLACK)))
        memory_here = max(0, memory - int(buffers * in_ram / states))
        # a device's states, all resident: with room for each sub-group's partial last chunk
        # (the model's bytes per param are whole chunks'; 7 B through DeepSpeed fell 0.6 GB
        # short of an exact budget, and that sub-group streamed every step)
        whole = math.ceil(in_ram * (1 + BUDGET_SLACK) / devices) + (16 << 20)
        # and, where the memory holds them, the twins a background commit copies sub-groups
        # into (given from what is left of the budget): without one, the next update of a
        # sub-group being written waits for its write (7 B: 10.5 s at each commit)
        twinned = 2 * whole
        budget = memory_budget if memory_budget is not None else \
            twinned if twinned <= memory_here // devices else min(whole, memory_here // devices)
        resident = 1.0 if budget >= whole or not in_ram else min(1.0, budget * devices / in_ram)
        every = commit_every or (RESIDENT_COMMIT_EVERY if resident > 0 else 1)
        # two copies where the disk holds them, else one where every state is resident
        kept = copies or 2
        held = run["held"] if run else None
        need = _disk_need(params, per_param, directories, kept)
        not_fit = _disk_fits(need, ranks, held)
        if not_fit and copies is None and resident >= 1.0 and \
                _disk_fits(_disk_need(params, per_param, directories, 1), ranks, held) is None:
            two_copies, kept = not_fit, 1
            need, not_fit = _disk_need(params, per_param, directories, 1), None
        else:
            two_copies = None
        if not_fit and kept == 2 and resident < 1.0 and copies is None:
            not_fit += " (one copy would need every state resident: more host memory)"

        step_s = None
        rates = recorded_rates(figures, state_dtype, fmt_master) if figures else None
        if rates is not None:
            placed = place(params, per_param, gpu_budget, budget * devices)
            step_s = predict_placed(placed, **rates, state_bytes=per_param, commit_every=every).step_s
        row = dict(state_dtype=state_dtype, master=fmt_master, memory_budget=budget,
                   commit_every=every, copies=kept, two_copies=two_copies,
                   resident=resident, ram_bytes=budget * devices,
                   disk_bytes=need, step_s=step_s, refused=not_fit, twins=budget >= twinned)
        weighed.append(row)
        if not_fit is None:
            fitting.append(row)
    two = [r for r in fitting if r["copies"] == 2]
    if two:  # one copy only where no format's two copies fit: it trades crash consistency
        fitting = two
    if not fitting:
        raise OSError(errno.ENOSPC, "no state format's states fit the directories: " + "; ".join(
            f"{r['state_dtype']}/{r['master']}: {r['refused']}" for r in weighed)
            + ". Give more directories (file systems) or a larger one.")
    if all(r["step_s"] is not None for r in fitting):
        fastest = min(r["step_s"] for r in fitting)
        best = next(r for r in fitting if r["step_s"] <= fastest * (1 + TIE))
        why = (f"the fastest by the model with the probe's record ({len(fitting)} of "
               f"{len(weighed)} formats fit the disk; ties within {TIE:.0%} go to the more precise)")
    else:
        whole = [r for r in fitting if r["resident"] >= 1.0]
        best = whole[0] if whole else min(fitting, key=lambda r: sum(r["disk_bytes"].values()))
        why = ("no probe record (python -m smartinf.probe DIR --record) for a predicted step: "
               + ("the most precise format whose states all fit in host memory" if whole else
                  "no format's states all fit in host memory: the one with the fewest bytes, "
                  "as a streamed step's time follows its bytes"))
    if run and if_exists == "resume":
        why = f"resumes the run in {directories[0]} in its format; " + why
    refused = [f"{r['state_dtype']}/{r['master']} ({r['refused']})" for r in weighed if r["refused"]]
    if refused:
        why += "; refused for the disk: " + ", ".join(refused)
    if best["two_copies"]:
        why += (f"; copies=1: the disk holds one copy of these states, not two (which {best['two_copies']}):"
                f" durable at each commit (every {best['commit_every']} steps), but a crash while a "
                f"commit writes them loses them (the reopen refuses the directory)")
    if best["resident"] < 1.0:
        why += f"; {best['resident']:.0%} of the states resident, the rest streamed"
    elif memory_budget is None:
        why += ("; room for every sub-group's twin: background commits hold no update back"
                if best["twins"] else "; no room for twins: an update waits for its sub-group's "
                "background commit write")
    return Choice(best["state_dtype"], best["master"], best["memory_budget"], best["commit_every"],
                  best["copies"], best["ram_bytes"], best["disk_bytes"], best["step_s"], why, weighed)


def gpu_takes_host_states(state_dtype: str, master: str, directory: str) -> tuple[bool, str]:
    """Whether the GPU updates the states kept in host memory faster than the host's cores
    (the ``"gpu"`` block's ``"host_states": "auto"``), and why. Over PCIe each param's states
    cross both ways (its gradient and params stay in the GPU's memory), so the GPU's rate is
    the link's over the states' bytes; the cores' is the probe's kernel rate. Without a
    probe record with both: the GPU for int8 and int4 moments (2.3x and 2.9x the cores on
    the lent H100's 14 update threads, `bench/measured/h100-gpu-host-states.json`), the cores for fp32
    (0.87x: 12 B a param each way)."""
    state = state_bytes_per_param(state_dtype, master)
    path = find_record(_existing(directory))
    figures = load_record(path, "move it away") if path else None
    rates = recorded_rates(figures, state_dtype, master) if figures else None
    if rates is None or math.isinf(rates["host_to_gpu_bps"]):
        quantized = state_dtype != "fp32"
        return quantized, (f"no probe record with the GPU's link and the host's kernel "
                           f"(python -m smartinf.probe DIR --record): {state_dtype} moments "
                           f"(~{state:.1f} B a param each way) on the "
                           + ("GPU" if quantized else "host's cores"))
    link = min(rates["host_to_gpu_bps"], rates["gpu_to_host_bps"]) * BOTH_WAYS_SHARE
    gpu_pps, host_pps = link / state, rates["host_pps"]
    return gpu_pps > host_pps, (f"{path}: the GPU over PCIe {gpu_pps / 1e9:.2f} G params/s "
                                f"({link / 1e9:.1f} GB/s each way, {state:.2f} B a param), the "
                                f"host's cores {host_pps / 1e9:.2f} G params/s")


def host_states_budget(host_states: "bool | str", state_dtype: str, master: str,
                       memory_budget: int, holders: int, directory: str) -> int:
    """Bytes of host memory the GPU takes from the cores' memory tier (``memory_budget`` on
    each of ``holders`` directories) for its states in host memory (``CudaDevice(memory=
    "host")``, in ``directory``'s ``gpu-host/``): all for ``host_states=True``, none for
    False, and for ``"auto"`` all where the GPU updates them faster (``gpu_takes_host_states``,
    logged), none where not or where there is no GPU or no budget; but where ``directory``
    holds a run, as that run placed them (in ``gpu-host/`` or not: its sub-groups are where
    it put them, and another device list would be refused). True without a GPU or a budget
    is refused, saying why."""
    if not host_states:
        return 0
    run = os.path.isfile(os.path.join(directory, MANIFEST))
    held = os.path.isfile(os.path.join(directory, GPU_HOST_DIRECTORY, MANIFEST))
    import torch  # (not at import: plan's command line runs without torch's CUDA)
    budget = memory_budget * holders
    why_not = ("no CUDA GPU is visible here" if not torch.cuda.is_available() else
               "there is no memory_budget: no states are kept in host memory" if not budget else "")
    if why_not and host_states == "auto":
        return 0
    if why_not:
        raise ValueError(f"host_states=True updates the states a memory_budget keeps in host "
                         f"memory on the GPU, and {why_not}: give a GPU and a memory_budget "
                         f"(or state_dtype='auto'), or leave host_states out")
    if host_states == "auto" and (held or run):
        logger.warning("smartinf: the states in host memory updated on the %s: %s holds a run "
                       "with them there", "GPU" if held else "host's cores", directory)
        return budget if held else 0
    if host_states == "auto":
        takes, why = gpu_takes_host_states(state_dtype, master, directory)
        logger.warning("smartinf: the states in host memory updated on the %s (host_states "
                       "says otherwise): %s", "GPU" if takes else "host's cores", why)
        return budget if takes else 0
    return budget


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
        print(f"smartinf.plan: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
        return 1
    print(choice.report())
    for r in choice.weighed:
        step = f"{r['step_s']:.2f} s" if r["step_s"] is not None else "-"
        print(f"  {r['state_dtype']:>4}/{r['master']:<5} resident {r['resident']:>4.0%}  "
              f"disk {space._size(sum(r['disk_bytes'].values())):>8} ({r['copies']} "
              f"cop{'y' if r['copies'] == 1 else 'ies'})  step {step:>8}  "
              f"{'refused: ' + r['refused'] if r['refused'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
