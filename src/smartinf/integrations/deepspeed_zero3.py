"""``SmartInfinityStage3``: DeepSpeed's ZeRO-3 optimizer whose per-sub-group step runs in a
``smartinf.Pipeline`` (see ``smartinf.integrations.deepspeed``): its layout (sub-groups on
the devices, the kept-whole and small params in sub-groups of their own, ``auto``'s choice)
and its step (DeepSpeed's overflow check, loss scale, norm and clipping; the updates through
the ``StepSession``, now or, with overlap, in the tail). Updates during backward:
``deepspeed_overlap``; accessors, checkpoints and the ranks' agreement: ``deepspeed_states``;
the kept-whole params: ``deepspeed_kept_whole``; ``offload_states``: ``deepspeed_offload``."""
from __future__ import annotations

import concurrent.futures
import logging
from functools import partial
from typing import Any, Callable, Optional

import torch
from deepspeed import comm as dist
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero import stage3

from smartinf import defaults
from smartinf.step.driver import overrides
from smartinf.pipeline.pipeline import Pipeline
from smartinf.step.phases import Phases
from smartinf.step.rounding import round_to
from smartinf.integrations.deepspeed_config import _rule, _rule_class, check_config, choose
from smartinf.planning.gpu_budget import measured as measured_gpu_budget
from smartinf.integrations.deepspeed_norm import norm_groups
from smartinf.integrations.deepspeed_kept_whole import KeptWhole
from smartinf.integrations.deepspeed_overlap import Overlap
from smartinf.integrations.deepspeed_states import StoredStates
from smartinf.integrations.deepspeed_offload import OffloadStates

logger = logging.getLogger("smartinf")


def _done(result: Any) -> concurrent.futures.Future:
    """A future that already holds ``result`` (an update launched now, for the tail)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


def _give_back_freed_pinned_memory() -> None:
    """With ``offload_param`` ZeRO-3 pins each param's partition as ``zero.Init`` makes it,
    then copies them into one pinned flat buffer a param group (``stage3.py``,
    ``_create_param_groups_fp16_flat_cpu_memory``) and frees them; torch's caching host
    allocator keeps the freed pages, as much host memory as the params again (130 GB at
    the 65B shape on four ranks: killed for memory once the states were made). ``auto``
    chose the states' host memory counting the params once: give the cached pages back."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)  # (torch < 2.12: not public yet)
    if empty is not None and torch.cuda.is_available():
        torch.cuda.synchronize()  # (a cached block waits for the copies that used it)
        empty()


