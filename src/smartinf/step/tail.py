"""The end of a step finished while the next forward runs (``overlap``, DeepSpeed ZeRO-3).

When backward ends, the sub-groups whose updates did not start during it (or were retracted)
still need theirs. Instead of ``step()`` waiting for them, they are launched in the order the
next forward needs them (ZeRO-3 groups params in module order, so ascending sub-group index)
and ``step()`` returns; a param's gather waits for its own sub-group (``wait``), not for the
whole step. Nothing else may see the pipeline mid-step, so before the next backward writes
gradients, before states are read or written and before a checkpoint, the tail is drained
(``drain``): every update waited for, its params put into the model, the step committed.

The bits are those of a step that waited: the updates are the same calls with the same
inputs, only later; a gather reads a sub-group's params after its update put them.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Iterable, Optional


class StepTail:
    """The updates of one step still in flight after ``step()`` returned, by sub-group.

    ``finish(sg)`` puts a done sub-group's params into the model; ``commit()`` ends the
    pipeline's step; ``discard()`` undoes the step (an update failed)."""

    def __init__(self, finish: Callable[[int], None], commit: Callable[[], None],
                 discard: Callable[[], None]) -> None:
        self._finish = finish
        self._commit = commit
        self._discard = discard
        self._lock = threading.RLock()  # gathers may come from autograd's threads
        self._flights: dict[int, concurrent.futures.Future] = {}  # sg -> launched update
        self._open = False  # a step whose commit waits for the tail
        self.deferred = 0  # updates finished after step() returned
        self.waits = 0  # gathers that waited for one
        self.wait_seconds = 0.0
        self.drain_seconds = 0.0  # drains waiting for updates still in flight, and committing

    @property
    def open(self) -> bool:
        """Whether a step is still being finished (its commit not yet made)."""
        return self._open

    def begin(self) -> None:
        """``step()`` leaves its commit to ``drain``."""
        self._open = True

    def start(self, sg: int, launched: concurrent.futures.Future) -> None:
        """``launched``: the future of the update's future (launched once its inputs are on
        the host)."""
        with self._lock:
            self._flights[sg] = launched

    def wait(self, subgroups: Iterable[Optional[int]]) -> None:
        """Before params of ``subgroups`` are gathered: their updates done and put, in
        sub-group order. An update that failed fails the step (see ``drain``)."""
        if not self._flights:
            return
        with self._lock:
            mine = sorted(sg for sg in set(subgroups) if sg in self._flights)
            if not mine:
                return
            start = time.perf_counter()
            try:
                for sg in mine:
                    self._land(sg)
            except BaseException:
                self.abort()
                raise
            finally:
                self.waits += 1
                self.wait_seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Every update of the step done and put, then the step committed."""
        with self._lock:
            if not self._open:
                return
            start = time.perf_counter()
            try:
                for sg in sorted(self._flights):
                    self._land(sg)
            except BaseException:
                self.abort()
                raise
            self._open = False
            try:
                self._commit()
            finally:
                self.drain_seconds += time.perf_counter() - start

    def _land(self, sg: int) -> None:
        launched = self._flights[sg]
        launched.result().wait()
        self._finish(sg)
        del self._flights[sg]
        self.deferred += 1

    def abort(self) -> None:
        """The rest waited for (nothing may run on after), the step discarded."""
        for launched in self._flights.values():
            try:
                launched.result().wait()
            except BaseException:
                pass
        self._flights.clear()
        self._open = False
        self._discard()
