"""``engine.offload_states()`` / ``reload_states()`` for ``SmartInfinityStage3``: what RLHF
frameworks (OpenRLHF, verl) call to free the GPU's memory between training and generation.

DeepSpeed's own call moves its FusedAdam's fp32 partitions and moments (``hp_params``,
``optim_states``), the bf16/fp16 partitions (``lp_params``), the gradient partitions
(``lp_grads``) and frees the reduce buckets (``contiguous_grad_buffer``). Here the fp32
masters and moments are the pipeline's: ``hp_params`` and ``optim_states`` (either, or both)
park it (``Pipeline.park``: the states resident in a GPU's memory copied byte for byte into
host memory and every GPU buffer of the devices freed; states already in host memory or on
disk stay where they are), and the rest is DeepSpeed's own code, the parent's
``offload_states``. ``reload_states`` undoes both; training then goes on bit for bit as
without the round trip (``tests/test_deepspeed.py``)."""
from __future__ import annotations

from typing import Any, Container, Optional

import torch
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

#: what the pipeline holds: parked together (the masters and moments share a chunk's extent)
STORED = (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)


class OffloadStates:
    """Mixed into ``SmartInfinityStage3`` (its ``pipeline``, ``settle``, ``_opened``,
    ``_regather_persistent``; DeepSpeed's ``offloaded_states``)."""

    offloaded_bytes = 0  # the GPU memory the last park freed (Pipeline.park)

    def offload_states(self, include: Optional[Container[OffloadStateTypeEnum]] = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed's ``offload_states`` (the engine's checks first): the states named in
        ``include`` (all by default) to host memory. The last step is finished first (with
        ``overlap`` its updates may run after ``step()`` returned) and updates started during
        a backward since are retracted (``step()`` redoes them)."""
        if OffloadDeviceEnum(device) != OffloadDeviceEnum.cpu:
            raise ValueError(f"offload_states moves states to host memory (device='cpu'), "
                             f"got {device!r}")
        if self.pipeline is None or not self.pipeline.parked:  # (parked: settled then)
            self.settle()
        wanted = [s for s in OffloadStateTypeEnum if include is None or s in include]
        theirs = [s for s in wanted if s not in STORED]
        if theirs:
            super().offload_states(include=theirs, device=device, pin_memory=pin_memory,
                                   non_blocking=non_blocking)
        ours = [s for s in wanted if s in STORED]
        if ours:
            if self.pipeline is not None:  # (none yet: the first step makes the states)
                self.offloaded_bytes = self.pipeline.park()
            self.offloaded_states.update(ours)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``reload_states``: everything ``offload_states`` moved back where it
        was, the pipeline's states in the GPU's memory again; the kept-whole params (released
        by the offload) gathered again."""
        ours = [s for s in STORED if s in self.offloaded_states]
        for s in ours:
            self.offloaded_states.remove(s)
        if ours and self.pipeline is not None:
            self.pipeline.unpark()
        super().reload_states(non_blocking=non_blocking)
        self._regather_persistent()

    def get_hp_param_device(self, param: Any, optim_state_key: Optional[str] = None) -> Any:
        """Where ``param``'s fp32 master (and its optimizer states: they lie together) is:
        host memory while offloaded, else the GPU where its sub-group is resident in a CUDA
        device's memory, else host memory (a budget there, the disk's chunks in transit).
        None for a frozen param, as DeepSpeed's."""
        if not param.requires_grad:
            return None
        if any(s in self.offloaded_states for s in STORED):
            return torch.device("cpu")
        pipeline = self._opened()  # (before the first step: see SmartInfinityStage3._opened)
        sg = self.grad_position[self.get_param_id(param)][0]
        spec = pipeline.device_of(sg)
        if pipeline.resident(sg) and getattr(spec, "kind", None) == "cuda" and spec.memory == "gpu":
            return torch.device("cuda", spec.ordinal())
        return torch.device("cpu")
