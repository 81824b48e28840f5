"""A ``Pipeline``'s states between steps: read (``read_states``: the fp32 masters and the
rule's states, a split master rebuilt from the params) and replaced as part of the current
step (``write_states``, ``write_master``); parked in host memory between phases (``park``,
``unpark``)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from smartinf.pipeline import buffers


class States:
    """Mixed into ``Pipeline`` (its ``_open``, ``_subgroup``, ``_warn_foreign``)."""

    __slots__ = ()

    def read_states(self, sg: int, into: Optional[Sequence[Any]] = None, *,
                    params: Any = None) -> dict[str, Any]:
        """The fp32 states of ``sg`` at ``step_count``: ``param`` and the optimizer's
        (``exp_avg``/``exp_avg_sq``, ``momentum_buffer``, ``sum`` ...), in new numpy arrays,
        or in ``into``: one writable fp32 buffer of the sub-group's size per name, in order.
        With ``master="split"`` the masters are rebuilt from ``params`` (the sub-group's bf16
        params as they are now); without them ``param`` is left out."""
        native = self._open()
        sg = self._subgroup(sg)
        split = self.settings.master == "split"
        names = ("param", *self.optimizer.state_names)
        if split and params is None:
            names = names[1:]
        numel = native.numel(sg)
        address, params_owner = 0, None
        if split and params is not None:
            address, _, params_owner = buffers.host_buffer("params", params, numel,
                                                           [buffers.BF16], writable=False)
        if into is None:
            into = [np.empty(numel, np.float32) for _ in names]
        if len(into) != len(names):
            raise ValueError(f"into has {len(into)} buffers, the states are {names}")
        held = [buffers.host_buffer(k, a, numel, [buffers.F32], writable=True)
                for k, a in zip(names, into)]
        arrays = {k: b.owner for k, b in zip(names, held)}
        addresses = [b.address for b in held]
        native.read_states(sg, addresses if names[0] == "param" else [0, *addresses], address)
        del params_owner
        self._warn_foreign()
        return arrays

    def write_master(self, sg: int, param: Any) -> None:
        """Replaces the fp32 master weights of ``sg`` (``param``, fp32 of the sub-group's
        size) as part of the current step; its optimizer states and step count stay. (With
        ``master="split"`` the params must then be ``param`` rounded: ``rounding.to_bf16``.)"""
        states = self.read_states(sg)
        states["param"] = param
        self.write_states(sg, states, self.subgroup_steps(sg))

    def write_states(self, sg: int, states: dict, steps: int) -> None:
        """Replaces the states of ``sg`` as part of the current step (current once it is
        committed, like an update): ``states`` maps ``param`` and the optimizer's state
        names (see ``read_states``) to fp32 buffers of the sub-group's size; a missing
        state starts at the optimizer's initial value. ``steps`` is the sub-group's
        optimizer step count from then on (Adam's ``t``)."""
        native = self._open()
        sg = self._subgroup(sg)
        numel = native.numel(sg)
        names = ("param", *self.optimizer.state_names)
        unknown = set(states) - set(names)
        if unknown:
            raise ValueError(f"unknown states {sorted(unknown)}: {self.optimizer.name} keeps {names}")
        if "param" not in states:
            raise ValueError("states must include 'param' (the fp32 master weights)")
        if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"steps must be a non-negative int, got {steps!r}")
        held = [buffers.host_buffer(k, states[k], numel, [buffers.F32], writable=False)
                if k in states else None for k in names]
        native.write_states(sg, [b.address if b else 0 for b in held], int(steps))

    def park(self) -> int:
        """Between steps: the devices' own memory given back, resident states in a GPU's
        memory copied byte for byte into host memory and the GPU's buffers freed (a durable
        commit written in the background lands first). Returns the GPU bytes freed (0 where
        the states are in host memory already). Until ``unpark()`` every other call but
        ``close()`` is refused (``close()`` unparks). DeepSpeed's ``offload_states``."""
        return self._open().park()

    def unpark(self) -> None:
        """The parked states back in the GPU's memory, as they were (``park``)."""
        self._open().unpark()

    @property
    def parked(self) -> bool:
        """Whether ``park()`` holds the states in host memory now."""
        return not self.closed and self._native.parked
