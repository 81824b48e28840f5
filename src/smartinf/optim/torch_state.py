"""torch's optimizer ``state_dict`` format for ``smartinf.optim``'s optimizers.

``export`` reads the states from the devices one sub-group at a time into per-param tensors
backed by unlinked files in the first device directory (page cache, not anonymous memory),
so a state_dict of a model larger than RAM still works; params never stepped have no entry,
as in torch; an fp16/bf16 param's entry also holds its fp32 master weights (``MASTER``,
ignored by torch), so loading it resumes exactly. ``load`` checks a state_dict (from this
class or the torch optimizer) and writes its states onto the devices in one atomic step,
the masters from the model's params where the state_dict has none. Each optimizer class
says how its states map to torch's entries (``_torch_state``, ``_stored_steps``).
"""
from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
import weakref
from typing import Any, Callable, Optional

import torch

from smartinf.optim import subgroups
from smartinf.optim.sharding import Sharding, local
from smartinf.optim import options as optim_options
from smartinf.planning import space
from smartinf.step.rounding import round_to
from smartinf.optim.subgroups import Slice, Subgroup

PAGE = 4096  # the unit a file's blocks are reserved in
MASTER = "fp32_master"  # state_dict key of a low-precision param's fp32 master (torch ignores it)


def export(opt: Any) -> dict:
    """torch's optimizer ``state_dict`` of ``opt``'s states (see the module)."""
    held = [(sg, steps) for sg in opt._plan
            if holds_states(opt, sg, steps := opt.pipeline.subgroup_steps(sg.id))]
    _check_room(opt, held)
    ids = subgroups.param_ids(opt.param_groups)
    per_param: dict[int, dict] = {}
    for sg, steps in held:
        stored = read(opt, sg, opt._driver.host_arrays(
            1 + len(opt.pipeline.optimizer.state_names), sg.numel))
        group = opt.param_groups[sg.group]
        names = opt.pipeline.optimizer.state_names + ((MASTER,) if sg.dtype != torch.float32 else ())
        for s in sg.slices:
            entry = per_param.get(ids[id(s.param)])
            if entry is None:
                entry = per_param[ids[id(s.param)]] = _entry(opt, s.param, steps, group, MASTER in names)
            for n in names:
                if isinstance(entry.get(n), torch.Tensor):
                    entry[n].view(-1)[s.start:s.stop] = \
                        stored["param" if n == MASTER else n][s.offset:s.offset + s.stop - s.start]
    if opt._sharding.active:
        _empty_shards(opt, ids, per_param)
    # torch has no entry for a param without states (SGD before momentum is used).
    state = {k: v for k, v in per_param.items()
             if any(x is not None for n, x in v.items() if n != MASTER)}
    params = {ids[id(p)]: p for group in opt.param_groups for p in group["params"]}
    for k, v in state.items():  # an FSDP2 param's states as DTensors of its global shape
        v.update({n: Sharding.state(x, params[k]) for n, x in v.items()
                  if isinstance(x, torch.Tensor) and x.dim() > 0})
    opt._export = (opt.pipeline.step_count,
                   [(k, n, weakref.ref(t), t._version) for k, v in state.items()
                    for n, t in v.items() if isinstance(t, torch.Tensor)])
    return {"state": state, "param_groups": _packed_groups(opt, ids)}


def holds_states(opt: Any, sg: Subgroup, steps: int) -> bool:
    """Whether torch's optimizer holds states for ``sg``'s params: stepped; at step 0 only
    where its states are not the initial ones (a warm restart: ``step`` set to 0, the moments
    kept; read only where a step, a load or an earlier run may have written them); FSDP2:
    always (every entry, see ``_empty_shards``)."""
    if steps > 0 or opt._sharding.active:
        return True
    if not (opt._stepped or opt.pipeline.resumed(sg.id)):
        return False
    initial = opt.pipeline.optimizer.initial_state
    stored = read(opt, sg)
    return any(bool((stored[n] != initial).any()) for n in opt.pipeline.optimizer.state_names)


