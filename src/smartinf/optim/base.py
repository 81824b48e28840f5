"""``smartinf.optim``'s common machinery (``_StorageOptimizer``): the param groups' sub-groups
opened on the devices, the step (GradScaler's protocol, the gradients checked, scaled and
clipped, updates started during backward kept or redone, the rest sent through the
``StepSession``), edits of the params taken as masters, torch's ``state_dict`` and the
native checkpoint. The classes users make (``AdamW``, ``SGD``, ...) are ``__init__.py``'s."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from smartinf.step import edits
from smartinf.optim import gradients, subgroups, torch_state
from smartinf.optim import options as optim_options
from smartinf import update_rules
from smartinf.pipeline.checkpoint import save_devices, save_param_groups
from smartinf.pipeline.compress import TopK
from smartinf.pipeline.devices import DeviceLike
from smartinf.step.driver import overrides, rule_for
from smartinf.step.phases import Phases
from smartinf.pipeline.pipeline import Pipeline
from smartinf.optim.state_view import StateView
from smartinf.optim.layout import Layout
from smartinf.optim.tail import InBackground
from smartinf.optim import sharding
from smartinf.optim.sharding import local
from smartinf.optim.subgroups import Subgroup

logger = logging.getLogger("smartinf")

#: Parameters per sub-group of params on the host unless ``subgroup_size`` says otherwise
#: (``subgroups.default_size``; of params on GPUs ``subgroups.GPU_SIZE``)
DEFAULT_SUBGROUP_SIZE = subgroups.HOST_SIZE


class _StorageOptimizer(Layout, InBackground, torch.optim.Optimizer):
    """The common machinery; subclasses name the torch optimizer they stand in for."""

    torch_class: Optional[type] = torch.optim.Optimizer  # None: torch has no such optimizer
    rule_class: type = update_rules.AdamW
    #: torch.amp.GradScaler's protocol for optimizers that unscale themselves (torch's fused
    #: ones): its step() sets ``grad_scale`` (the loss scale) and ``found_inf`` on the
    #: optimizer instead of dividing the gradients in place, so the devices multiply by
    #: 1/scale in the update and the updates started during backward stay valid.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, defaults: dict, *,
                 devices: DeviceLike | Sequence[DeviceLike] | None = None,
                 subgroup_size: Optional[int] = None, compress: Optional[TopK] = None,
                 max_grad_norm: Optional[float] = None, if_exists: str = "error",
                 gpu_memory_budget: "int | str | None" = None,
                 gpu_twins: "bool | str | None" = None, gpu_host_states: "bool | str" = "auto",
                 **options: Any) -> None:
        optim_options.check_keywords(subgroup_size, compress, max_grad_norm)
        storage, full = optim_options.split(options, self.torch_class, defaults)
        self.pipeline: Optional[Pipeline] = None  # none until laid out (_laid_out)
        self._tail = None  # the step finishing in the background (optim/tail.py), once laid out
        self._in_place: frozenset = frozenset()  # sub-groups that take parts (layout._attach)
        super().__init__(params, full)
        self.compress = compress
        self.max_grad_norm = max_grad_norm
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_grad_norm: Optional[float] = None
        self.last_step_phases: dict[str, float] = {}  # the last step()'s host seconds by phase
        self._warned_partial = False
        self._stepped = False  # a step or a load has changed the states since they were opened
        self._export: Optional[tuple] = None  # what state_dict() last returned, to know it again
        self._subgroup_size = subgroup_size
        self.placement = None  # what the planner chose (plan.Choice), once laid out
        gpu_memory_budget = optim_options.default_gpu_budget(gpu_memory_budget, self._trained(), devices)
        self._layout = dict(devices=devices, storage=storage, if_exists=if_exists,
                            gpu_memory_budget=gpu_memory_budget, gpu_twins=gpu_twins,
                            gpu_host_states=gpu_host_states)
        for group in self.param_groups:
            optim_options.check_group(self, group)
            optim_options.check_params(self, group)
        self._held_gpu = optim_options.held_gpu_budget(gpu_memory_budget, devices, if_exists)
        self._laid_out(force=False)

    @property
    def state(self) -> StateView:
        """torch's ``opt.state``, its entries read from and written to the devices
        (``smartinf.optim.state_view``)."""
        return self.__dict__["_state_view"]

    @state.setter
    def state(self, value: Any) -> None:  # (torch's __init__ sets it; a caller resets it)
        view = self.__dict__.setdefault("_state_view", StateView(self))
        if value is not view:
            view.replace(value)

    def _trained(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _rule(self, group: dict) -> Any:
        return rule_for(self.rule_class, group)

    def _edited(self, now: Optional[dict] = None) -> list[int]:
        """The sub-groups whose params the caller changed since the optimizer put or took
        them (weights loaded, clamped, pruned, rolled back); ``now``: their digests taken
        already in this step (``ParamWatch.look``)."""
        return [] if self._watch is None else self._watch.changed((sg.id for sg in self._plan), now)

    def _adopt(self, edited: Sequence[int]) -> None:
        """The edited params become the masters (``ParamWatch.adopt``); never overwritten by
        stored ones. FSDP2: where any rank's were edited, every rank writes its own (maybe none)
        as a step, so that the ranks' step counts stay one."""
        anywhere = self._sharding.any(bool(edited)) if self._sharding.active else bool(edited)
        if anywhere:  # (FSDP2: every rank asks, edited or not: a collective)
            self._watch.adopt(self.pipeline, edited,
                              lambda i: (self._gather_params(self._plan[i]), self._plan[i].dtype),
                              self._speculation)

    def _scatter(self, sg: Subgroup, flat: torch.Tensor) -> None:
        """Puts masters (or updated params) into the model (``subgroups.put``)."""
        subgroups.put(sg, flat, self._watch)
        self._landed(sg)

    # -- step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scale: float = 1.0) -> Any:
        """One optimizer step over every sub-group. ``grad_scale`` multiplies the
        gradients (pass 1/loss scale with manual loss scaling; ``torch.amp.GradScaler``'s
        ``scaler.step(opt)`` passes its own, see ``gradients.amp``). A step whose gradients hold
        inf/NaN is skipped without touching the stored states: ``last_step_skipped`` tells,
        ``skipped_steps`` counts (a loss scaler backs off)."""
        try:
            return self._step(closure, *gradients.amp(self, grad_scale))
        except BaseException:
            gradients.forget_amp(self)
            raise

    def _step(self, closure: Optional[Callable[[], Any]], grad_scale: float, found_inf: bool,
              checked: bool = False) -> Any:
        phases = Phases()  # (open_and_drain, norm, edits, take, updates)
        self.last_step_phases = phases.seconds
        self._laid_out(phases=phases)  # (the first step's open marks its parts: open_*)
        if self._tail is not None:
            self._tail.drain()  # (a step without a backward since the last one)
        phases.mark("open_and_drain")
        sharding.refuse_replaced(self, [s.param for sg in self._plan for s in sg.slices])
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the params' digests first, queued on their GPUs while the host gathers the gradients
        now = None if self._watch is None else self._watch.look(sg.id for sg in self._plan)
        # Every group's hyper-parameters are checked before any sub-group is sent: a bad
        # one found halfway would leave earlier sub-groups' params updated in the model.
        for group in self.param_groups:
            optim_options.check_group(self, group)
        hyper = [overrides(self._rule(group)) for group in self.param_groups]
        grads = {id(p): g for group in self.param_groups for p in group["params"]
                 if (g := gradients.dense(p, self, self._stored, self.rule_class)) is not None}
        if self._sharding.active:  # every rank skips the step where any found inf/NaN
            found_inf = self._sharding.any(found_inf)
        # host sub-groups updated from the model's gradients into its params where they lie
        parts = gradients.in_place(self._plan, grads, self._in_place if self._tail is None else ())
        scale, norm, staged = gradients.decide(grads, grad_scale, found_inf, checked, self, parts)
        if norm is not None:  # (only clipping takes it)
            self.last_grad_norm = norm
        phases.mark("norm")
        self.state.check()  # (edits written through opt.state: refused before anything changes)
        session = self._session
        session.begin()
        try:
            staged.drop_if(staged and any(map(self.state.edited, self._plan)))  # (see drop_if)
            self.state.apply()  # what was written through opt.state, before the update
            self.state.step_begins()  # (its entries read again after it)
            # even if the step is skipped: the caller's weights stand
            self._adopt(staged.drop_if(self._edited(now)))
            phases.mark("edits")
            # The updates started during backward that assumed rightly; the others retracted.
            try:
                kept = session.take(scale, lambda i: hyper[self._plan[i].group])
            finally:
                if self._speculation is not None:
                    self._hooks.end_step()
                    self._ddp.step_ended()  # (DDP is found at the first forward, or none is)
                    if self._tail is not None:
                        self._tail.step_ended()  # (FSDP2's modules likewise)
        except BaseException:
            session.fail(undo=True)
            raise
        session.predict(grad_scale if scale == grad_scale else None)  # the next step's, expected
        phases.mark("take")
        self.last_step_skipped = scale is None
        if scale is None:
            self.skipped_steps += 1
            logger.info("gradients hold inf/NaN: step skipped, stored states untouched")
            return loss
        self._stepped = True
        self._export = None
        if not self._marked:
            self._mark_states()
        active = [sg for sg in self._plan if any(id(s.param) in grads for s in sg.slices)]
        partial = gradients.partial([sg for sg in active if sg.id not in kept])
        if partial and not self._warned_partial:
            self._warned_partial = True
            logger.warning(gradients.PARTIAL, partial)
        # (a GPU's work in its memory stays here: on its stream, the forward queues behind)
        later = self._tail is not None and not all(self._on_its_gpu(sg.id) for sg in active)
        rest = [sg.id for sg in active if sg.id not in kept]
        if later:  # updated in the order the next forward needs them
            rest = self._tail.ordered(rest)

        def send(i: int, b: int) -> Any:
            sg = self._plan[i]
            if i in parts:  # (written as it runs: a failure from now on restores them)
                session.landed(i)
                return self._driver.send(i, parts[i][0], b, scale, hyper[sg.group], out=parts[i][1])
            return self._driver.send(i, staged.take(sg, grads, b), b, scale, hyper[sg.group],
                                     params=subgroups.flat_params(sg) if self._split else None)

        def finish() -> None:
            session.now({sg.id: kept[sg.id] for sg in active if sg.id in kept}, rest, send,
                        lambda i, b: self._finish(i, b, i in parts))
        if later:  # while the next forward runs, each param's use waiting for its own sub-group
            self._tail.start({sg.id: self._held(sg) for sg in active}, finish)
        else:
            finish()
        phases.mark("updates")
        return loss

    def _finish(self, i: int, buffer: int, in_place: bool = False) -> None:
        sg = self._plan[i]
        if in_place:
            subgroups.written_in_place(sg, self._watch)
            return self._landed(sg)
        out = self._driver.out(buffer, sg.dtype, sg.numel)
        self._scatter(sg, out)
        # A host buffer's copies to the GPU land before anything reuses it (states read into
        # staging between steps too); one in the GPU's memory is written again only by an
        # update, which waits for the stream first (Pipeline.update).
        if sg.device.type == "cuda" and out.is_cpu:
            torch.cuda.current_stream(sg.device).synchronize()

    # -- traffic ----------------------------------------------------------------------
    def traffic(self) -> dict[str, float]:
        """Bytes moved so far per link (host_to_device, device_to_host, storage_read,
        storage_write) and the steps committed."""
        self._laid_out()
        self.settle()  # (the last step's bytes counted)
        return self._driver.traffic()

    # -- torch state_dict ---------------------------------------------------------------
    def _torch_state(self, steps: int, arrays: dict, group: dict) -> dict:
        """One param's entry of torch's optimizer state from the stored arrays."""
        state = {"step": torch.tensor(float(steps))}
        state.update(arrays)
        return state

    def _stored_steps(self, state: dict, group: dict) -> int:
        return int(state["step"]) if "step" in state else 0

    def state_dict(self) -> dict:
        """torch's optimizer ``state_dict`` (loadable by the torch optimizer this one
        stands in for; ``smartinf.optim.torch_state``): the states read from the devices one
        sub-group at a time into per-param tensors backed by unlinked files, which
        ``torch.save`` streams; an fp16/bf16 param's entry also holds its fp32 master
        weights (``"fp32_master"``, ignored by torch). Params the caller edited since the
        last step are taken as the masters first, as a step would. Before the states are
        laid out (FSDP2's sharding to come), torch's form of no states."""
        return torch_state.hooked_save(self, self._state_dict)

    def _state_dict(self) -> dict:
        if not self._laid_out(force=False):
            return torch_state.unstepped(self)
        self._session.settle()
        self.state.apply()
        self._adopt(self._edited())
        return torch_state.export(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads torch's optimizer ``state_dict`` format (from this class or the torch
        optimizer): hyper-parameters into ``param_groups``, states onto the devices one
        sub-group at a time, committed atomically (``smartinf.optim.torch_state``). Before the
        states are laid out, one without states sets the hyper-parameters only (Accelerate's
        prepare() hands back what ``state_dict()`` gave before it shards the model). torch's
        load hooks run around it, as torch runs them."""
        torch_state.hooked_load(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        if self._laid_out(force=bool(isinstance(state_dict, dict) and state_dict.get("state"))):
            torch_state.load(self, state_dict)
        else:
            torch_state.load_groups(self, state_dict)

    # -- native checkpoint ----------------------------------------------------------------
    def save(self, directory: str) -> list[str]:
        """Copies every device directory (states file + manifest) under ``directory``
        (``device-0``, ``device-1``, ...) plus the param groups' hyper-parameters, between
        steps (params the caller edited since the last step taken as the masters first).
        Resume by constructing the optimizer with ``devices=`` the returned paths."""
        self._laid_out()
        self._session.settle()
        self.state.apply()
        self._adopt(self._edited())
        self.pipeline.flush()  # the directories hold every committed step
        targets = save_devices([d.path for d in self.pipeline.devices], directory)
        save_param_groups(self.param_groups, directory)
        return targets

    def close(self) -> None:
        """Closes the pipeline (the devices keep the last committed step; params the caller
        edited since the last step taken as the masters first, as a step would)."""
        if self.pipeline is None:
            return
        if not self.pipeline.closed:
            self._session.settle()
            self.state.apply()
            self._adopt(self._edited())
        if self._speculation is not None:
            self._hooks.close()
            self._ddp.stop_finding()
            if self._tail is not None:
                self._tail.stop_finding()
            self._speculation.close()
        self.pipeline.close()

    def __repr__(self) -> str:
        if self.pipeline is None:
            return f"smartinf.optim.{type(self).__name__}(laid out by the first step)"
        return f"smartinf.optim.{type(self).__name__}({len(self._plan)} sub-groups on {self.pipeline!r})"


# Kept out of torch.compile's graphs (torch's recipe compiles ``opt.step``): the step is the
# devices' work, its host buffers no graph's inputs (traced, a dtype view of a staging buffer
# failed in AOT autograd); graph breaks, as torch marks its own optimizers' state_dict.
for _name in ("step", "state_dict", "load_state_dict"):
    setattr(_StorageOptimizer, _name, torch.compiler.disable(getattr(_StorageOptimizer, _name)))
del _name
