"""``smartinf.optim``'s arguments: the pipeline's keywords and torch's own apart, torch's
defaults filled in (so that ``param_groups`` carry exactly torch's keys and a ``state_dict``
moves between a smartinf optimizer and the torch one), and what is refused before anything
is stored: bad keyword values, a param group's options, params the devices cannot hold, a
split master of other dtypes, a GPU budget without one GPU."""
from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
from typing import Any, Optional, Sequence

import torch
from typing_extensions import TypedDict

from smartinf import _native, defaults, update_rules
from smartinf.planning import gpu_budget, plan
from smartinf.planning.host_states import cores_keep, host_states_budget
from smartinf.pipeline.compress import TopK
from smartinf.pipeline.devices import GPU_DIRECTORY, resolve_devices, with_gpu
from smartinf.step.driver import rule_for, stored_rule
from smartinf.pipeline.pipeline import Pipeline
from smartinf.pipeline.settings import KEYWORDS as PIPELINE_KEYWORDS, PipelineSettings
from smartinf.optim.sharding import Sharding, local
from smartinf.optim.subgroups import Subgroup

logger = logging.getLogger("smartinf")

class StorageOptions(TypedDict, total=False):
    """Keyword arguments every ``smartinf.optim`` optimizer takes besides torch's.

    ``subgroup_size`` params per sub-group (left out: 16 Mi, 128 Mi where every param is on a
    GPU, or what the directories' run was cut with when it resumes); ``compress`` a
    ``smartinf.pipeline.compress.TopK`` (SmartComp); ``max_grad_norm`` clipping; ``slots``,
    ``chunk``, ``io``, ``queue_depth``, ``host_link_gbps``, ``verify``, ``state_dtype``,
    ``memory_budget``, ``commit_every``, ``commit_waits``, ``compute_threads``, ``master``, ``io_schedule``,
    ``overlap``, ``copies`` as for ``smartinf.Pipeline``
    (``smartinf.pipeline.settings.KEYWORDS``; those left out of ``memory_budget``,
    ``commit_every`` and ``copies`` are what ``smartinf.planning.plan`` picks for these params,
    devices and host, reported once as a warning and kept as ``placement``; the format stays
    fp32 states and an fp32 master unless given, ``state_dtype="auto"``: the planner's too);
    ``if_exists`` what to do with directories holding an earlier run: ``"error"`` (the
    default), ``"resume"`` or ``"overwrite"``; ``gpu_memory_budget`` bytes (or ``"8GiB"``)
    of the GPU the model is on for states kept there and updated there (a
    ``smartinf.CudaDevice`` in front of ``devices``, its directory ``gpu/`` in the first
    one's; left out: ``"auto"`` where the params are on one GPU, else none; 0: none;
    ``"auto"``: what the first iteration left, the states laid out by the first step),
    ``gpu_twins`` its ``twins``
    (``"host"``: a host copy of the budget that durable commits write from; None: chosen,
    ``smartinf.planning.twins``); ``gpu_host_states`` whether that GPU also
    updates the states the ``memory_budget`` keeps in host memory, crossing PCIe (a
    ``CudaDevice(memory="host")``, directory ``gpu-host/``; ``"auto"``, the default with a
    ``gpu_memory_budget``: where faster than the host's cores, ``host_states.host_states_budget``;
    a share from 0 to 1: that share of them, the rest on the cores, at once).
    """

    subgroup_size: int
    compress: Optional[TopK]
    max_grad_norm: Optional[float]
    slots: Optional[int]
    chunk: Optional[int]
    io: Optional[str]
    queue_depth: Optional[int]
    host_link_gbps: Optional[float]
    verify: bool
    state_dtype: str
    if_exists: str
    memory_budget: "int | str"
    master: str
    io_schedule: str
    commit_every: int
    commit_waits: bool
    compute_threads: int
    overlap: bool
    gpu_memory_budget: "int | str"


_UNSUPPORTED = {"capturable": False, "differentiable": False}
_IGNORED = ("fused", "foreach")  # torch's kernel choices: the update runs on the devices


