"""The steps a run took made durable when the interpreter exits without ``close()``: every open
pipeline, and each front-end that owns one first, closed by an ``atexit`` handler while the
interpreter still runs. ``Pipeline.__del__`` alone ran too late or never: a script of three
steps with ``commit_every=10`` that defined a ``logging.Handler`` subclass (tqdm's recipe)
kept its optimizer reachable past finalization and exited 0 with its directory at step 0
(issue 88).

At a normal end (the script's last line, ``sys.exit``) a front-end's own close runs
(``smartinf.optim``'s ``close()``: its step's tail drained, edits of the params taken as a step
would, the pipeline closed). Where an exception escapes the script, only its ``settle()``: the
steps that completed are kept, but params the failure may have left half-edited are not taken
as masters (and no rank waits in a collective for ranks that are gone). A process forked from
the one that registered closes nothing. A failure is logged (error) with the directories and
the step they stay at; the exit goes on. SIGTERM and SIGKILL run no ``atexit`` handler: what
they keep, and how to make SIGTERM end like a normal exit, is in docs/on-disk.md.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from typing import Any

logger = logging.getLogger("smartinf")

#: front-ends (their pipelines' owners) and pipelines open, in the order they registered:
#: the method a normal exit calls, and the process that registered them
_front_ends: "weakref.WeakKeyDictionary[Any, tuple[str, int]]" = weakref.WeakKeyDictionary()
_pipelines: "weakref.WeakKeyDictionary[Any, tuple[str, int]]" = weakref.WeakKeyDictionary()


def register_front_end(front_end: Any, on_normal_exit: str = "close") -> None:
    """``front_end`` (with ``pipeline`` and ``settle()``) finished at exit before any pipeline
    is closed: ``on_normal_exit`` (a method's name) at a normal end, ``settle`` where an
    exception escaped."""
    _register(_front_ends, front_end, on_normal_exit)


def register_pipeline(pipeline: Any) -> None:
    """``pipeline`` closed at exit (its committed steps made durable) if still open then."""
    _register(_pipelines, pipeline, "close")


def _register(table: weakref.WeakKeyDictionary, owner: Any, method: str) -> None:
    table[owner] = (method, os.getpid())
    # Registered again, so it is the last registered and runs first (atexit runs LIFO): before
    # ``step/ranks.py``'s ``leave_cleanly`` destroys the process group a close may still use.
    atexit.unregister(close_all)
    atexit.register(close_all)


def _exception_escaped() -> bool:
    """Whether the interpreter exits because an exception escaped the script (Python set
    ``sys.last_value`` when it printed it; ``sys.exit`` sets nothing)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def close_all() -> None:
    """Finishes every registered front-end, newest first, then closes every pipeline still
    open: the ``atexit`` handler."""
    escaped = _exception_escaped()
    for table in (_front_ends, _pipelines):
        for owner, (method, pid) in reversed(list(table.items())):
            table.pop(owner, None)
            pipeline = getattr(owner, "pipeline", owner) if table is _front_ends else owner
            if pid != os.getpid() or pipeline is None or pipeline.closed:
                continue
            _finish(getattr(owner, "settle" if escaped and table is _front_ends else method),
                    pipeline)


def _finish(call: Any, pipeline: Any) -> None:
    """``call()`` (a close or settle of ``pipeline`` or of its front-end); a failure logged."""
    directories = [d.path for d in pipeline.devices]
    try:
        durable, step = pipeline.durable_step_count, pipeline.step_count
        call()
    except Exception as e:  # (exiting: said, not raised; the next pipeline is still closed)
        from smartinf.pipeline.checkpoint import manifest_fields
        at = sorted({(manifest_fields(d) or {}).get("step", "?") for d in directories})
        logger.error("smartinf: at exit, the steps of %s could not be made durable (%s: %s): "
                     "the directories stay at step %s, their last durable commit",
                     ", ".join(directories), type(e).__name__, e, ", ".join(at))
        return
    if step > durable and pipeline.closed:  # (a settled one is closed with the pipelines)
        logger.info("smartinf: at exit, steps %d to %d made durable in %s (close() was not called)",
                    durable + 1, step, ", ".join(directories))
