"""``smartinf.optim``'s layout (``Layout``, mixed into ``_StorageOptimizer``): the param
groups cut into sub-groups and opened on the devices, placed by the planner where settings
are left out, resumed where the directories hold them, with the hooks that start updates
during backward (and, under DDP, from its averaged gradients); the states laid out when the
optimizer is made, or by the first step where FSDP2's sharding or a GPU budget of "auto"
is still to come; param groups added later."""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from smartinf import defaults
from smartinf.defaults import small_tensor, speculate_on_cpu
from smartinf.optim import gradients, sharding, subgroups
from smartinf.optim import options as optim_options
from smartinf.optim.ddp import DdpTrigger
from smartinf.optim.hooks import ParamHooks
from smartinf.optim.sharding import Ranks, Sharding
from smartinf.optim.subgroups import Subgroup
from smartinf.optim.tail import BackgroundStep
from smartinf.pipeline import at_exit
from smartinf.pipeline import checkpoint
from smartinf.pipeline.devices import resolve_devices
from smartinf.pipeline.pipeline import Pipeline
from smartinf.pipeline.settings import PipelineSettings
from smartinf.planning import gpu_budget
from smartinf.step import edits, ranks
from smartinf.step.driver import Driver, overrides
from smartinf.step.phases import Phases
from smartinf.step.session import StepSession
from smartinf.step.speculation import Speculation

logger = logging.getLogger("smartinf")