def split(options: dict, torch_class: Optional[type], defaults: dict) -> tuple[dict, dict]:
    """(the pipeline's settings among ``options``, every torch option with torch's defaults
    for ``torch_class``; None: torch has no such optimizer)."""
    storage = {k: options.pop(k) for k in PIPELINE_KEYWORDS if k in options}
    for key in _IGNORED:
        if options.pop(key, None):
            logger.info("%s=True ignored: smartinf.optim runs the update on its devices", key)
    if torch_class is None:
        return storage, {**defaults, **options}
    probe = torch.nn.Parameter(torch.zeros(1))
    return storage, dict(torch_class([probe], **defaults, **options).defaults)


def check_keywords(subgroup_size: Any, compress: Any, max_grad_norm: Any) -> None:
    if subgroup_size is not None and (not isinstance(subgroup_size, int) or
                                      isinstance(subgroup_size, bool) or subgroup_size < 1):
        raise ValueError(f"subgroup_size must be a positive int, got {subgroup_size!r}")
    if compress is not None and not isinstance(compress, TopK):
        raise TypeError(f"compress must be a smartinf.compress.TopK, got {type(compress).__name__}")
    if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")


def check_group(optimizer: Any, group: dict) -> None:
    """A param group's options against ``optimizer``'s rule (and, for what fixes the
    stored states, against its first group)."""
    name = type(optimizer).__name__
    decoupled = optimizer.rule_class is update_rules.AdamW
    if group.get("decoupled_weight_decay", decoupled) != decoupled:
        raise ValueError(f"decoupled_weight_decay={group['decoupled_weight_decay']} does not "
                         f"match {name}; use smartinf.optim.{'AdamW' if not decoupled else 'Adam'}")
    for key, allowed in _UNSUPPORTED.items():
        if key in group and group[key] not in (allowed, None, False):
            raise ValueError(f"{key}={group[key]!r} is not supported by smartinf.optim.{name}")
    if optimizer.param_groups:  # amsgrad, initial_accumulator_value: as the first group's
        stored_rule([rule_for(optimizer.rule_class, optimizer.param_groups[0]),
                     rule_for(optimizer.rule_class, group)])


def check_params(optimizer: Any, group: dict) -> None:
    """Refuses params the devices cannot hold."""
    seen: set[int] = set()
    for p in group["params"]:
        if id(p) in seen:
            raise ValueError(f"a param appears twice in one param group (torch warns and "
                             f"updates it twice per step; it will refuse it): pass each "
                             f"param once to smartinf.optim.{type(optimizer).__name__}")
        seen.add(id(p))
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"a parameter has dtype {p.dtype}; smartinf optimizes "
                            f"float32, float16 and bfloat16 parameters")
        if p.is_meta:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is on the meta device "
                             f"(no data): materialize the model (to_empty() and load the "
                             f"weights) before creating the optimizer, whose devices "
                             f"store the params' values")
        if p.is_sparse:
            raise ValueError("a parameter is a sparse tensor; smartinf updates dense params")


def refuse_split_of_other_dtypes(split: bool, plan: Sequence[Subgroup]) -> None:
    other = sorted({str(sg.dtype) for sg in plan if sg.dtype != torch.bfloat16})
    if split and other:
        raise ValueError(f"master='split' keeps the low halves of the fp32 masters of "
                         f"bfloat16 params (the params are the high ones); this model also "
                         f"has {', '.join(other)} params: use master='fp32', or a bfloat16 "
                         f"model")


def host_states(settings: PipelineSettings, devices: list, gpu_budget: "int | str | None",
                wanted: "bool | str | float") -> tuple[PipelineSettings, int]:
    """``gpu_host_states``: the settings, and the bytes of host memory moved from the cpu
    devices' memory tier to the GPU's device for states in host memory (0: none; with a
    share, the cpu devices keep the rest)."""
    given = False if wanted == "auto" and gpu_budget is None else wanted  # (checked there)
    holders = sum(getattr(d, "kind", "cpu") == "cpu" for d in devices)
    host = host_states_budget(given, settings.state_dtype, settings.master, settings.memory_budget,
                              holders, str(getattr(devices[0], "path", devices[0])))
    kept = cores_keep(settings.memory_budget, holders, host)
    return dataclasses.replace(settings, memory_budget=kept), host


