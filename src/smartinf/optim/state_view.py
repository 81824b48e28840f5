"""``opt.state`` as torch's optimizers hold it, over states that live on the devices.

torch's ``opt.state[p]`` maps a stepped param to its states (``step``, ``exp_avg``, ...);
code reads it to log the moments and writes it to reset them (after a loss spike). Here
each stored param's entry is a ``ParamState``: a dict that reads its param's states from the
devices when first looked into (``state_dict()``'s arrays: fp32, on the CPU, in pages of an
unlinked file as ``torch_state`` exports them), and remembers what it handed out. What is
written through it (a value replaced, a tensor changed in place, an entry cleared or
deleted) reaches the devices at the next ``step()`` (or ``state_dict()``, ``save()``,
``close()``), before the update and before any update started during backward (those of an
edited sub-group wait for ``step()``, or are retracted there), as a step of its own
(``apply``): never an empty entry that reads as no state, never an edit dropped. The tensors
handed out stay the live states until the next step (across ``state_dict()`` and ``save()``);
that step forgets the entry, the next look reads the states again, and an edit through a
tensor handed out before it is refused (``check``), not lost.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Callable, Optional

import torch

from smartinf.optim import subgroups
from smartinf.optim.sharding import Sharding, local
from smartinf.optim import torch_state
from smartinf.optim.torch_state import _export_tensor, one_step_count


def _written(t: torch.Tensor) -> tuple:
    """What tells that ``t`` was written in place: its version counter and its local
    shard's (an in-place op on a DTensor bumps the DTensor's counter, not its local
    tensor's; one through ``to_local()`` bumps the local's)."""
    return t._version, local(t)._version


def _filled(method: Callable) -> Callable:
    def call(self: "ParamState", *args: Any, **kwargs: Any) -> Any:
        self._fill()
        return method(self, *args, **kwargs)
    call.__name__ = method.__name__
    return call


def _edits(method: Callable) -> Callable:
    def call(self: "ParamState", *args: Any, **kwargs: Any) -> Any:
        self._fill()
        self._touched = True
        return method(self, *args, **kwargs)
    call.__name__ = method.__name__
    return call


class ParamState(dict):
    """One stored param's entry of ``opt.state``: filled from the devices when looked into."""

    def __init__(self, view: "StateView", param: torch.Tensor) -> None:
        super().__init__()
        self._view, self._param = view, param
        self._read = False  # read since the last step (False: the next look reads the states)
        self._handed: dict = {}  # name -> (tensor, its local version) as the devices hold it
        self._touched = False  # replaced, deleted or cleared through the dict
        self._steps_read = 0  # the step count it said as read

    def _fill(self) -> None:
        if self._read:
            return  # (the states as read, or as the caller changed them since)
        dict.clear(self)
        dict.update(self, self._view.read(self._param))
        self.kept()

    def kept(self) -> None:
        """What the entry holds is what the devices hold: edits are told from here on."""
        self._read = True
        self._handed = {n: (t, _written(t)) for n, t in dict.items(self)
                        if isinstance(t, torch.Tensor)}
        self._touched = False
        self._steps_read = self._view.stored_steps(self)

    def dirty(self) -> bool:
        """Whether the caller changed the entry since it was read (or last applied)."""
        if not self._read:
            return False
        if self._touched:
            return True
        return any(dict.get(self, n) is not t or _written(t) != v
                   for n, (t, v) in self._handed.items())

    def forget(self) -> None:
        """Drops what was read (the next look reads the states again)."""
        dict.clear(self)
        self._read, self._handed, self._touched = False, {}, False

    for _name in ("__getitem__", "__contains__", "__iter__", "__len__", "__repr__", "__eq__",
                  "__ne__", "keys", "values", "items", "get"):
        locals()[_name] = _filled(getattr(dict, _name))
    for _name in ("__setitem__", "__delitem__", "pop", "popitem", "setdefault", "update", "clear"):
        locals()[_name] = _edits(getattr(dict, _name))
    del _name

    def copy(self) -> dict:
        """A plain dict of the entry (as are its pickles and deep copies: the states, not the
        optimizer behind them)."""
        self._fill()
        return dict(dict.items(self))

    def __reduce_ex__(self, protocol: int) -> tuple:
        return dict, (self.copy(),)