def hooked_save(opt: Any, make: Callable[[], dict]) -> dict:
    """``make()``'s state_dict between torch's state-dict hooks, as ``torch.optim.Optimizer``
    runs them: each pre-hook with the optimizer, each post-hook with it and the state_dict
    (a hook's returned dict replaces it)."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = make()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def hooked_load(opt: Any, state_dict: dict, load: Callable[[dict], None]) -> None:
    """``load`` of a shallow copy of ``state_dict`` between torch's load hooks, as torch runs
    them: each pre-hook with the optimizer and the state_dict (a returned dict replaces it),
    each post-hook with the optimizer once loaded. Edits written through ``opt.state`` and not
    yet applied are dropped: the loaded states replace them."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    opt.state.forget()
    load(state_dict)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


def read(opt: Any, sg: Subgroup, into: Any = None) -> dict:
    """``sg``'s stored states (``Pipeline.read_states``; a split master rebuilt from the
    params the model holds)."""
    params = subgroups.flat_params(sg).to("cpu").contiguous() if opt._split else None
    return opt.pipeline.read_states(sg.id, into, params=params)


def unstepped(opt: Any) -> dict:
    """torch's ``state_dict`` of an optimizer whose states are not laid out yet: no states."""
    return {"state": {}, "param_groups": _packed_groups(opt, subgroups.param_ids(opt.param_groups))}


def _packed_groups(opt: Any, ids: dict) -> list:
    """The param groups as torch's ``state_dict`` holds them: the params by index."""
    return [dict({k: v for k, v in group.items() if k != "params"},
                 params=[ids[id(p)] for p in group["params"]]) for group in opt.param_groups]


def _entry(opt: Any, param: torch.Tensor, steps: int, group: dict, master: bool) -> dict:
    """A param's entry of torch's state, its arrays (of its local shard) to be filled."""
    shape = local(param).shape
    entry = opt._torch_state(steps, {n: _export_tensor(opt, shape)
                                     for n in opt.pipeline.optimizer.state_names}, group)
    if master:
        entry[MASTER] = _export_tensor(opt, shape)
    return entry


def _empty_shards(opt: Any, ids: dict, per_param: dict) -> None:
    """FSDP2: the entries of params whose shard on this rank is empty (no sub-group here),
    so that every rank's state_dict has the same keys (a checkpoint's collectives need them);
    their step is this rank's sub-groups' (the ranks step together). Every entry is there,
    initial states too: ``get_optimizer_state_dict`` gives the template ``dcp.load`` fills,
    and a key it lacks would not be loaded."""
    steps = max((opt.pipeline.subgroup_steps(sg.id) for sg in opt._plan), default=0)
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and local(p).numel() == 0 and ids[id(p)] not in per_param:
                per_param[ids[id(p)]] = _entry(opt, p, steps, group, p.dtype != torch.float32)


def load_groups(opt: Any, state_dict: dict) -> None:
    """Loads the hyper-parameters of a ``state_dict`` without states (``unstepped``)."""
    _set_groups(opt, _checked_groups(opt, state_dict))


