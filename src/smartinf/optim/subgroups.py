"""How ``smartinf.optim`` cuts a model's trainable params into flat sub-groups (one dtype
and one device each, a param possibly spanning two), names each layout (so a directory
made for another model refuses to resume), and reads and writes a param's slice in
torch's logical order whatever its strides, and registers them on a pipeline (``attach``)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
import logging
import os
from typing import Any, Optional, Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from smartinf.optim.sharding import local
from smartinf.pipeline.checkpoint import stored_subgroups
from smartinf.pipeline.devices import GPU_DIRECTORY, GPU_HOST_DIRECTORY
from smartinf.step import edits
from smartinf.step.rounding import round_to

logger = logging.getLogger("smartinf")

#: Params per sub-group unless ``subgroup_size`` says otherwise (DeepSpeed's
#: ``sub_group_size`` plays the same role): 64 MiB of fp32 host staging per buffer.
HOST_SIZE = 16 << 20
#: ... where the params are on a GPU that updates them all: each sub-group's update costs
#: the host syncs and launches whatever its size (GPT-2 XL's 93 sub-groups of 16 Mi kept the
#: GPU idle for 0.10-0.16 s after backward), and its host staging is not touched.
GPU_SIZE = 128 << 20


@dataclass
class Slice:
    """Elements [start, stop) of a parameter's flat view, at ``offset`` in its sub-group."""

    param: torch.Tensor
    start: int
    stop: int
    offset: int


@dataclass
class Subgroup:
    id: int
    group: int
    numel: int
    dtype: torch.dtype
    device: torch.device
    slices: list
    small: bool = False  # of params of at most plan_subgroups' ``small`` elements each


def stored_size(directories: Sequence[str]) -> Optional[int]:
    """The size a run the ``directories`` hold (the devices', with the GPU's beside the
    first) was cut with: its largest sub-group (cutting at that size gives its sub-groups
    again); None where they hold none."""
    if not directories:
        return None
    first = directories[0]
    held = [n for d in (*directories, os.path.join(first, GPU_DIRECTORY),
                        os.path.join(first, GPU_HOST_DIRECTORY)) for n in stored_subgroups(d)]
    return max(held, default=None)


def plan_subgroups(param_groups: Sequence[dict], size: int, first_group: int = 0,
                   first_id: int = 0, small: int = 0) -> list[Subgroup]:
    """Cuts the trainable params (``requires_grad``) of each group, in order, into flat
    sub-groups of at most ``size`` elements; a sub-group holds one dtype and one device, a
    param may span sub-groups. Frozen params get no states, as in torch. Params of at most
    ``small`` elements (0: none) go to sub-groups of their own after the group's others
    (``Subgroup.small``: fp32 moments with int8/int4 states). An FSDP2-sharded param counts
    by its local shard (``sharding.local``). The plan is deterministic, so reopening the
    devices finds every sub-group again."""
    plan: list[Subgroup] = []
    for g, group in enumerate(param_groups, first_group):
        trained = [p for p in group["params"] if p.requires_grad]
        for is_small in (False, True):
            _cut([p for p in trained if (local(p).numel() <= small) == is_small], size, g,
                 first_id, plan, is_small)
    return plan


def _cut(params: Sequence[torch.Tensor], size: int, g: int, first_id: int,
         plan: list, small: bool) -> None:
    """Appends ``params``' sub-groups (of group ``g``) to ``plan``."""
    current: Optional[Subgroup] = None
    for p in params:
        start, held = 0, local(p)
        while start < held.numel():
            if (current is None or current.numel == size or current.dtype != held.dtype
                    or current.device != held.device):
                current = Subgroup(first_id + len(plan), g, 0, held.dtype, held.device, [], small)
                plan.append(current)
            stop = min(held.numel(), start + size - current.numel)
            current.slices.append(Slice(p, start, stop, current.numel))
            current.numel += stop - start
            start = stop


def fingerprint(sg: Subgroup) -> int:
    """A 64-bit name of the sub-group's layout (dtype, shapes, slices): a directory made for
    another model of the same size refuses to resume into this one."""
    text = repr([str(sg.dtype)] + [(*(() if local(s.param) is s.param else (tuple(local(s.param).shape),)),
                                    tuple(s.param.shape), s.start, s.stop) for s in sg.slices])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") or 1


