"""The step of a front-end (``smartinf.optim``, the DeepSpeed integration), shared: the
update rule read from a param group (and the one the devices store, common to all groups),
and each sub-group's gradient staged (or top-k compressed) on the host into the pipeline,
N + 1 sub-groups in flight with N devices, the updated params back from the host buffers."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from smartinf.pipeline.compress import Compressed, TopK
from smartinf.pipeline.pipeline import Pipeline
from smartinf.step.staging import Staging, depth_for, pipelined

TRAFFIC = ("host_to_device", "device_to_host", "storage_read", "storage_write", "step")


def rule_for(rule_class: type, group: dict) -> Any:
    """The update rule with a param group's current hyper-parameters (read every step)."""
    fields = {f: group[f] for f in rule_class.__dataclass_fields__ if f in group}
    fields = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    if "betas" in fields:
        fields["betas"] = tuple(float(b) for b in fields["betas"])
    return rule_class(**fields)


def stored_rule(rules: Sequence[Any]) -> Any:
    """The rule the devices are opened with, given param groups' rules: the first one.
    What fixes the states stored for every sub-group, the rule's arrays (``name``: AMSGrad's
    fourth) and their initial value (Adagrad's ``initial_accumulator_value``), cannot differ
    between groups, nor change later (``Pipeline.update`` refuses another rule)."""
    first = rules[0]
    for rule in rules[1:]:
        if rule.name != first.name:
            raise ValueError(f"amsgrad differs between param groups ({first.name} and "
                             f"{rule.name}): it fixes the states kept on the devices, so it is "
                             f"one for all groups")
        if rule.initial_state != first.initial_state:
            raise ValueError(f"param groups differ in initial_accumulator_value "
                             f"({first.initial_state} and {rule.initial_state}): the states on "
                             f"the devices start from one value for all groups")
    return first


def overrides(rule: Any) -> dict:
    """A rule's hyper-parameters as ``Pipeline.update`` keyword overrides."""
    return {f: getattr(rule, f) for f in rule.__dataclass_fields__}


class Driver:
    """A pipeline, its host staging (sub-groups of up to ``size`` params) and the optional
    top-k compression, driving one step's sub-groups."""

    def __init__(self, pipeline: Pipeline, size: int, compress: Optional[TopK] = None) -> None:
        self.pipeline = pipeline
        self.compress = compress
        self.staging = Staging(size, depth_for(len(pipeline.devices)))
        # Per staging buffer: params out in a GPU's memory, for sub-groups updated on that
        # GPU (made at first use, kept), and which out the last send used.
        self._gpu_outs: dict[tuple[int, int], torch.Tensor] = {}
        self._outs: dict[int, torch.Tensor] = {}
        self._logging = False  # send logs the gradient only (``log``)

    def grow(self, size: int) -> None:
        """Staging for sub-groups of ``size`` params (asked for by the user: add_param_group)."""
        if size > self.staging.size:
            self.staging = Staging(size, self.staging.depth)
            self._gpu_outs.clear()

    def _gpu_out(self, buffer: int, device: torch.device, dtype: torch.dtype,
                 numel: int) -> torch.Tensor:
        """Buffer ``buffer``'s params out in ``device``'s memory: a sub-group of the staging's
        size in ``dtype`` (bf16 params take half of fp32's), grown for a wider dtype."""
        key = (buffer, device.index)
        held = self._gpu_outs.get(key)
        if held is None or held.numel() < numel * dtype.itemsize:
            held = self._gpu_outs[key] = torch.empty(self.staging.size * dtype.itemsize,
                                                     dtype=torch.uint8, device=device)
        return held[:numel * dtype.itemsize].view(dtype)

    def send(self, sg: int, grad: torch.Tensor, buffer: int, scale: float, hyper: dict,
             out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
             params: Optional[torch.Tensor] = None, speculative: bool = False) -> Any:
        """Starts the update of sub-group ``sg`` from its flat gradient (on its own device):
        compressed, passed as it is (a contiguous CPU tensor, or one in the memory of the GPU
        that updates the sub-group), or copied into staging. The params come out into ``out``
        (a CPU buffer) or into staging (see ``out``), in that GPU's memory where the gradient
        is there. With a split master ``params`` are the sub-group's current params (flat, on
        their device), sent in with the gradient through the same buffer. ``speculative``:
        see ``Pipeline.update``."""
        if isinstance(grad, list):  # parts, read and written where they lie (takes_parts)
            self._outs.pop(buffer, None)
            return self.pipeline.update(sg, grad, out, grad_scale=scale, speculative=speculative,
                                        log_only=self._logging, **hyper)
        gpu = self.pipeline.gpu_of(sg)
        on_its_gpu = grad.is_cuda and grad.device.index == gpu
        if self.compress is not None:
            c = self.compress.compress(grad, key=sg)
            g: Any = Compressed(c.indices.to("cpu", non_blocking=True),
                                c.values.to("cpu", non_blocking=True), c.numel)
        elif (grad.is_cpu or on_its_gpu) and grad.is_contiguous():
            g = grad
        else:
            g = self.staging.grad(buffer, grad.dtype, grad.numel())
            g.copy_(grad, non_blocking=True)
        if out is None and on_its_gpu:  # params never leave the GPU
            out = self._gpu_out(buffer, grad.device, out_dtype or grad.dtype, grad.numel())
        if out is None:
            out = self.staging.out(buffer, out_dtype or grad.dtype, grad.numel())
        self._outs[buffer] = out
        if params is not None and params.data_ptr() != out.data_ptr():
            out.copy_(params, non_blocking=True)
        if (grad.is_cuda or (params is not None and params.is_cuda)) and \
                not (getattr(g, "is_cuda", False) or out.is_cuda):  # (else update() orders them)
            device = grad.device if grad.is_cuda else params.device
            torch.cuda.current_stream(device).synchronize()  # the host copies landed
        return self.pipeline.update(sg, g, out, grad_scale=scale, speculative=speculative,
                                    log_only=self._logging, **hyper)

    def host_arrays(self, count: int, numel: int) -> list[torch.Tensor]:
        """``count`` distinct fp32 staging buffers of ``numel`` (states read between steps:
        no memory beyond the staging's)."""
        views = [f(i, torch.float32, numel) for i in range(self.staging.depth)
                 for f in (self.staging.grad, self.staging.out)]
        if count > len(views):
            raise ValueError(f"{count} arrays asked of {len(views)} staging buffers")
        return views[:count]

    def out(self, buffer: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The updated params of the sub-group sent with ``buffer`` (once its future is done)."""
        sent = self._outs.get(buffer)
        if sent is not None and sent.dtype == dtype and sent.numel() == numel:
            return sent
        return self.staging.out(buffer, dtype, numel)

    def run(self, items: Sequence[Any], send: Callable[[Any, int], Any],
            finish: Callable[[Any, Any, int], None]) -> None:
        """``pipelined`` with this staging's depth: every device has a sub-group in flight."""
        pipelined(items, send, finish, self.staging.depth)

    def log(self, items: Sequence[Any], send: Callable[[Any, int], Any]) -> None:
        """``items``' gradients logged, as ``send`` stages them, before the step's first
        update (``copies="log"``: ``Pipeline.update(log_only=True)``)."""
        self._logging = True
        try:
            pipelined(items, send, lambda item, future, buffer: future.wait(), self.staging.depth)
        finally:
            self._logging = False

    def traffic(self) -> dict[str, float]:
        """Bytes moved so far per link (host_to_device, device_to_host, storage_read,
        storage_write) and the steps committed."""
        s = self.pipeline.stats
        return {k: s.get(k, 0.0) for k in TRAFFIC}