def open_pipeline(subgroups: Sequence[Subgroup], small: bool, devices: list,
                  rule: update_rules.UpdateRule, settings: PipelineSettings,
                  gpu_budget: "int | str | None", gpu_twins: "bool | str | None",
                  host: int) -> Pipeline:
    """The pipeline of an optimizer's ``subgroups`` (``small``: int8/int4 states' small
    tensors in sub-groups of their own), over ``devices`` and the GPU's (``devices_with_gpu``;
    ``host``: bytes of host-memory states it updates, ``host_states``), told the sub-groups
    to come and their gradients' bytes."""
    return Pipeline(devices_with_gpu(devices, gpu_budget, gpu_twins, subgroups, host), rule,
                    settings=settings, subgroup_sizes=[sg.numel for sg in subgroups if not sg.small],
                    gradient_bytes=max((s.param.element_size() for sg in subgroups
                                        for s in sg.slices), default=4),
                    small_sizes=[sg.numel for sg in subgroups if sg.small] if small else None)


def devices_with_gpu(devices: list, budget: "int | str | None", twins: "bool | str | None",
                     plan: Sequence[Subgroup], host_budget: int = 0) -> list:
    """``devices``, with the GPU the params are on in front when given a budget (of its
    memory, or ``host_budget`` of host memory it updates)."""
    if budget is None and not host_budget:
        if twins is not None:
            raise ValueError("gpu_twins is for the states a gpu_memory_budget keeps in the "
                             "GPU's memory: give a budget, or leave gpu_twins out")
        return devices
    gpus = {sg.device for sg in plan if sg.device.type == "cuda"}
    if len(gpus) != 1:
        raise ValueError(f"gpu_memory_budget keeps states in the memory of the GPU the "
                         f"model is on; its params are on {sorted(map(str, gpus)) or 'the CPU'}"
                         f": move the model to one GPU, or leave gpu_memory_budget out")
    return with_gpu(devices, budget, gpus.pop().index, twins, host_budget)


def held_gpu_budget(budget: "int | str | None", devices: Any, if_exists: str) -> Optional[int]:
    """A ``gpu_memory_budget`` of ``"auto"``: refused without a GPU; resuming a run, the bytes
    its GPU's states take (``gpu_budget.held``); else None: the first step measures it."""
    if budget != "auto":
        return None
    if not torch.cuda.is_available():
        raise ValueError('gpu_memory_budget="auto" sizes a budget of the GPU the model is on '
                         'by the first step, and no CUDA GPU is visible here: leave it out')
    first = resolve_devices(devices)[0]
    return gpu_budget.held(os.path.join(getattr(first, "path", first), GPU_DIRECTORY)) \
        if if_exists == "resume" else None


def fit_gpu_budget(budget: int, plan: Sequence[Subgroup], settings: PipelineSettings,
                   arrays: int) -> int:
    """A measured GPU budget no larger than the sub-groups' states take there: a host twin
    (``planning.twins``) is as large as the budget, and the host memory beyond the states
    would be pinned for nothing (a 13 B model's 51 GB of states measured a 75 GB budget)."""
    return min(budget, gpu_states_bytes(plan, settings, arrays))


def gpu_states_bytes(plan: Sequence[Subgroup], settings: PipelineSettings, arrays: int) -> int:
    """The bytes the sub-groups' states take in a GPU's memory."""
    chunk = settings.chunk or defaults.chunk() or defaults.GPU_CHUNK
    return sum(_native.copy_bytes(*(("fp32", "fp32") if sg.small else
                                    (settings.state_dtype, settings.master)), chunk, sg.numel, arrays)
               for sg in plan)


def placeable(devices: list) -> bool:
    """Whether the planner places the states over ``devices`` (directories and cpu devices:
    the memory tier and the GPU's budget are theirs; an XRT or CUDA device the caller named
    takes its own budgets)."""
    return all(getattr(d, "kind", "cpu") == "cpu" for d in devices)


