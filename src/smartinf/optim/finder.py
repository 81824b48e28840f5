"""``ForwardFinder``: a global forward pre-hook that looks at each module's forward for the
wrapper an optimizer's params train in (DDP, FSDP2's modules). It is made where the states
are laid out: when the optimizer is made, or by the first step, after that step's forward.
So it stays until a ``step()`` that follows a forward it looked at, not merely the next
``step()``: a hook the first step made, removed at that step's end, would see nothing."""
from __future__ import annotations

from typing import Any, Callable

import torch


class ForwardFinder:
    """``look(module)`` at each module's forward (before the module's own pre-hooks): whether
    that forward is one the finder was waiting for. ``step_ended()`` removes the hook once one
    was; ``stop()`` removes it now."""

    def __init__(self, look: Callable[[Any], bool]) -> None:
        self._look = look
        self._looked = False
        self._hook: Any = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward)

    def _pre_forward(self, module: Any, args: Any) -> None:
        if self._look(module):
            self._looked = True

    def step_ended(self) -> None:
        if self._looked:
            self.stop()

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
