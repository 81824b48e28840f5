"""Updates started during backward under DDP (``DdpTrigger``): from DDP's averaged gradients.

DDP replaces each param's local gradient by the ranks' average at the end of backward, so an
update started from the local gradient (``ParamHooks``' post-accumulate-grad hook) would be
retracted at ``step()``. Here DDP's own communication hook reduces each bucket as DDP does
without one (each gradient times 1 / world size, then summed over the ranks) and, once the
bucket is averaged, hands its params' averaged gradients to ``ParamHooks``, which starts the
update of every sub-group whose params all have theirs: the bits DDP then copies into
``.grad``. DDP is found at the first forward that runs inside it (``ForwardFinder``, removed
then, or at the first ``step()`` after a forward where no DDP holds these params); a DDP with
a communication hook of its own keeps it, and the updates wait for ``step()``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from smartinf.optim.finder import ForwardFinder

logger = logging.getLogger("smartinf")


class DdpTrigger:
    """Hands ``hooks`` (``ParamHooks``) each bucket's (param, averaged gradient) pairs."""

    def __init__(self, params: list, hooks: Any) -> None:
        self._ours = {id(p) for p in params}
        self._hooks = hooks
        self.attached: Optional[Any] = None
        hooks.ddp = lambda: self.attached is not None
        self._finder = ForwardFinder(self._find) \
            if dist.is_available() and dist.is_initialized() else None

    def _find(self, module: Any) -> bool:
        """Any forward tells whether a DDP holds these params: inside one, it is active."""
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and any(id(p) in self._ours for p in ddp.module.parameters()):
            self.stop_finding()
            self._attach(ddp)
        return True

    def _attach(self, ddp: Any) -> None:
        pipeline = self._hooks.speculation.pipeline
        if all(pipeline.gpu_of(sg) is not None for sg in self._hooks.subgroups()):
            return  # every sub-group updated on its GPU at step(): DDP's own reduction stays
        try:
            ddp.register_comm_hook(None, self._reduce)
        except Exception as e:  # (DDP takes one hook: the user's stays)
            self._wait_for_step(f"DDP has a communication hook already ({e})")
            return
        self.attached = ddp

    def _wait_for_step(self, why: str) -> None:
        """Updates wait for ``step()`` from now on (said once)."""
        if self._hooks.speculation.enabled:
            logger.info("smartinf: %s: updates wait for step()", why)
        self._hooks.speculation.enabled = False

    def step_ended(self) -> None:
        """At ``step()``: no DDP holds these params if a forward ran since the hook was made."""
        if self._finder is not None:
            self._finder.step_ended()

    def stop_finding(self) -> None:
        if self._finder is not None:
            self._finder.stop()

    def _reduce(self, state, bucket):  # (DDP checks a hook's annotations: none given)
        group = self.attached.process_group
        buffer = bucket.buffer()
        buffer.mul_(1.0 / group.size())  # as DDP's reducer scales the gradients without a hook
        work = dist.all_reduce(buffer, group=group, async_op=True)

        def averaged(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()[0]
            try:
                self._hooks.averaged(list(zip(bucket.parameters(), bucket.gradients())))
            except Exception as e:  # backward must go on: the step updates them instead
                self._wait_for_step(f"an update could not start from DDP's averaged gradients ({e})")
            return reduced
        return work.get_future().then(averaged)