def default_gpu_budget(budget: "int | str | None", params: Sequence[torch.Tensor],
                       devices: Any) -> "int | str | None":
    """``gpu_memory_budget`` as given; left out (None), ``"auto"`` where the params are on one
    CUDA GPU and the devices are the planner's (``placeable``): their states go where the
    first iteration leaves room, as they would with it given; 0: none."""
    if budget is not None:
        return None if budget != "auto" and not defaults.parse_bytes(budget, "gpu_memory_budget") \
            else budget
    gpus = {local(p).device for p in params if local(p).device.type == "cuda"}
    on_one_gpu = len(gpus) == 1 and all(local(p).device.type == "cuda" for p in params)
    return "auto" if on_one_gpu and placeable(resolve_devices(devices)) else None


def placed(params: Sequence[torch.Tensor], storage: dict, devices: list,
           gpu_memory_budget: "int | str | None", if_exists: str) -> tuple[dict, Optional[plan.Choice]]:
    """The settings ``storage`` leaves to the planner, chosen (``plan.choose``) for these
    (trainable) params and devices: the memory tier, commit interval and copies, and with
    ``state_dtype="auto"`` the format and master too. Given ones win, each alone (a keyword or
    its ``SMARTINF_*`` variable); the format left out stays exact (fp32 states, fp32 master).
    Reported once at warning level; (settings, the choice; None where nothing was planned:
    devices with budgets of their own, ``placeable``)."""
    given = {**defaults.placement_given(), **storage}
    if not placeable(devices) or not sum(local(p).numel() for p in params) or (
            given.get("master") == "split" and any(p.dtype != torch.bfloat16 for p in params)):
        return storage, None  # (the devices' own budgets; nothing to place; refused below)
    try:
        choice = _choose(params, given, devices, gpu_memory_budget, if_exists)
    except OSError as e:
        if e.errno != errno.ENOSPC or given.get("state_dtype") == "auto":
            raise
        return storage, None  # (the pipeline refuses what was given, saying what would fit)
    # (said once a run: by rank 0, the others' at info level)
    (logger.warning if _rank_and_world()[0] == 0 else logger.info)("%s", choice.report())
    # what was given wins (a resumed run's format too, which the pipeline then refuses)
    return {**choice.settings(), **{k: v for k, v in storage.items() if v != "auto"}}, choice


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def host_ranks(sharded: Sharding) -> int:
    """The processes of this host that place states as this one does, sharing its memory
    and disks: FSDP2's ranks or DDP's (each a whole copy of the states), as the launcher
    says (``defaults.local_ranks``; else the world's); 1 without ``torch.distributed``."""
    world = sharded.world if sharded.active else _rank_and_world()[1]
    return defaults.local_ranks(world) if world > 1 else 1


def _choose(params: Sequence[torch.Tensor], given: dict, devices: list,
            gpu_memory_budget: "int | str | None", if_exists: str) -> plan.Choice:
    formats = given.get("state_dtype", "fp32")
    budget = given.get("memory_budget")
    sharded = Sharding(params)  # (FSDP2: this rank's shards; the host's ranks share it)
    return plan.choose(
        sum(local(p).numel() for p in params), [getattr(d, "path", d) for d in devices],
        ranks=host_ranks(sharded),
        bf16_params=all(p.dtype == torch.bfloat16 for p in params),
        gpu_budget=defaults.parse_bytes(gpu_memory_budget, "gpu_memory_budget") if gpu_memory_budget else 0,
        state_dtype=None if formats == "auto" else formats,
        master=given.get("master", None if formats == "auto" else "fp32"),
        commit_every=given.get("commit_every"), copies=given.get("copies"), if_exists=if_exists,
        processes=_rank_and_world()[1], commit_waits=given.get("commit_waits"),
        # (several ranks, FSDP2's or DDP's: no log chosen, whose step the ranks would have
        # to agree on: docs/fsdp.md; one given is refused at open, saying so)
        overlap=given.get("overlap", True if (sharded.active or _rank_and_world()[1] > 1)
                          and given.get("copies") != "log" else None),
        memory_budget=None if budget is None else defaults.parse_bytes(budget, "memory_budget"))
