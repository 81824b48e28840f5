"""Where a step's host time went (``Phases``): the seconds between marks, as the front-ends
report them (``last_step_phases``)."""
from __future__ import annotations

import time


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