class Layout:
    """Mixed into ``_StorageOptimizer`` (its ``param_groups``, ``_layout``, ``_rule``, ...)."""

    def _laid_out(self, force: bool = True, phases: Optional[Phases] = None) -> bool:
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
            self._open(**self._layout, phases=phases)
        return self.pipeline is not None

    def _open(self, devices: Any, storage: dict, if_exists: str, gpu_memory_budget: Any,
              gpu_twins: Any, gpu_host_states: Any, phases: Optional[Phases] = None) -> None:
        """Plans the sub-groups over the params in the groups now and opens them on the
        devices (resumed where the directories hold them), with the hooks that start updates
        during backward."""
        phases = phases or Phases()  # (the first step's: where its seconds went)
        storage, compress = dict(storage), self.compress
        devices = resolve_devices(devices)
        measured = gpu_memory_budget == "auto"
        if measured:  # what a resumed run's GPU holds, or the first step left
            gpu_memory_budget = self._held_gpu if self._held_gpu is not None else gpu_budget.measured()
        # FSDP2: each rank's shards, and what must hold across the ranks (refused first where
        # the sharding is not FSDP2's); the ranks that open one run together: FSDP2's, else
        # the default process group's of several (DDP, a torchrun job)
        self._sharding = Sharding(self._trained())
        together = self._sharding if self._sharding.active else Ranks.default()
        storage, self.placement = optim_options.placed(self._trained(), storage, devices,
                                                       gpu_memory_budget, if_exists)
        settings = PipelineSettings.resolve(if_exists=if_exists, **storage)
        if together.active and settings.copies == "log":
            raise ValueError(f"copies='log' in a run of {together.world} ranks (FSDP2, DDP): "
                             f"the ranks would have to agree on a logged step when they "
                             f"reopen, which smartinf.optim does not do yet (docs/fsdp.md); "
                             f"take copies=2 or copies=1")
        # the states in host memory the GPU updates too (the cpu devices keep the rest)
        settings, host = optim_options.host_states(settings, devices, gpu_memory_budget, gpu_host_states)
        # int8/int4 states: small tensors in sub-groups of their own, with fp32 moments
        self._small = small_tensor(settings.state_dtype)
        self._plan = self._cut(settings, gpu_memory_budget, host, devices, if_exists)
        # (a sharded param whose shard here is empty has no slice, and is stored all the same)
        self._stored = {id(p) for group in self.param_groups for p in group["params"] if p.requires_grad}
        self._marked = False  # self.state names the params whose states exist (_mark_states)
        self._split = settings.master == "split"
        optim_options.refuse_split_of_other_dtypes(self._split, self._plan)
        # What the model's params held when the optimizer last put or took them: an edit
        # since becomes the master at the next step (a split master's devices check itself).
        self._watch = None if self._split else edits.ParamWatch(
            lambda i: [subgroups.held(s.param, s.start, s.stop) for s in self._plan[i].slices])
        if measured:  # (the states' bytes, where less)
            gpu_memory_budget = optim_options.fit_gpu_budget(
                gpu_memory_budget, self._plan, settings, 1 + len(self._rule(self.param_groups[0]).state_names))
        phases.mark("open_plan")
        ranks.leave_cleanly()
        first = getattr(devices[0], "path", devices[0])
        if together.active:  # (before anything is written)
            ranks.refuse_moved(together.sum, together.rank, together.world, first, if_exists)
        else:
            ranks.refuse_alone_in_ranks_run(first, if_exists)

        def open_here() -> Pipeline:
            checkpoint.refuse_never_committed(devices, if_exists)
            return optim_options.open_pipeline(self._plan, self._small, devices,
                                               self._rule(self.param_groups[0]), settings,
                                               gpu_memory_budget, gpu_twins, host)
        if together.active:  # every rank opens, or all raise
            with ranks.opening_together(together.sum, together.rank, together.world):
                pipeline = ranks.on_every_rank(open_here, together.sum, Pipeline.close)
        else:
            pipeline = open_here()
        phases.mark("open_pipeline")
        self._driver = Driver(pipeline, max((sg.numel for sg in self._plan), default=1), compress)
        try:
            if together.active:  # every rank at one durable step before any is attached
                ranks.agree_on_step(pipeline, together.sum, together.rank, together.world,
                                    [d.path for d in pipeline.devices], settings.copies)
            self._attach(pipeline, self._plan)
        except BaseException:
            pipeline.close()
            raise
        phases.mark("open_attach")
        self.pipeline = pipeline
        at_exit.register_front_end(self)  # close() at exit if the script does not: no step lost
        # Updates started during backward: not with top-k compression, whose error feedback
        # a retracted update would have advanced, and where backward runs on the CPU only
        # when asked (speculate_on_cpu).
        self._speculation: Optional[Speculation] = None
        self._tail = None
        gpu = any(sg.device.type == "cuda" for sg in self._plan)
        if pipeline.settings.overlap and compress is None and (gpu or speculate_on_cpu()):
            self._speculation = Speculation(pipeline)
            self._hooks = ParamHooks(self._speculation, lambda sg, grad, scale, hyper, out: self._driver.send(
                                         sg.id, grad, 0, scale, hyper, out=out, speculative=True,
                                         params=subgroups.flat_params(sg) if self._split else None),
                                     lambda sg: overrides(self._rule(self.param_groups[sg.group])),
                                     gradients.flat)
            self._hooks.edited = self.state.edited  # (opt.state's edits wait for step())
            # The step finished while the next forward runs, where updates start during
            # backward and the forward runs on a GPU (or SMARTINF_STEP_TAIL_ON_CPU)
            if gpu or defaults.step_tail_on_cpu():
                self._tail = BackgroundStep()
                self._hooks.before = self._tail.drain  # (the next backward's gradients)
                if self._sharding.active:
                    self._tail.find_fsdp(self._subgroups_of)
            self._hooks.register(self._plan)
            self._ddp = DdpTrigger(self._trained(), self._hooks)
        self._session = StepSession(pipeline, self._driver,
                                    lambda i, flat: self._scatter(self._plan[i], flat),
                                    self._speculation)
        self._session.tail = self._tail  # (drained where the states are read: settle)

    def _subgroups_of(self, params: list) -> list[int]:
        """The sub-groups holding slices of ``params``."""
        ids = {id(p) for p in params}
        return [sg.id for sg in self._plan if any(id(s.param) in ids for s in sg.slices)]

    def _cut(self, settings: PipelineSettings, gpu_memory_budget: Any, host: int,
             devices: list, if_exists: str) -> list[Subgroup]:
        """The sub-groups, of ``subgroup_size`` params; left out, of the size a resumed run was
        cut with, else ``subgroups.GPU_SIZE`` where the params are on a GPU that updates every
        sub-group (its budget and the ``host`` states it updates hold them all), else
        ``subgroups.HOST_SIZE``. Kept for ``add_param_group``."""
        stored = None if self._subgroup_size or if_exists == "overwrite" else \
            subgroups.stored_size([str(getattr(d, "path", d)) for d in devices])
        size = self._subgroup_size or stored or subgroups.HOST_SIZE
        plan = subgroups.plan_subgroups(self.param_groups, size, small=self._small)
        if not (self._subgroup_size or stored) and gpu_memory_budget is not None \
                and plan and all(sg.device.type == "cuda" for sg in plan):
            budget = gpu_memory_budget if isinstance(gpu_memory_budget, int) else \
                defaults.parse_bytes(gpu_memory_budget, "gpu_memory_budget")
            arrays = 1 + len(self._rule(self.param_groups[0]).state_names)
            if budget + host >= optim_options.gpu_states_bytes(plan, settings, arrays):
                size = subgroups.GPU_SIZE
                plan = subgroups.plan_subgroups(self.param_groups, size, small=self._small)
        self._subgroup_size = size
        return plan

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``: the new group's params get new
        sub-groups on the devices (resumed, when reopened directories hold them), after
        those of the groups before it."""
        if self.pipeline is not None and self._tail is not None:
            self._tail.drain()
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

    def _attach(self, pipeline: Pipeline, plan: Sequence[Subgroup]) -> None:
        subgroups.attach(self, pipeline, plan)
        # Host sub-groups whose updates read the model's gradients and write its params where
        # they lie (Pipeline.takes_parts; not with top-k compression, which sends its own)
        self._in_place |= {sg.id for sg in plan if sg.device.type == "cpu" and
                           self.compress is None and pipeline.takes_parts(sg.id)}

    def _gather_params(self, sg: Subgroup) -> torch.Tensor:
        """The sub-group's params as the model holds them, fp32, in staging buffer 0."""
        flat = self._driver.staging.grad(0, torch.float32, sg.numel)
        for s in sg.slices:
            flat[s.offset:s.offset + s.stop - s.start].copy_(subgroups.read(s.param, s.start, s.stop))
        return flat