def _checked_groups(opt: Any, state_dict: dict) -> list:
    """The state_dict's param groups over ``opt``'s params, checked."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("state_dict must be an optimizer state_dict with 'state' and "
                         "'param_groups'")
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved)} param groups, this optimizer "
                         f"{len(opt.param_groups)}")
    new_groups = []
    for mine, theirs in zip(opt.param_groups, saved):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError(f"a param group has {len(theirs['params'])} params in the "
                             f"state_dict and {len(mine['params'])} here")
        group = dict(theirs, params=mine["params"])
        optim_options.check_group(opt, group)
        opt._rule(group)  # validates the hyper-parameters before anything is written
        new_groups.append(group)
    return new_groups


def load(opt: Any, state_dict: dict) -> None:
    """Loads torch's optimizer ``state_dict`` into ``opt`` (see the module)."""
    new_groups = _checked_groups(opt, state_dict)
    saved = state_dict["param_groups"]
    ids: dict[int, int] = {}
    states = state_dict["state"]
    for mine, theirs in zip(opt.param_groups, saved):
        for p, i in zip(mine["params"], theirs["params"]):
            ids[id(p)] = i
            for n in opt.pipeline.optimizer.state_names:
                value = states.get(i, {}).get(n)
                if value is not None and not isinstance(value, torch.Tensor):
                    raise TypeError(f"state {n!r} of param {i} is {type(value).__name__}, "
                                    f"expected a tensor")
                if value is not None and value.numel() != p.numel():
                    raise ValueError(f"state {n!r} of param {i} has {value.numel()} "
                                     f"elements, the param {p.numel()}")
    if _is_own_export(opt, states):
        _set_groups(opt, new_groups)
        return
    steps = [_subgroup_steps(opt, sg, states, ids, new_groups[sg.group]) for sg in opt._plan]
    _refuse_mixing_resumed_run(opt, steps)
    opt._session.settle()
    with opt.pipeline.step():
        for sg in opt._plan:
            arrays = {"param": opt._driver.staging.grad(0, torch.float32, sg.numel)}
            arrays.update({n: torch.empty(sg.numel, dtype=torch.float32)
                           for n in opt.pipeline.optimizer.state_names})
            for s in sg.slices:
                n_elems = s.stop - s.start
                dst = slice(s.offset, s.offset + n_elems)
                entry = states.get(ids[id(s.param)], {})
                arrays["param"][dst].copy_(_master(s, entry.get(MASTER)))
                for n in opt.pipeline.optimizer.state_names:
                    value = entry.get(n)
                    if value is None:
                        arrays[n][dst].fill_(opt.pipeline.optimizer.initial_state)
                    else:
                        arrays[n][dst].copy_(local(value).detach().reshape(-1)[s.start:s.stop])
            opt.pipeline.write_states(sg.id, {k: v.numpy() for k, v in arrays.items()},
                                      steps[sg.id])
    opt._stepped = True
    opt._mark_states()
    for sg in opt._plan:  # the masters are what the model holds now
        if opt._watch is not None:
            opt._watch.record(sg.id)
    _set_groups(opt, new_groups)


def _subgroup_steps(opt: Any, sg: Subgroup, states: dict, ids: dict, group: dict) -> int:
    """The one step count a sub-group keeps, from its params' torch states."""
    return one_step_count(
        sg, {opt._stored_steps(states.get(ids[id(s.param)], {}), group) for s in sg.slices},
        "the state_dict's params of sub-group {sg} (shapes {shapes}) were stepped {counts} times",
        "so loading would change their next update. Params whose counts differ (e.g. unused "
        "for some steps) need param groups of their own, or a state_dict saved by smartinf")


def one_step_count(sg: Subgroup, counts: set, what: str, instead: str) -> int:
    """The one step count of ``counts`` (those of ``sg``'s params); where they differ,
    refused: ``what`` (formatted with the sub-group, its params' shapes and the counts), then
    why, then ``instead``."""
    if len(counts) > 1:
        shapes = [tuple(s.param.shape) for s in sg.slices]
        raise ValueError(f"{what.format(sg=sg.id, shapes=shapes, counts=sorted(counts))}: "
                         f"smartinf keeps one step count per sub-group, and torch's bias "
                         f"correction (or momentum start) depends on it, {instead}")
    return counts.pop()