def read(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of ``p`` (its local shard where sharded) in torch's logical
    (row-major) order, any strides."""
    return local(p).detach().reshape(-1)[start:stop]


def held(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``read``'s elements for a digest (``step.edits``): where they are the whole of a
    contiguous ``p``, ``p`` itself (its bytes are in logical order), without the three view
    ops ``read`` makes, hundreds a step."""
    t = local(p)
    if start == 0 and stop == t.numel() and t.is_contiguous():
        return t
    return read(p, start, stop)


def flat_params(sg: Subgroup) -> torch.Tensor:
    """The sub-group's params as the model holds them, flat, on their device."""
    parts = [read(s.param, s.start, s.stop) for s in sg.slices]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def copy_into(sg: Subgroup, held: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Writes ``flat`` (``sg``'s params, of their dtype, on their GPU) into ``held`` (its
    params' local tensors, contiguous) by one multi-tensor copy: a whole param as itself,
    its source shaped alike by one unflatten of ``flat`` (no view ops: hundreds a step), a
    cut one through its 1-D slice."""
    targets = [h if s.stop - s.start == h.numel() else h.detach().view(-1)[s.start:s.stop]
               for h, s in zip(held, sg.slices)]
    with torch.no_grad():
        torch._foreach_copy_(targets, _unflatten_dense_tensors(flat, targets), non_blocking=True)


def write(p: torch.Tensor, start: int, stop: int, src: torch.Tensor) -> None:
    """Writes elements [start, stop) of ``p`` in logical order, any strides (channels_last,
    transposed): a non-contiguous param is written whole."""
    p = local(p)
    src = round_to(src, p.dtype)  # fp32 masters round as the devices round them
    if p.is_contiguous():
        p.detach().view(-1)[start:stop].copy_(src, non_blocking=True)
        return
    whole = p.detach().reshape(-1).clone()
    whole[start:stop].copy_(src)
    p.detach().copy_(whole.view(p.shape))


def put(sg: Subgroup, flat: torch.Tensor, watch: Any) -> None:
    """Puts masters (or updated params) ``flat`` into the model, as what it now holds
    (``watch``'s digest: host params of the sub-group's dtype hashed as they are copied,
    ``edits.copy``; on a GPU, one multi-tensor copy, the digest taken of ``flat``, the same
    bytes)."""
    held_ = [local(s.param) for s in sg.slices]
    contiguous = flat.dtype == sg.dtype and all(h.is_contiguous() for h in held_)
    if contiguous and flat.is_cuda and sg.device == flat.device:
        copy_into(sg, held_, flat)
        if watch is not None:
            watch.record_parts(sg.id, [flat])
        return
    hashed = watch is not None and contiguous and flat.is_cpu and sg.device.type == "cpu"
    srcs = [flat[s.offset:s.offset + s.stop - s.start] for s in sg.slices]
    pieces = None
    if hashed:  # (every slice in one walk, on every core)
        pieces = edits.copy([(h.detach().view(-1)[s.start:s.stop], src)
                             for h, s, src in zip(held_, sg.slices, srcs)])
        for h in held_:
            torch.autograd.graph.increment_version(h)  # written, as copy_ says
    else:
        for s, src in zip(sg.slices, srcs):
            write(s.param, s.start, s.stop, src)
    if watch is not None:
        watch.record(sg.id, pieces)


def written_in_place(sg: Subgroup, watch: Any) -> None:
    """The sub-group's params written where the model holds them by its update
    (``Pipeline.takes_parts``): marked written, as ``copy_`` marks them, and their digest
    taken there."""
    for s in sg.slices:
        torch.autograd.graph.increment_version(local(s.param))
    watch.record(sg.id)


def param_ids(param_groups: Sequence[dict]) -> dict[int, int]:
    """torch's state_dict numbering: params in order of first appearance."""
    ids: dict[int, int] = {}
    for group in param_groups:
        for p in group["params"]:
            ids.setdefault(id(p), len(ids))
    return ids


def attach(opt: Any, pipeline: Any, plan: Sequence[Subgroup]) -> None:
    """Registers ``opt``'s sub-groups ``plan`` on ``pipeline``; new ones start from the model's params, resumed ones
    (reopened devices) put their stored master weights into the model."""
    for sg in plan:
        master = opt._gather_params(sg)
        got = pipeline.add_subgroup(sg.numel, init=master, fingerprint=fingerprint(sg),
                                    small=sg.small)
        if got != sg.id:
            raise RuntimeError(f"sub-group {sg.id} registered as {got}")
        if opt._split:
            continue  # the devices check the params against what they emitted
        if pipeline.resumed(sg.id):
            master = torch.from_numpy(pipeline.read_states(sg.id)["param"])
            with torch.no_grad():
                opt._scatter(sg, master)
        else:
            opt._watch.record(sg.id)
    resumed = sum(pipeline.resumed(sg.id) for sg in plan)
    if resumed:
        opt._mark_states()
    if resumed and opt._split:
        logger.warning("resumed %d of %d sub-groups at step %d from %s with master='split': "
                       "the directories hold the low halves of the masters, the model's "
                       "bf16 params are the high ones, so load the weights saved with that "
                       "step into the model before the first step (params that differ are "
                       "taken as the masters then, with a ParamsChangedWarning)", resumed,
                       len(plan), pipeline.step_count, [d.path for d in pipeline.devices])
    elif resumed:
        logger.warning("resumed %d of %d sub-groups at step %d from %s: their stored weights "
                       "replaced the model's", resumed, len(plan), pipeline.step_count,
                       [d.path for d in pipeline.devices])
