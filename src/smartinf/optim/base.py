"""``smartinf.optim``'s common machinery (``_StorageOptimizer``): the param groups' sub-groups
opened on the devices, the step (GradScaler's protocol, the gradients checked, scaled and
clipped, updates started during backward kept or redone, the rest sent through the
``StepSession``), edits of the params taken as masters, torch's ``state_dict`` and the
native checkpoint. The classes users make (``AdamW``, ``SGD``, ...) are ``__init__.py``'s."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from smartinf.step import edits
from smartinf.optim import gradients, subgroups, torch_state
from smartinf.optim import options as optim_options
from smartinf import update_rules
from smartinf.pipeline.checkpoint import save_devices, save_param_groups
from smartinf.pipeline.compress import TopK
from smartinf.defaults import small_tensor, speculate_on_cpu
from smartinf.pipeline.devices import DeviceLike, resolve_devices
from smartinf.step.driver import Driver, overrides, rule_for
from smartinf.pipeline.pipeline import Pipeline
from smartinf.pipeline.settings import PipelineSettings
from smartinf.optim.hooks import ParamHooks
from smartinf.optim.ddp import DdpTrigger
from smartinf.optim.state_view import StateView
from smartinf.optim import sharding
from smartinf.optim.sharding import Sharding, local
from smartinf.step import ranks
from smartinf.step.speculation import Speculation
from smartinf.step.session import StepSession
from smartinf.optim.subgroups import Subgroup
from smartinf.planning import gpu_budget

logger = logging.getLogger("smartinf")

#: Parameters per sub-group unless ``subgroup_size`` says otherwise (DeepSpeed's
#: ``sub_group_size`` plays the same role): 64 MiB of fp32 staging per buffer.
DEFAULT_SUBGROUP_SIZE = 16 << 20


class _StorageOptimizer(torch.optim.Optimizer):
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
                 subgroup_size: int = DEFAULT_SUBGROUP_SIZE, compress: Optional[TopK] = None,
                 max_grad_norm: Optional[float] = None, if_exists: str = "error",
                 gpu_memory_budget: "int | str | None" = None,
                 gpu_twins: "bool | str | None" = None, gpu_host_states: "bool | str" = "auto",
                 **options: Any) -> None:
        optim_options.check_keywords(subgroup_size, compress, max_grad_norm)
        storage, full = optim_options.split(options, self.torch_class, defaults)
        self.pipeline: Optional[Pipeline] = None  # none until laid out (_laid_out)
        super().__init__(params, full)
        self.compress = compress
        self.max_grad_norm = max_grad_norm
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_grad_norm: Optional[float] = None
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

    def _laid_out(self, force: bool = True) -> bool:
        """Whether the states are laid out: laid out now unless they wait (then only where
        ``force``: the first step) for FSDP2's sharding to come (Accelerate's prepare() and
        the Trainer's shard the model after the optimizer is made and put the sharded params
        into its groups), or for the first iteration to measure a GPU budget of "auto"."""
        if self.pipeline is not None:  # (every step: nothing more to ask)
            return True
        waits = sharding.announced(self._trained()) or \
            self._layout["gpu_memory_budget"] == "auto" and self._held_gpu is None
        if force or not waits:
            for group in self.param_groups:  # (the params put in since __init__)
                optim_options.check_group(self, group)
                optim_options.check_params(self, group)
            self._open(**self._layout)
        return self.pipeline is not None

    def _open(self, devices: Any, storage: dict, if_exists: str, gpu_memory_budget: Any,
              gpu_twins: Any, gpu_host_states: Any) -> None:
        """Plans the sub-groups over the params in the groups now and opens them on the
        devices (resumed where the directories hold them), with the hooks that start updates
        during backward."""
        storage, compress, subgroup_size = dict(storage), self.compress, self._subgroup_size
        measured = gpu_memory_budget == "auto"
        if measured:  # what a resumed run's GPU holds, or the first step left
            gpu_memory_budget = self._held_gpu if self._held_gpu is not None else gpu_budget.measured()
        # FSDP2: each rank's shards, and what must hold across the ranks (refused first where
        # the sharding is not FSDP2's)
        self._sharding = Sharding(self._trained())
        storage, self.placement = optim_options.placed(self._trained(), storage, resolve_devices(devices),
                                                       gpu_memory_budget, if_exists)
        settings = PipelineSettings.resolve(if_exists=if_exists, **storage)
        if self._sharding.active and settings.copies == "log":
            raise ValueError("copies='log' over FSDP2-sharded params: the ranks would have to "
                             "agree on a logged step when they reopen, which smartinf.optim "
                             "does not do yet (docs/fsdp.md); take copies=2 or copies=1")
        # int8/int4 states: small tensors in sub-groups of their own, with fp32 moments
        self._small = small_tensor(settings.state_dtype)
        self._plan = subgroups.plan_subgroups(self.param_groups, subgroup_size, small=self._small)
        # (a sharded param whose shard here is empty has no slice, and is stored all the same)
        self._stored = {id(p) for group in self.param_groups for p in group["params"] if p.requires_grad}
        self._marked = False  # self.state names the params whose states exist (_mark_states)
        self._split = settings.master == "split"
        optim_options.refuse_split_of_other_dtypes(self._split, self._plan)
        # What the model's params held when the optimizer last put or took them: an edit
        # since becomes the master at the next step (a split master's devices check itself).
        self._watch = None if self._split else edits.ParamWatch(
            lambda i: [subgroups.read(s.param, s.start, s.stop) for s in self._plan[i].slices])
        if measured:  # (the states' bytes, where less)
            gpu_memory_budget = optim_options.fit_gpu_budget(
                gpu_memory_budget, self._plan, settings, 1 + len(self._rule(self.param_groups[0]).state_names))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks.leave_cleanly()
        if self._sharding.active:  # (before anything is written)
            ranks.refuse_moved(self._sharding.sum, self._sharding.rank, self._sharding.world,
                               subgroups.device_path(resolve_devices(devices)[0]), if_exists)
        opening = ranks.opening_together(self._sharding.sum, self._sharding.rank, self._sharding.world) \
            if self._sharding.active else contextlib.nullcontext()
        with opening:
            pipeline = optim_options.open_pipeline(self._plan, self._small, resolve_devices(devices),
                                                   self._rule(self.param_groups[0]), settings,
                                                   gpu_memory_budget, gpu_twins, gpu_host_states)
        self._driver = Driver(pipeline, max((sg.numel for sg in self._plan), default=1), compress)
        try:
            if self._sharding.active:  # every rank at one durable step before any is attached
                ranks.agree_on_step(pipeline, self._sharding.sum, self._sharding.rank,
                                    self._sharding.world, [d.path for d in pipeline.devices],
                                    settings.copies)
            self._attach(pipeline, self._plan)
        except BaseException:
            pipeline.close()
            raise
        self.pipeline = pipeline
        # Updates started during backward: not with top-k compression, whose error feedback
        # a retracted update would have advanced, and where backward runs on the CPU only
        # when asked (speculate_on_cpu).
        self._speculation: Optional[Speculation] = None
        gpu = any(sg.device.type == "cuda" for sg in self._plan)
        if pipeline.settings.overlap and compress is None and (gpu or speculate_on_cpu()):
            self._speculation = Speculation(pipeline)
            self._hooks = ParamHooks(self._speculation, lambda sg, grad, scale, hyper, out: self._driver.send(
                                         sg.id, grad, 0, scale, hyper, out=out, speculative=True,
                                         params=self._flat_params(sg) if self._split else None),
                                     lambda sg: overrides(self._rule(self.param_groups[sg.group])),
                                     gradients.flat)
            self._hooks.register(self._plan)
            self._ddp = DdpTrigger(self._trained(), self._hooks)
        self._session = StepSession(pipeline, self._driver,
                                    lambda i, flat: self._scatter(self._plan[i], flat),
                                    self._speculation)

    # -- hyper-parameters -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``: the new group's params get new
        sub-groups on the devices (resumed, when reopened directories hold them), after
        those of the groups before it."""
        super().add_param_group(param_group)
        if self.pipeline is None:
            return  # torch's __init__ adding the constructor's groups
        group = self.param_groups[-1]
        new: list[Subgroup] = []
        try:
            optim_options.check_group(self, group)
            optim_options.check_params(self, group)
            new = subgroups.plan_subgroups([group], self._subgroup_size, len(self.param_groups) - 1,
                                           len(self._plan), self._small)
            optim_options.refuse_split_of_other_dtypes(self._split, new)
            self._driver.grow(max((sg.numel for sg in new), default=0))
            self._plan.extend(new)
            self._attach(self.pipeline, new)
        except BaseException:
            self.param_groups.pop()
            if new and self._plan[-1] is new[-1]:
                del self._plan[-len(new):]
            raise
        self._stored.update(id(p) for p in group["params"] if p.requires_grad)
        if self._marked:
            self._mark_states()
        if self._speculation is not None:
            self._hooks.register(new)

    def _mark_states(self) -> None:
        """Once states exist (a step, a resume, a load): an entry in ``self.state`` per
        stored param, read from the devices when looked into. torch.distributed.checkpoint's
        helpers take an empty ``optim.state`` for an optimizer never stepped and
        "initialise" it with a step() of zero gradients at lr 0: before any step that is
        what torch's optimizers get too, after one it would be a real step on the devices."""
        names = dict.fromkeys(self._rule(self.param_groups[0]).state_names, 0)  # (torch keeps none for
        self.state.mark([p for g in self.param_groups if any(  # plain SGD: no entries either)
            v is not None for v in self._torch_state(1, names, g).values())
            for p in g["params"] if p.requires_grad])
        self._marked = True

    def _rule(self, group: dict) -> Any:
        return rule_for(self.rule_class, group)

    # -- layout -----------------------------------------------------------------------
    def _attach(self, pipeline: Pipeline, plan: Sequence[Subgroup]) -> None:
        subgroups.attach(self, pipeline, plan)

    def _gather_params(self, sg: Subgroup) -> torch.Tensor:
        """The sub-group's params as the model holds them, fp32, in staging buffer 0."""
        flat = self._driver.staging.grad(0, torch.float32, sg.numel)
        for s in sg.slices:
            flat[s.offset:s.offset + s.stop - s.start].copy_(subgroups.read(s.param, s.start, s.stop))
        return flat

    def _edited(self) -> list[int]:
        """The sub-groups whose params the caller changed since the optimizer put or took
        them (weights loaded, clamped, pruned, rolled back)."""
        return [] if self._watch is None else self._watch.changed(sg.id for sg in self._plan)

    def _adopt(self, edited: Sequence[int]) -> None:
        """The edited params become the masters (``ParamWatch.adopt``); never overwritten by
        stored ones. FSDP2: where any rank's were edited, every rank writes its own (maybe none)
        as a step, so that the ranks' step counts stay one."""
        anywhere = self._sharding.any(bool(edited)) if self._sharding.active else bool(edited)
        if anywhere:  # (FSDP2: every rank asks, edited or not: a collective)
            self._watch.adopt(self.pipeline, edited,
                              lambda i: (self._gather_params(self._plan[i]), self._plan[i].dtype),
                              self._speculation)

    def _flat_params(self, sg: Subgroup) -> torch.Tensor:
        """The sub-group's params as the model holds them, flat, on their device."""
        parts = [subgroups.read(s.param, s.start, s.stop) for s in sg.slices]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _scatter(self, sg: Subgroup, flat: torch.Tensor) -> None:
        """Puts masters (or updated params) into the model, as what it now holds (host
        params of its dtype hashed as they are copied: ``edits.copy``)."""
        hashed = self._watch is not None and flat.dtype == sg.dtype and flat.is_cpu and \
            sg.device.type == "cpu" and all(local(s.param).is_contiguous() for s in sg.slices)
        pieces = []
        for s in sg.slices:
            src = flat[s.offset:s.offset + s.stop - s.start]
            if hashed:
                held = local(s.param)
                pieces.append(edits.copy(held.detach().view(-1)[s.start:s.stop], src))
                torch.autograd.graph.increment_version(held)  # written, as copy_ says
            else:
                subgroups.write(s.param, s.start, s.stop, src)
        if self._watch is not None:
            self._watch.record(sg.id, pieces if hashed else None)

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

    def _step(self, closure: Optional[Callable[[], Any]], grad_scale: float, found_inf: bool) -> Any:
        self._laid_out()
        sharding.refuse_replaced(self, [s.param for sg in self._plan for s in sg.slices])
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group's hyper-parameters are checked before any sub-group is sent: a bad
        # one found halfway would leave earlier sub-groups' params updated in the model.
        for group in self.param_groups:
            optim_options.check_group(self, group)
        hyper = [overrides(self._rule(group)) for group in self.param_groups]
        grads = {id(p): g for group in self.param_groups for p in group["params"]
                 if (g := gradients.dense(p, self, self._stored, self.rule_class)) is not None}
        if self._sharding.active:  # every rank skips the step where any found inf/NaN
            found_inf = self._sharding.any(found_inf)
        scale, norm = (None, None) if found_inf else \
            gradients.scale(grad_scale, list(grads.values()), self.max_grad_norm, self._sharding)
        if norm is not None:
            self.last_grad_norm = norm
        self.state.check()  # (edits written through opt.state: refused before anything changes)
        session = self._session
        session.begin()
        try:
            self.state.apply()  # what was written through opt.state, before the update
            self._adopt(self._edited())  # even if the step is skipped: the caller's weights stand
            # The updates started during backward that assumed rightly; the others retracted.
            try:
                kept = session.take(scale, lambda i: hyper[self._plan[i].group])
            finally:
                if self._speculation is not None:
                    self._hooks.end_step()
                    self._ddp.stop_finding()  # (DDP is found at the first forward, or none is)
        except BaseException:
            session.fail(discard=True)
            raise
        session.predict(grad_scale if scale == grad_scale else None)  # the next step's, expected
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
        session.now({sg.id: kept[sg.id] for sg in active if sg.id in kept},
                    [sg.id for sg in active if sg.id not in kept],
                    lambda i, b: self._driver.send(
                        i, gradients.flat(self._plan[i], grads), b, scale,
                        hyper[self._plan[i].group],
                        params=self._flat_params(self._plan[i]) if self._split else None),
                    self._finish)
        return loss

    def _finish(self, i: int, buffer: int) -> None:
        sg = self._plan[i]
        self._scatter(sg, self._driver.out(buffer, sg.dtype, sg.numel))
        if sg.device.type == "cuda":
            torch.cuda.current_stream(sg.device).synchronize()  # before the buffer is reused

    # -- traffic ----------------------------------------------------------------------
    def traffic(self) -> dict[str, float]:
        """Bytes moved so far per link (host_to_device, device_to_host, storage_read,
        storage_write) and the steps committed."""
        self._laid_out()
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
            self._speculation.close()
        self.pipeline.close()

    def __repr__(self) -> str:
        if self.pipeline is None:
            return f"smartinf.optim.{type(self).__name__}(laid out once FSDP2 has sharded its params)"
        return f"smartinf.optim.{type(self).__name__}({len(self._plan)} sub-groups on {self.pipeline!r})"
