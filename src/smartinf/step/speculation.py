"""Updates started during backward (``overlap``): a sub-group's update starts as soon as its
gradient is final, with the step's global decisions predicted (the gradient scale of the last
step, so no clipping and no inf/NaN, and the param group's current hyper-parameters);
``step()`` keeps each one whose gradient and decisions turned out as predicted and retracts
the others (``Pipeline.retract``), which it then updates as usual: the same bits as a step
that waited for backward.

What a speculative update may change is what a retract undoes: the devices keep the states
it read (``Pipeline.retractable``), and its params go to buffers of the front-end, put into
the model by ``step()`` only. ``Speculation`` owns the updates in flight and their
validation; the front-ends say when a gradient is final: ``ParamHooks`` (``smartinf.optim``:
each param's post-accumulate-grad hook, ``optim/hooks.py``) and the DeepSpeed integration (its partitioned
gradients).

Whether a gradient is still the one an update read is told by a digest of it (``edits``'s,
exact for any change of bits), taken as the update starts and compared at ``take()``: not by
version counters alone, which in-place edits outside autograd do not advance
(``GradScaler.unscale_``, ``p.grad.data.mul_``, custom kernels, DeepSpeed's
``safe_set_full_grad``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence

import torch

from smartinf.step import edits

logger = logging.getLogger("smartinf")


@dataclass
class _Flight:
    """One sub-group's speculative update: its future (of the update's future, where it is
    launched once its inputs are on the host) and what it assumed."""
    launched: concurrent.futures.Future
    out: torch.Tensor
    scale: float
    hyper: dict
    guard: Optional[Callable[[], Optional[str]]]  # why it no longer holds, or None

    def future(self) -> Any:
        return self.launched.result()


@dataclass
class Counts:
    started: int = 0
    kept: int = 0
    retracted: int = 0
    reasons: dict = field(default_factory=dict)  # why updates were retracted: how many


class Speculation:
    """The speculative updates of one step: started by a front-end, kept or retracted at
    ``take()``."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self._lock = threading.Lock()
        self._scale: Optional[float] = None  # predicted; None: do not speculate
        self._flights: dict[int, _Flight] = {}
        self._launcher: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.enabled = True
        self.counts = Counts()
        # each flight's gradient as it is now, and its digest as the update read it
        self._gradients: dict[int, Callable[[], Sequence[torch.Tensor]]] = {}
        self._read = edits.ParamWatch(lambda sg: self._gradients[sg]())
        self.check_digests = True  # off only to time what they cost (bench/gpu_amp_step.py)

    def predict(self, scale: Optional[float]) -> None:
        """The gradient scale the next step is expected to use (None: do not speculate)."""
        self._scale = scale

    def may_start(self, sg: int) -> bool:
        return self.enabled and self._scale is not None and sg not in self._flights \
            and self.pipeline.retractable(sg)

    def start(self, sg: int, hyper: dict, out: torch.Tensor, launch: Callable[[float], Any],
              ready: Optional[torch.cuda.Event] = None,
              guard: Optional[Callable[[], Optional[str]]] = None,
              gradient: Optional[Callable[[], Sequence[torch.Tensor]]] = None,
              read: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Starts ``sg``'s update: ``launch(scale)`` returns its future, and is called now, or
        once ``ready`` (an event the host copies of its inputs were recorded after) has
        happened, on a thread of this class (backward goes on meanwhile). ``guard()`` is asked
        at ``take()`` whether the gradient is still what was sent (a reason if not);
        ``gradient()`` gives the gradient's flat parts as they are: digested now, before the
        update reads them (on a GPU, queued on the current stream ahead of its copy), and
        again at ``take()``; ``read``: the parts the update reads, where ``gradient()`` does not
        give them yet (DDP's averaged gradients, copied into ``.grad`` by the end of backward)."""
        scale = self._scale
        if gradient is not None and self.check_digests:
            self._gradients[sg] = gradient
            self._read.record_parts(sg, read) if read is not None else self._read.record(sg)
        launched = self.launch(lambda: launch(scale), ready)
        self._flights[sg] = _Flight(launched, out, scale, hyper, guard)
        self.counts.started += 1

    def launch(self, launch: Callable[[], Any],
               ready: Optional[torch.cuda.Event] = None) -> concurrent.futures.Future:
        """The future of ``launch()``: called now, or once ``ready`` has happened on a thread
        of this class, in the order asked (the pipeline runs updates in the order they come,
        so speculative ones and the rest of a step keep theirs)."""
        if ready is None and self._launcher is None:
            launched: concurrent.futures.Future = concurrent.futures.Future()
            try:
                launched.set_result(launch())
            except BaseException as e:
                launched.set_exception(e)
            return launched
        if self._launcher is None:
            self._launcher = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="smartinf-speculate")
        return self._launcher.submit(
            lambda: (ready.synchronize() if ready is not None else None, launch())[1])

    def flying(self, sg: int) -> bool:
        return sg in self._flights

    def unfinished(self) -> int:
        """Speculative updates not done yet (launched or waiting for their inputs)."""
        with self._lock:
            flights = list(self._flights.values())
        # one whose launch failed is done: take() raises its error
        return sum(not (f.launched.done() and (f.launched.exception() is not None
                                               or f.launched.result().done())) for f in flights)

    def drop(self, subgroups: Collection[int], reason: str = "params edited") -> None:
        """Retracts the updates of ``subgroups`` now: the caller edited their params (or
        states: ``reason``) since the last step, and they started from the stored ones."""
        with self._lock:
            flights = {sg: self._flights.pop(sg) for sg in subgroups if sg in self._flights}
            for sg in flights:
                self._gradients.pop(sg, None)
        for sg, f in flights.items():
            f.future()  # launched (its inputs on the host), so it can be retracted
            self.pipeline.retract(sg)
            self.counts.retracted += 1
            self.counts.reasons[reason] = self.counts.reasons.get(reason, 0) + 1

    def take(self, scale: Optional[float], hyper_of: Callable[[int], dict],
             later: Optional[Callable[[int, concurrent.futures.Future], None]] = None
             ) -> dict[int, torch.Tensor]:
        """At ``step()``, with the step's true gradient scale (None: skipped) and each
        sub-group's hyper-parameters: the ``out`` buffer of every speculative update that
        holds, by sub-group (done; or, with ``later``, handed to ``later(sg, launched)``
        as it is, to be waited for there); the others are retracted."""
        with self._lock:
            flights, self._flights = self._flights, {}
        kept: dict[int, torch.Tensor] = {}
        error: Optional[BaseException] = None
        reasons = {sg: self._why_not(f, scale, hyper_of(sg)) for sg, f in flights.items()}
        digested = [sg for sg, reason in reasons.items() if reason is None and sg in self._gradients]
        for sg in self._read.changed(digested) if digested else ():  # one sync per GPU
            reasons[sg] = "gradient changed"
        self._gradients = {}
        for sg, f in flights.items():
            reason = reasons[sg]
            try:
                if reason is None:
                    if later is None:
                        f.future().wait()
                    else:
                        later(sg, f.launched)
                    kept[sg] = f.out
                    self.counts.kept += 1
                    continue
                f.future()  # launched (its inputs on the host), so it can be retracted
                self.pipeline.retract(sg)
            except BaseException as e:  # the rest are still waited for or retracted
                error = error or e
                continue
            self.counts.retracted += 1
            self.counts.reasons[reason] = self.counts.reasons.get(reason, 0) + 1
            if reason == "gradient changed" and self.enabled:
                self.enabled = False
                logger.warning(
                    "a gradient changed between backward and step() (edited in place, e.g. "
                    "clip_grad_norm_ or GradScaler.unscale_ -- pass max_grad_norm= and leave "
                    "unscaling to GradScaler.step, or step(grad_scale=) -- or replaced, e.g. "
                    "by DDP's all-reduce): the updates started during backward were redone, "
                    "and updates wait for step() from now on")
        if error is not None:
            raise error
        return kept

    @staticmethod
    def _why_not(f: _Flight, scale: Optional[float], hyper: dict) -> Optional[str]:
        if scale is None:
            return "step skipped"  # or the states read or written before it
        reason = f.guard() if f.guard is not None else None
        if reason is not None:
            return reason
        if scale != f.scale:
            return "gradient scale"
        if hyper != f.hyper:
            return "hyper-parameters"
        return None

    def cancel(self) -> None:
        """Retracts every speculative update (the states are read or written between
        backward and step(): the step will update those sub-groups itself)."""
        self.take(None, lambda sg: {})

    def close(self) -> None:
        if self._launcher is not None:
            self._launcher.shutdown()
