"""``SmartInfinityStage3``'s updates during backward (``overlap``): a sub-group's update starts
when the last of its gradient partitions is reduced (``partition_grads``), into host buffers
of one copy of the partitions; the updates not done when backward ends finish while the next
forward runs, each param's gather waiting for its own sub-group (``StepTail``)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from smartinf import defaults
from smartinf.step import edits
from smartinf.step.driver import overrides
from smartinf.step.speculation import Speculation
from smartinf.step.tail import StepTail
from smartinf.integrations.deepspeed_config import _rule

#: Updates started during backward while fewer than this are unfinished: one running and
#: one queued keep the devices busy; the rest wait for the tail, in the forward's order.
UNFINISHED_SPECULATIONS = 2


class Overlap:
    """Mixed into ``SmartInfinityStage3`` (its state: ``_speculation``, ``_tail``)."""

    def _speculates(self, backward_on_gpu: bool) -> bool:
        """Whether updates start during backward: with ``overlap``, not with top-k compression
        (whose error feedback a retracted update would have advanced), and where backward runs
        on the CPU only when asked (it holds the cores the update needs)."""
        return self.settings.pipeline.overlap and self._compress is None and \
            (backward_on_gpu or defaults.speculate_on_cpu())

    def _start_speculation(self) -> None:
        """With ``overlap`` (not with top-k compression, whose error feedback a retracted
        update would have advanced): a sub-group's update starts when the last of its
        gradient partitions is reduced at an accumulation boundary (``partition_grads``),
        into host buffers of one copy of the partitions (gradients in, params out); the
        updates not done when backward ends finish while the next forward runs, each param's
        gather waiting for its own sub-group (``StepTail``)."""
        self._speculation: Optional[Speculation] = None
        self._tail: Optional[StepTail] = None
        if not self._speculates(self.grad_partitions_flat_buffer.is_cuda):
            return
        self._speculation = self._session.speculation = Speculation(self.pipeline)
        self._subgroup_of = {p.ds_id: i for i, group in enumerate(self.fp16_groups) for p in group}
        self._awaited = [sum(p.requires_grad for p in group) for group in self.fp16_groups]
        self._reduced = [0] * len(self.fp16_groups)
        pin = self.grad_partitions_flat_buffer.is_cuda
        # (none for a sub-group its GPU updates in place: its gradient stays there, and its
        # params go into its partition, in that GPU's memory or, with offload_param, the host's)
        host = [None if self._updated_in_place(i) else flat
                for i, flat in enumerate(self.fp16_partitioned_groups_flat)]
        grad_dtype = self.grad_partitions_flat_buffer.dtype
        self._speculated_grads = [
            None if flat is None else torch.empty(flat.numel(), dtype=grad_dtype, pin_memory=pin)
            for flat in host] if pin else None
        self._speculated_params = [
            None if flat is None else torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=pin)
            for flat in host]
        self._tail = self._session.with_tail(self._finish_landed)
        # Gradients copied to the host as backward completes them (on a stream of their own:
        # the copies overlap the rest of backward), each with the event it is waited on by.
        self._copy_stream = torch.cuda.Stream() if pin else None
        self._grads_copied: dict = {}
        # A split master's host buffer of params is what its GPU partition holds after the
        # buffer was put there, until an update writes into it: unless the partition was
        # edited since (its digest, checked once a step), its params need not cross again.
        # (Partitions in host memory are copied: cheaper than their digests.)
        self._mirror = edits.ParamWatch(lambda i: [self.fp16_partitioned_groups_flat[i]]) \
            if self._split and pin else None
        self._mirrored: set = set()
        self._fresh: Optional[set] = None
        for param in self.module.parameters():  # a gathered list may begin with any param
            if hasattr(param, "all_gather_coalesced"):
                self._gathers_wait(param)

    def _in_place(self, i: int) -> bool:
        """Whether the device writes sub-group ``i``'s params into its partition itself: one
        in host memory, or in the memory of the GPU that updates it."""
        return self.fp16_partitioned_groups_flat[i].is_cpu or self._on_its_gpu(i)

    def _on_its_gpu(self, i: int) -> bool:
        """Whether sub-group ``i``'s partition is in the memory of the GPU that updates it:
        its gradient and params never leave it."""
        flat = self.fp16_partitioned_groups_flat[i]
        return flat.is_cuda and self.pipeline.gpu_of(i) == flat.device.index

    def _updated_in_place(self, i: int) -> bool:
        """Whether the GPU that updates sub-group ``i`` reads its gradient where the gradient
        buffer is and writes its params into its partition itself (in that GPU's memory, or
        in host memory with ``offload_param``): it needs no host copies of either."""
        grads = self.grad_partitions_flat_buffer
        return grads.is_cuda and self.pipeline.gpu_of(i) == grads.device.index and self._in_place(i)

    def _gathers_wait(self, param: Any) -> None:
        """``param``'s gathers (ZeRO-3's fetch and prefetch, ``GatheredParameters``, the
        kept-whole params' gather) first wait for the updates of the params they gather."""
        gather, coalesced = param.all_gather, param.all_gather_coalesced

        def all_gather(param_list: Any = None, *args: Any, **kwargs: Any) -> Any:
            self._wait_for([param] if param_list is None else param_list)
            return gather(param_list, *args, **kwargs)

        def all_gather_coalesced(params: Any, *args: Any, **kwargs: Any) -> Any:
            params = list(params)
            self._wait_for(params)
            return coalesced(params, *args, **kwargs)
        param.all_gather, param.all_gather_coalesced = all_gather, all_gather_coalesced

    def _wait_for(self, params: Any) -> None:
        if self._tail is not None:
            self._tail.wait(self._subgroup_of.get(p.ds_id) for p in params)

    def _finish_the_last_step(self) -> None:
        """The last step's updates still finishing (the tail) done: they may still read the
        gradient buffer, which is about to be written."""
        if getattr(self, "_tail", None) is not None:
            self._tail.drain()

    # DeepSpeed's gradient setters (safe_set_full_grad, safe_set_local_grad, the vectorized
    # update): in DeepSpeed a set after step() changes nothing, its step has used them
    def set_fp32_grad_for_param(self, value: Any, param: Any) -> None:
        self._finish_the_last_step()
        super().set_fp32_grad_for_param(value, param)

    def set_local_grad_for_param(self, value: Any, param: Any) -> None:
        self._finish_the_last_step()
        super().set_local_grad_for_param(value, param)

    def update_fp32_grad_for_param_vectorized(self, update_func: Any, param_list: Any) -> None:
        self._finish_the_last_step()
        super().update_fp32_grad_for_param_vectorized(update_func, param_list)

    def partition_grads(self, params_to_release: Any, grad_partitions: Any) -> Any:
        """DeepSpeed's, then the update of each sub-group whose gradient it completed. The
        last step is finished first: its updates may still read the gradient buffer."""
        self._finish_the_last_step()
        buffers = super().partition_grads(params_to_release, grad_partitions)
        if getattr(self, "_speculation", None) is not None and self.is_gradient_accumulation_boundary():
            for param in params_to_release:
                i = self._subgroup_of.get(param.ds_id)
                if i is not None:
                    self._reduced[i] += 1
                    if self._reduced[i] == self._awaited[i]:
                        if i not in self._persistent_subgroups:  # (updated at step())
                            self._copy_grad(i)
                        self._speculate(i)
        return buffers

    def _copy_grad(self, i: int) -> None:
        """Sub-group ``i``'s final gradient to its host buffer now, behind what the current
        stream (the reduce one) queued, on the copy stream: the last sub-groups' copies no
        longer wait for ``step()``."""
        if self._copy_stream is not None and self._speculated_grads[i] is not None:
            self._grads_copied[i] = self._on_copy_stream(
                lambda: self._speculated_grads[i].copy_(self._grad_partition(i), non_blocking=True))

    def _on_copy_stream(self, copy: Any) -> torch.cuda.Event:
        """``copy()`` queued on the copy stream behind the current stream's work; the event
        after it (and after every copy queued there before it)."""
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            copy()
            done = torch.cuda.Event(blocking=True)  # its waiter sleeps: the cores are the update's
            done.record()
        return done

    def _put_from_host(self, i: int) -> None:
        """The tail's put: sub-group ``i``'s params from its host buffer into its partition,
        which the buffer then mirrors."""
        self._session.put(i, self._speculated_params[i])
        if self._mirror is not None:
            self._mirror.record(i)
            self._mirrored.add(i)

    def _speculate(self, i: int) -> None:
        # Only while the devices keep up (UNFINISHED_SPECULATIONS): backward reduces the last
        # sub-groups first and the next forward gathers the first ones first, so the rest
        # goes to the tail, in the forward's order. A sub-group a GPU updates takes its
        # gradient where it is, at step() (as smartinf.optim's). A resident one is left to the tail, which
        # updates it in place: its speculative update works on a second copy of its states,
        # and on the H100 hosts that was no faster (GPT-2 XL, clip off: 1.08 / 1.42 / 1.49
        # s an iteration with, 1.66 / 1.13 without, alternated; an earlier host 2.12 / 1.15;
        # an H200 host 1.06 with, 1.19 / 1.07 without). SMARTINF_SPECULATE_RESIDENT starts it.
        if self.pipeline.gpu_of(i) is not None or \
                (self.pipeline.resident(i) and not defaults.speculate_resident()) or \
                not self._speculation.may_start(i) or \
                self._speculation.unfinished() >= UNFINISHED_SPECULATIONS:
            return
        hyper = overrides(_rule(self._rule_class, self.optimizer.param_groups[self.sub_group_to_group_id[i]]))
        send, ready = self._host_update(i, hyper, speculative=True)
        # the partition digested as read: an edit step() would not see otherwise (DeepSpeed's
        # safe_set_full_grad, a hook of the user's) has the update redone
        self._speculation.start(i, hyper, self._speculated_params[i], send, ready,
                                gradient=lambda: [self._grad_partition(i)])

    def _host_update(self, i: int, hyper: dict, speculative: bool) -> tuple:
        """Sub-group ``i``'s update through the host buffers of the speculation: its
        ``send(scale)`` and the event its inputs' host copies were recorded after (None: on
        the host already)."""
        flat = self.fp16_partitioned_groups_flat[i]
        grad = self._grad_partition(i)
        out = self._speculated_params[i]
        ready = None
        if self._speculated_grads is not None:
            if i not in self._grads_copied:
                self._copy_grad(i)
            ready = self._grads_copied.pop(i)
            grad = self._speculated_grads[i]
        # a split master's current params go in with the gradient, unless the buffer holds them
        if self._split and i not in self._unedited_mirrors():
            if self._copy_stream is None:
                out.copy_(flat)
            else:  # after the gradient's copy, on the same stream
                ready = self._on_copy_stream(lambda: out.copy_(flat, non_blocking=True))
        self._mirrored.discard(i)  # the update writes into the buffer
        return (lambda scale: self._driver.send(i, grad, 0, scale, hyper, out=out, out_dtype=flat.dtype,
                                                speculative=speculative)), ready

    def _unedited_mirrors(self) -> set:
        """The sub-groups whose host buffer holds what their partition holds: those put from
        it and not edited since (their digests checked together, once a step)."""
        if self._mirror is None:
            return set()
        if self._fresh is None:
            mirrored = sorted(self._mirrored)
            self._fresh = set(mirrored) - set(self._mirror.changed(mirrored)) if mirrored else set()
        return self._fresh

    def _take_speculated(self, scale: Optional[float], hyper: list, later: Any = None) -> dict:
        """The speculative updates that hold (the others retracted; with ``later``, those
        that hold are handed to it unfinished); the next step's bookkeeping begins."""
        if self._speculation is not None:
            self._reduced = [0] * len(self._reduced)
            self._fresh = None
            if scale is None:  # the step is skipped: its gradients' copies are not used
                self._grads_copied.clear()
        return self._session.take(scale, lambda i: hyper[self.sub_group_to_group_id[i]], later)

    def settle(self) -> None:
        """Finishes the last step now (with ``overlap`` its updates may still run after
        ``step()`` returned: done, params in the model, committed) and retracts updates
        started during a backward since (``step()`` redoes them), and lands a durable commit
        written in the background (if it failed: the devices and the partitions back at the
        durable commit before it, and its error raised; ``StepSession.settle``). Called before
        the states are read or written and before checkpoints; call it before reading params
        without a gather, or to time a step whole."""
        if getattr(self, "_session", None) is not None:
            self._session.settle()

    @property
    def overlap_stats(self) -> dict[str, float]:
        """With ``overlap``, so far: ``deferred_updates`` (updates finished after ``step()``
        returned), ``gather_waits`` (gathers that waited for one), ``gather_wait_s``
        (seconds they waited) and ``drain_s`` (seconds the next backward, ``step()`` or a
        checkpoint waited for the rest of a step and its commit)."""
        tail = getattr(self, "_tail", None)
        if tail is None:
            return {}
        return {"deferred_updates": tail.deferred, "gather_waits": tail.waits,
                "gather_wait_s": tail.wait_seconds, "drain_s": tail.drain_seconds}
