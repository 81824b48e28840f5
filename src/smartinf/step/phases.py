"""Where a step's host time went (``Phases``): the seconds between marks, as the front-ends
report them (``last_step_phases``), and under torch.profiler a marker at each (``smartinf.<phase>``
where the phase ends), so that a timeline shows which phase a wait fell in."""
from __future__ import annotations

import time

import torch


class Phases:
    """Host seconds between marks, each named by what ran since the last: no synchronize
    added, so a phase that waits for the GPU shows as long."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name + "_s"] = now - self._last
        self._last = now
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            with torch.profiler.record_function(f"smartinf.{name}"):
                pass