def _export_bytes(opt: Any, held: list) -> int:
    """The bytes ``export``'s files take: the states (and master) of each param of the
    sub-groups ``held`` (those with states, and their step counts), fp32, a file each, in
    whole pages."""
    arrays, counted = len(opt.pipeline.optimizer.state_names), set()
    nbytes = 0
    for sg, _ in held:
        for s in sg.slices:
            if id(s.param) not in counted:
                counted.add(id(s.param))
                per_file = -(-max(1, local(s.param).numel()) * 4 // PAGE) * PAGE
                nbytes += (arrays + (sg.dtype != torch.float32)) * per_file
    return nbytes


def _check_room(opt: Any, held: list) -> None:
    """Refuses ``export`` of the sub-groups ``held`` before its first file where the first
    device directory's file system lacks the room its files take."""
    directory = opt.pipeline.devices[0].path
    need, free = _export_bytes(opt, held), shutil.disk_usage(directory).free
    if need > free:
        raise OSError(errno.ENOSPC, f"state_dict() puts the states in unlinked files in "
                      f"{directory} (the first device directory: page cache, so a model larger "
                      f"than host memory exports) and needs {space._size(need)} there, "
                      f"{space._size(free)} free: free that much, or checkpoint with "
                      f"opt.save(DIR) (copies of the device directories)", directory)


def _export_tensor(opt: Any, shape: torch.Size) -> torch.Tensor:
    """An fp32 tensor backed by an unlinked file in the first device directory: the
    exported states live in the page cache (evictable, written back to disk), not in
    anonymous host memory, so a state_dict of a model larger than RAM still works."""
    fd, path = tempfile.mkstemp(prefix=".state_dict-", dir=opt.pipeline.devices[0].path)
    size = max(1, math.prod(shape))
    try:
        # Reserved now: a page of a sparse mapping that finds the disk full is a SIGBUS.
        try:
            os.posix_fallocate(fd, 0, size * 4)
        except OSError as e:  # the disk filled since _check_room (another writer)
            raise OSError(e.errno, f"state_dict() could not reserve {space._size(size * 4)} "
                          f"for a state in {path} ({os.strerror(e.errno)}): it needs room for "
                          f"every state in the first device directory", path) from e
        flat = torch.from_file(path, shared=True, size=size, dtype=torch.float32)
    finally:
        os.close(fd)
        os.remove(path)  # the mapping keeps the data until the tensor is freed
    return flat[:math.prod(shape)].view(shape)


def _is_own_export(opt: Any, states: dict) -> bool:
    """Whether ``states`` is what state_dict() last returned, untouched, with no step
    since: loading it changes nothing on the devices (Accelerate's prepare() does
    that round trip)."""
    if opt._export is None or opt._export[0] != opt.pipeline.step_count or opt._sharding.active:
        return False  # (FSDP2: dcp.load fills the export in place, under its DTensors)
    tensors = opt._export[1]
    count = sum(isinstance(t, torch.Tensor) for v in states.values() for t in v.values())
    return count == len(tensors) and all(
        states.get(k, {}).get(n) is ref() and ref()._version == version
        for k, n, ref, version in tensors)


def _set_groups(opt: Any, new_groups: list) -> None:
    for group, new in zip(opt.param_groups, new_groups):
        group.clear()
        group.update(new)


def _master(s: Slice, saved: Optional[torch.Tensor]) -> torch.Tensor:
    """A slice's fp32 master weights on load: the state_dict's, where they round to the
    model's param (exact resume of fp16/bf16 params), else the param itself (weights
    the caller loaded win)."""
    held = subgroups.read(s.param, s.start, s.stop)
    if isinstance(saved, torch.Tensor) and saved.numel() == s.param.numel():
        master = local(saved).detach().reshape(-1)[s.start:s.stop].to(torch.float32)
        if torch.equal(round_to(master, held.dtype).to(held.device), held):
            return master
    return held


def _refuse_mixing_resumed_run(opt: Any, steps: list) -> None:
    """A state_dict of another point of the run than the directories this optimizer
    resumed (whose weights it put into the model) would pair those weights with other
    states: ambiguous, so refused."""
    resumed = [sg for sg in opt._plan if opt.pipeline.resumed(sg.id)]
    if not resumed or opt._stepped:
        return
    stored = {opt.pipeline.subgroup_steps(sg.id) for sg in resumed}
    loaded = {steps[sg.id] for sg in resumed}
    if stored != loaded:
        raise ValueError(
            f"this optimizer resumed {[d.path for d in opt.pipeline.devices]} (sub-group "
            f"steps {sorted(stored)}, whose weights it put into the model), and the "
            f"state_dict is of steps {sorted(loaded)}: to continue from the state_dict's "
            f"checkpoint, create the optimizer with if_exists='overwrite' after loading "
            f"the checkpoint's weights into the model; to continue from the directories, "
            f"do not load it")