class SmartInfinityStage3(Overlap, StoredStates, KeptWhole, OffloadStates,
                          stage3.DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 whose per-sub-group optimizer step runs in a :class:`smartinf.Pipeline`."""

    def __init__(self, module: Any, init_optimizer: Any, param_names: Any, timers: Any,
                 ds_config: dict, **kwargs: Any) -> None:
        self.settings = check_config(ds_config)
        self._rule_class = _rule_class(init_optimizer)
        self._compress = self.settings.top_k()
        self.pipeline: Optional[Pipeline] = None
        self._read: Optional[tuple] = None  # states read by an accessor, for a setter to write
        self.last_step_seconds = 0.0  # the pipeline's part of the last step()
        self.last_step_phases: dict[str, float] = {}  # where the rest of it went
        self._resumed = False
        super().__init__(module, init_optimizer, param_names, timers, ds_config, **kwargs)
        if self.offload_param:
            _give_back_freed_pinned_memory()
        if self.pipeline is not None:  # (else the first step opens it: _create_fp32_partitions)
            self._agree_on_resume()
            self._start_speculation()

    # -- layout: sub-groups live on the devices ---------------------------------------
    def _create_fp16_sub_groups(self, params_group: list) -> list:
        """DeepSpeed's, with the kept-whole (persistent) params in sub-groups of their own
        in front: ``step()`` updates those before it returns (they are small: DeepSpeed's
        ``stage3_param_persistence_threshold``), so they are gathered again with their new
        values however much of the rest finishes during the next forward (``overlap``).
        With overlap or without, so that both group the norm's sums alike. With int8/int4
        states the small tensors (``defaults.SMALL_TENSOR`` elements) come first, in
        sub-groups of their own: their moments stay fp32 (``Pipeline(small_sizes=)``)."""
        self.settings = choose(self.settings, params_group, self._speculates)
        small = defaults.small_tensor(self.settings.pipeline.state_dtype)
        kinds = [[p for p in params_group if p.ds_numel <= small],
                 [p for p in params_group if p.ds_numel > small and getattr(p, "ds_persist", False)],
                 [p for p in params_group if p.ds_numel > small and not getattr(p, "ds_persist", False)]]
        split = super()._create_fp16_sub_groups  # (no super() inside the comprehension)
        if sum(bool(k) for k in kinds) < 2:
            return split(params_group)
        return [g for k in kinds if k for g in split(k)]

    def _create_fp32_partitions(self) -> None:
        """Instead of fp32 partitions in memory: one pipeline sub-group per ZeRO sub-group,
        started from the partition's params (or resumed from the devices)."""
        numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        if any(flat is None for flat in self.fp16_partitioned_groups_flat):
            raise ValueError("parameter partitions swapped to NVMe are not supported with smartinf")
        self._offsets = [sum(numels[:i]) for i in range(len(numels))]
        self._persistent_subgroups = [i for i, group in enumerate(self.fp16_groups) if group and all(
            getattr(p, "ds_persist", False) for p in group)]
        small = defaults.small_tensor(self.settings.pipeline.state_dtype)
        self._small = [bool(group) and all(p.ds_numel <= small for p in group)
                       for group in self.fp16_groups]
        self._gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
        # (DeepSpeed's gradient buffer and bucket come after this: a GPU budget of "auto"
        # sized now leaves them room)
        self._later = (sum(numels) + (self.reduce_bucket_size if self.contiguous_gradients else 0)) * \
            self.gradient_accumulation_dtype.itemsize
        self._split = self.settings.pipeline.master == "split"
        if self._split and any(f.dtype != torch.bfloat16 for f in self.fp16_partitioned_groups_flat):
            raise ValueError("master='split' keeps the low halves of the fp32 masters of bf16 "
                             "params: enable \"bf16\" in the DeepSpeed config, or use "
                             "master='fp32'")
        self.pipeline = None
        self._speculation = self._tail = None
        # A GPU budget of "auto" is best sized from what the first iteration takes of the
        # GPU (activations, DeepSpeed's buffers), which nothing tells before it runs: its
        # first step opens the pipeline then, on every rank alike (the model's partitions
        # hold the params it starts from until that step's update).
        rank = dist.get_rank()
        measure = torch.tensor([float(self.settings.measures_gpu_budget(rank))], device=self.device)
        dist.all_reduce(measure, op=dist.ReduceOp.MIN)
        if measure.item():
            self._dirs = self.settings.with_host_states_on_gpu(rank).rank_paths(rank, self._gpu)
        else:
            self._open()
        for i, numel in enumerate(numels):
            placeholder = torch.empty(0, dtype=torch.float32)  # DeepSpeed's bookkeeping only
            ids = self.fp16_partitioned_groups_flat_id[i]
            placeholder.ds_id = f"{ids[0]}_{ids[-1]}"
            self.fp32_partitioned_groups_flat.append(placeholder)
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []

    def initialize_optimizer_states(self) -> None:
        """Nothing to allocate: the states were created on the devices with the sub-groups."""

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """DeepSpeed's ZeRO-3 step (overflow check, loss scale, norm, clipping) with the
        per-sub-group update in the pipeline, N + 1 sub-groups in flight with N devices
        (with ``overlap``: the updates not done during backward finish while the next
        forward runs)."""
        phases = Phases()
        if self.pipeline is None:  # the first step: the GPU budget from what the iteration took
            budget = measured_gpu_budget()
            phases.mark("open_budget")
            self._open(budget, phases=phases)
            self._start_speculation()
        if self._tail is not None:
            self._tail.drain()  # a step without a backward since the last one
        phases.mark("open_and_drain")
        self._pre_step()
        self._adopt(self._edited())  # even if the step is skipped: the caller's weights stand
        phases.mark("edits")
        self._release_for_step()
        phases.mark("partition")
        self._overflow_check_and_loss_scale_update(update_scale=False)
        phases.mark("overflow")
        scaled_norm = None
        if not self.overflow:
            scaled_norm = combine_grad_norm_groups(norm_groups(self))
            if is_invalid_grad_norm(scaled_norm):
                self.overflow = True
        hyper = [overrides(_rule(self._rule_class, g)) for g in self.optimizer.param_groups]
        skipped = self._loss_scale_update_and_overflow_cleanup()
        phases.mark("norm")
        if skipped:
            self._take_speculated(None, hyper)  # all retracted
            self._session.predict(None)
            self.last_step_seconds = 0.0
            self.last_step_phases = {**phases.seconds, "pipeline_s": 0.0, "post_s": 0.0}
            return  # skipped: the stored states are untouched
        self._global_grad_norm = scaled_norm / self.loss_scale
        self.timers(stage3.OPTIMIZER_STEP_TIMER).start()
        # torch's LR schedulers warn that the schedule's first value was skipped unless the
        # base optimizer's step ran: DeepSpeed's ZeRO-3 runs it, this class the pipeline
        self.optimizer._opt_called = True
        self.zero_grad(set_to_none=True)
        combined = self._combined_scale(scaled_norm)
        scale = float(1.0 / combined)
        self._session.begin()
        launch = None
        if self._tail is None:
            try:
                kept = self._take_speculated(scale, hyper)
            except BaseException:
                self._session.fail(undo=True)
                raise
            self._session.now(kept, [i for i in range(len(self.fp16_groups)) if i not in kept],
                              lambda i, b: self._send(i, b, scale, hyper[self.sub_group_to_group_id[i]]),
                              self._finish)
        else:
            launch = self._finish_later(scale, hyper)
        # the next step: the same scale, unless clipped
        self._session.predict(scale if float(combined) == float(self.loss_scale) else None)
        phases.mark("pipeline")
        self.last_step_seconds = phases.seconds["pipeline_s"]
        self.timers(stage3.OPTIMIZER_STEP_TIMER).stop()
        try:
            self._post_step({stage3.OPTIMIZER_STEP_TIMER})
        except BaseException:
            if launch is not None:
                self._tail.abort()  # (the rest never launched: the step is discarded whole)
            raise
        phases.mark("post")
        if launch is not None:
            launch()
            phases.mark("launch")
        self.last_step_phases = phases.seconds

    def _edited(self) -> list[int]:
        """The sub-groups whose partitions the caller changed since the step put them
        (through ``GatheredParameters(modifier_rank=...)``, or in a kept-whole param's
        gathered copy: ``_kept_whole_edits``)."""
        copied = self._kept_whole_edits()
        if self._watch is not None:
            return self._watch.changed(range(len(self.fp16_groups)))
        # A split master's devices tell its edits from the partition at the update; one
        # started during backward read the partition before these copies: retracted, the
        # step's update reads them (a frozen param's is in no sub-group)
        if copied and self._speculation is not None:
            self._speculation.drop(sorted({self._subgroup_of[p.ds_id] for p in copied
                                           if p.ds_id in self._subgroup_of}))
        return []

    def _adopt(self, edited: list) -> None:
        """The edited partitions become the masters (``ParamWatch.adopt``), as a step of their
        own on every rank at once (the ranks' directories keep one step count)."""
        anywhere = torch.tensor([float(bool(edited))], device=self.device)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if not anywhere.item():
            return
        flats = self.fp16_partitioned_groups_flat
        self._watch.adopt(self.pipeline, edited,
                          lambda i: (flats[i].detach().to("cpu", torch.float32), flats[i].dtype),
                          self._speculation)

    def _finish_later(self, scale: float, hyper: list) -> Callable[[], None]:
        """The updates started during backward that held are put; the rest are launched in
        the order the next forward gathers their params, and the step is committed when
        the tail drains. Returns that launch, for ``step()`` to call after DeepSpeed's post
        step: it gathers the kept-whole params with a device-wide synchronize
        (``_allgather_params_coalesced``), which would wait for every update a GPU runs (by
        its counters, the 65B shape's step() of 14 s waited so)."""
        self._tail.begin()
        try:
            # those that held finish in the tail too (their params put when the forward
            # gathers them), in the speculation's buffers, where the others' go
            kept = self._take_speculated(scale, hyper, later=self._tail.start)
            # The kept-whole params' sub-groups are updated now (gathered again with their
            # new values before step() returns). Those this GPU updates in place, from
            # states in its memory (0.11 s at 7 B on the H100: not milliseconds), in host
            # memory or on disk, are queued after, in the forward's order, and run while the
            # forward does, their gradients and params staying in their partitions
            # (untouched until the next backward drains the tail). The others go through
            # the host buffers, while the forward runs.
            self._tail.wait(self._persistent_subgroups)
            rest = [i for i in range(len(self.fp16_groups)) if i not in kept]
            here = [i for i in rest if i in self._persistent_subgroups]
            send = lambda i, b: self._send(i, b, scale, hyper[self.sub_group_to_group_id[i]])  # noqa: E731
            self._session.run(here, send, self._finish)
        except BaseException:
            self._tail.abort()
            raise

        def launch() -> None:
            try:
                for i in (i for i in rest if i not in here):
                    if self._updated_in_place(i):
                        self._tail.start(i, _done(send(i, 0)))
                    else:
                        through_host, ready = self._host_update(i, hyper[self.sub_group_to_group_id[i]],
                                                                speculative=False)
                        self._tail.start(i, self._speculation.launch(partial(through_host, scale), ready))
                self._grads_copied.clear()  # (of sub-groups updated otherwise: unused)
            except BaseException:
                self._tail.abort()
                raise
        return launch

    def _post_step(self, timer_names: Any) -> None:
        """DeepSpeed's (the kept-whole params gathered again: their sub-groups are done),
        then what they hold is what an edit is told from."""
        super()._post_step(timer_names)
        self._record_kept_whole()

    def _combined_scale(self, total_norm: Any) -> Any:
        """What DeepSpeed divides the gradients by: loss scale times the clip coefficient."""
        combined = self.loss_scale
        if self.clip_grad > 0.0:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined = torch.clamp(clip, min=1.0) * self.loss_scale
        return combined

    def _grad_partition(self, i: int) -> torch.Tensor:
        flat = self.fp16_partitioned_groups_flat[i]
        return self.grad_partitions_flat_buffer.narrow(0, self._offsets[i], flat.numel())

    def _send(self, i: int, buffer: int, scale: float, hyper: dict) -> Any:
        flat = self.fp16_partitioned_groups_flat[i]
        return self._driver.send(i, self._grad_partition(i), buffer, scale, hyper,
                                 out=flat if self._in_place(i) else None, out_dtype=flat.dtype,
                                 params=flat if self._split else None)

    def _finish_landed(self, i: int) -> None:
        """The tail's put: the params of a sub-group updated in place are in its partition
        already; another's come from its host buffer."""
        if self._updated_in_place(i):
            self._session.landed(i)
            self._finish(i, 0)
        else:
            self._put_from_host(i)

    def _finish(self, i: int, buffer: int) -> None:
        flat = self.fp16_partitioned_groups_flat[i]
        if self._in_place(i):
            self._unflatten_partitioned_parameters(i)
            self._put(i)
        else:
            self._put_params(i, self._driver.out(buffer, flat.dtype, flat.numel()))

    def _put_params(self, i: int, params: torch.Tensor) -> None:
        """Sub-group ``i``'s updated params (a host buffer), or its fp32 masters (rounded as
        the devices round them: ``rounding.round_to``), into its partition."""
        flat = self.fp16_partitioned_groups_flat[i]
        flat.copy_(round_to(params, flat.dtype), non_blocking=True)
        if not flat.is_cpu:
            torch.cuda.current_stream(flat.device).synchronize()  # before the buffer is reused
        self._unflatten_partitioned_parameters(i)
        self._put(i)

    def _put(self, i: int) -> None:
        """Sub-group ``i``'s partition holds what the step put: an edit is told from it."""
        if self._watch is not None:
            self._watch.record(i)

    def destroy(self) -> None:
        self.settle()
        if getattr(self, "_speculation", None) is not None:
            self._speculation.close()
        if self.pipeline is not None:
            self.pipeline.close()
        super().destroy()