class StateView(defaultdict):
    """``opt.state``: a ``ParamState`` for each param the devices store (torch's ``defaultdict``
    for any other key), with the optimizer's view of its states (``read``) and its edits
    written back (``apply``)."""

    def __init__(self, opt: Any) -> None:
        super().__init__(dict)
        self._opt = opt
        self._cache: Optional[tuple] = None  # (step, sub-group id, its arrays): one at a time
        # (param, name, a weak reference to a tensor handed out before a step, its version
        # then): an edit through one is refused, the step having changed the states under it
        self._outdated: list = []

    def __missing__(self, key: Any) -> Any:
        if self._stores(key):
            dict.__setitem__(self, key, ParamState(self, key))
            return dict.__getitem__(self, key)
        return super().__missing__(key)

    def _stores(self, key: Any) -> bool:
        return isinstance(key, torch.Tensor) and id(key) in getattr(self._opt, "_stored", ())

    # A stored param's entry stays in place: replacing or deleting it is an edit of its states.
    def __setitem__(self, key: Any, value: Any) -> None:
        if not self._stores(key):
            return dict.__setitem__(self, key, value)
        entry = self[key]
        if value is not entry:
            values = dict(value)
            entry.clear()
            entry.update(values)

    def __delitem__(self, key: Any) -> None:
        if self._stores(key) and key in self:
            return self[key].clear()  # (torch: the param starts afresh at its next step)
        dict.__delitem__(self, key)

    def pop(self, key: Any, *default: Any) -> Any:
        if self._stores(key) and key in self:
            held = self[key].copy()
            del self[key]
            return held
        return dict.pop(self, key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = {} if default is None else default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        self.replace({})

    def popitem(self) -> tuple:
        raise TypeError("opt.state.popitem(): the states of smartinf.optim's params stay on its "
                        "devices; reset one with `del opt.state[p]`, all with opt.state.clear()")

    def mark(self, params: list) -> None:
        """An entry for each of ``params`` (stored params once states exist)."""
        for p in params:
            if not isinstance(dict.get(self, p), ParamState):
                dict.__setitem__(self, p, ParamState(self, p))

    def step_count(self) -> int:
        return self._opt.pipeline.step_count

    def stored_steps(self, entry: ParamState) -> int:
        """The step count ``entry`` says (torch's ``step``, or what stands for it)."""
        return self._opt._stored_steps(dict(dict.items(entry)), self._opt.param_groups[
            next(sg.group for sg in self._opt._plan for s in sg.slices if s.param is entry._param)])

    def replace(self, value: Any) -> None:
        """``opt.state = ...``: every stored param's entry becomes ``value``'s (none: reset,
        as torch's optimizers start a param afresh); other keys as given."""
        for key in list(dict.keys(self)):
            if not isinstance(dict.get(self, key), ParamState):
                dict.__delitem__(self, key)
        for entry in self._entries():
            values = dict(value.get(entry._param) or {})  # (before the clear: it may be itself)
            entry.clear()
            entry.update(values)
        for key, v in value.items():
            if not isinstance(dict.get(self, key), ParamState):
                self[key] = v

    def __reduce_ex__(self, protocol: int) -> tuple:
        return dict, ({k: (v.copy() if isinstance(v, ParamState) else v) for k, v in dict.items(self)},)

    def forget(self) -> None:
        """Drops every entry's read states and unapplied edits (a state_dict loaded over them),
        and those through tensors handed out before the last step."""
        self._cache, self._outdated = None, []
        for e in self._entries():
            e.forget()

    def step_begins(self) -> None:
        """A step changes the states (after ``apply``): each entry read is forgotten (the next
        look reads the step's states) and the tensors it handed out are recorded, so that an
        edit through one later is refused (``check``) rather than lost."""
        self._cache = None
        self._outdated = [r for r in self._outdated if r[2]() is not None]
        for e in self._entries():
            self._outdated += [(e._param, n, weakref.ref(t), _written(t))
                               for n, (t, _) in e._handed.items()]
            e.forget()

    def edited(self, sg: subgroups.Subgroup) -> bool:
        """Whether the caller changed an entry of ``sg``'s params that is not applied yet (its
        update during backward waits for ``step()``, which applies the edit first)."""
        return any(isinstance(e := dict.get(self, s.param), ParamState) and e.dirty()
                   for s in sg.slices)

    def _entries(self) -> list[ParamState]:
        return [e for e in dict.values(self) if isinstance(e, ParamState)]

    # -- reading ---------------------------------------------------------------------
    def read(self, param: torch.Tensor) -> dict:
        """``param``'s states as torch's optimizer holds them (none before its first step)."""
        opt = self._opt
        opt._laid_out()
        opt._session.settle()
        entry: dict = {}
        for sg in opt._plan:
            for s in sg.slices:
                if s.param is not param:
                    continue
                steps = opt.pipeline.subgroup_steps(sg.id)
                if not torch_state.holds_states(opt, sg, steps):
                    return {}
                stored = self._arrays(sg)
                if not entry:
                    shape = local(param).shape
                    arrays = {n: _export_tensor(opt, shape) for n in opt.pipeline.optimizer.state_names}
                    entry = opt._torch_state(steps, arrays, opt.param_groups[sg.group])
                for n, x in entry.items():
                    if n != "step" and isinstance(x, torch.Tensor):
                        x.view(-1)[s.start:s.stop] = torch.from_numpy(
                            stored[n][s.offset:s.offset + s.stop - s.start])
        return {n: Sharding.state(x, param) if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                for n, x in entry.items() if x is not None}

    def _arrays(self, sg: subgroups.Subgroup) -> dict:
        """The stored states of ``sg`` (the last sub-group read kept until the next step)."""
        opt, step = self._opt, self.step_count()
        if self._cache is None or self._cache[:2] != (step, sg.id):
            self._cache = (step, sg.id, torch_state.read(opt, sg))
        return self._cache[2]

    # -- writing ---------------------------------------------------------------------
    def check(self) -> None:
        """Refuses, before anything changes, edits ``apply`` would refuse."""
        self._writes()

    def _writes(self) -> tuple[dict, list]:
        """The entries the caller changed, by param, and each sub-group they touch with the
        one step count it keeps (checked). The updates started during backward of those
        sub-groups read the states before the edit: retracted first (``step()`` redoes them),
        so that the count is the one before them."""
        self._refuse_outdated_edits()
        dirty = {id(e._param): e for e in self._entries() if e.dirty()}
        touched = [sg for sg in self._opt._plan if any(id(s.param) in dirty for s in sg.slices)]
        if touched and self._opt._speculation is not None:
            self._opt._speculation.drop([sg.id for sg in touched], "states edited")
        return dirty, [(sg, self._steps(sg, dirty)) for sg in touched]

    def _refuse_outdated_edits(self) -> None:
        """Raises once for edits through tensors handed out before the last step, changed in
        place or put back into an entry (then dropped: a step after the error, or
        ``close()``, goes on without them). (torch's are the live states, stepped in place.)"""
        alive = [(p, n, t, version) for p, n, ref, version in self._outdated if (t := ref()) is not None]
        holders = {id(v): e for e in self._entries() if e._read for v in dict.values(e)}
        edited = [(p, n) for p, n, t, version in alive
                  if _written(t) != version or id(t) in holders]
        if edited:
            self._outdated = []
            for _, _, t, _ in alive:
                if id(t) in holders:
                    holders[id(t)].forget()
            raise ValueError(
                f"tensors taken from opt.state before a step() were changed in place or put "
                f"back into it after that step "
                f"({', '.join(f'{n!r} of a param of shape {tuple(p.shape)}' for p, n in edited)}): "
                f"smartinf.optim reads opt.state from its devices, and a tensor handed out is "
                f"the live state only until the next step() (state_dict() and save() keep it), "
                f"so the edit was dropped and nothing was written. Take the tensor from "
                f"opt.state again after each step() (opt.state[p]['exp_avg'].mul_(0.5))")

    def apply(self) -> None:
        """Writes the entries the caller changed onto the devices, as a step of their own
        (FSDP2: every rank takes one, edited or not); every entry read stays what the devices
        hold, its tensors the live states (a step forgets them: ``step_begins``). Refused
        (nothing written) where a sub-group's params would end with different step counts:
        the devices keep one a sub-group."""
        opt = self._opt
        self._cache = None
        dirty, writes = self._writes()
        anywhere = opt._sharding.any(bool(dirty)) if opt._sharding.active else bool(dirty)
        if not anywhere:
            return
        with opt.pipeline.step():
            for sg, steps in writes:
                states = torch_state.read(opt, sg)
                for s in sg.slices:
                    entry = dirty.get(id(s.param))
                    if entry is None:
                        continue
                    for n in opt.pipeline.optimizer.state_names:
                        value = dict.get(entry, n)
                        part = states[n][s.offset:s.offset + s.stop - s.start]
                        if value is None:
                            part[:] = opt.pipeline.optimizer.initial_state
                        else:
                            part[:] = local(value).detach().reshape(-1)[s.start:s.stop] \
                                .to("cpu", torch.float32).numpy()
                opt.pipeline.write_states(sg.id, states, steps)
        for e in self._entries():  # (their tensors stay the live states)
            if e._read:
                e.kept()

    def _steps(self, sg: subgroups.Subgroup, dirty: dict) -> int:
        """The one step count ``sg`` keeps after its params' edits, checked."""
        opt = self._opt
        current = opt.pipeline.subgroup_steps(sg.id)
        counts = set()
        for s in sg.slices:  # (a step count left as read keeps the sub-group's)
            entry = dirty.get(id(s.param))
            said = current if entry is None else self.stored_steps(entry)
            counts.add(current if entry is not None and said == entry._steps_read else said)
        return one_step_count(
            sg, counts, "opt.state edits would leave the params of sub-group {sg} (shapes "
            "{shapes}) at steps {counts}", "so nothing was written. Reset the moments in place "
            "(opt.state[p]['exp_avg'].zero_()) and keep 'step', or edit every param of the "
            "sub-group alike")
