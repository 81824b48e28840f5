"""Where a training loop's Python stood still (``GilWatch``): a thread that wakes every
millisecond; a wake later than ``STALL`` means some thread held the GIL (or the loop's
process was descheduled) that long. The examples record, per step, the seconds so lost and
the longest stall's stacks, taken as the watch got the GIL back: the thread that held it
stands just past the call that held it."""
from __future__ import annotations

import sys
import threading
import time
import traceback

STALL = 0.02  # seconds: a wake this late is a stall (scheduling noise stays below)


class GilWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stalled = 0.0
        self._worst: tuple = (0.0, {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        while not self._stop.is_set():
            before = time.perf_counter()
            time.sleep(0.001)
            late = time.perf_counter() - before - 0.001
            if late < STALL:
                continue
            names.update({t.ident: t.name for t in threading.enumerate()})
            with self._lock:
                self._stalled += late
                if late > self._worst[0]:
                    stacks = {names.get(k, str(k)): "".join(traceback.format_stack(f, limit=6))
                              for k, f in sys._current_frames().items() if k != me}
                    self._worst = (late, stacks)

    def take(self) -> dict:
        """The stalls since the last ``take``: seconds in all, the longest, and its stacks."""
        with self._lock:
            out = {"gil_stall_s": self._stalled, "gil_stall_max_s": self._worst[0],
                   "gil_stall_stacks": self._worst[1]}
            self._stalled, self._worst = 0.0, (0.0, {})
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
