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
each param's post-accumulate-grad hook) and the DeepSpeed integration (its partitioned
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

from . import defaults, edits

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
              gradient: Optional[Callable[[], Sequence[torch.Tensor]]] = None) -> None:
        """Starts ``sg``'s update: ``launch(scale)`` returns its future, and is called now, or
        once ``ready`` (an event the host copies of its inputs were recorded after) has
        happened, on a thread of this class (backward goes on meanwhile). ``guard()`` is asked
        at ``take()`` whether the gradient is still what was sent (a reason if not);
        ``gradient()`` gives the gradient's flat parts as they are: digested now, before the
        update reads them (on a GPU, queued on the current stream ahead of its copy), and
        again at ``take()``."""
        scale = self._scale
        if gradient is not None and self.check_digests:
            self._gradients[sg] = gradient
            self._read.record(sg)
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

    def drop(self, subgroups: Collection[int]) -> None:
        """Retracts the updates of ``subgroups`` now: the caller edited their params since
        the last step, and they started from the stored masters."""
        with self._lock:
            flights = {sg: self._flights.pop(sg) for sg in subgroups if sg in self._flights}
            for sg in flights:
                self._gradients.pop(sg, None)
        for sg, f in flights.items():
            f.future()  # launched (its inputs on the host), so it can be retracted
            self.pipeline.retract(sg)
            self.counts.retracted += 1
            self.counts.reasons["params edited"] = self.counts.reasons.get("params edited", 0) + 1

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


class ParamHooks:
    """``smartinf.optim``'s trigger: a post-accumulate-grad hook per param; a sub-group's
    gradient is final when each of its params has been accumulated as many times as in the
    last step (gradient accumulation), and an update is stale if one is accumulated again, or
    if its gradient is replaced (``is``, ``_version``) or its bits change (the digest) before
    ``step()``.

    ``send(sg, grad, scale, hyper, out)`` starts an update and returns its future;
    ``hyper_of(sg)`` gives a sub-group's current hyper-parameters; ``gather(sg, grads)`` its
    flat gradient from {id(param): grad}. Only for GPU params (``defaults.speculate_on_cpu``:
    a backward on the CPU holds the cores). Its params come out into buffers of this class (and
    GPU params' gradients go through host buffers): one copy of the params, allocated when
    they are registered."""

    def __init__(self, speculation: Speculation, send: Callable, hyper_of: Callable,
                 gather: Callable) -> None:
        self.speculation = speculation
        self._send = send
        self._hyper_of = hyper_of
        self._gather = gather
        self._lock = threading.Lock()
        self._subgroups_of: dict[int, list] = {}  # id(param) -> its sub-groups
        self._params: dict[int, list] = {}  # sub-group id -> its distinct params
        self._out: dict[int, torch.Tensor] = {}
        self._grad_host: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._seen: dict[int, int] = {}  # accumulations per param since the last step
        self._expected = 1  # accumulations per step, as in the last step
        self._stale: set[int] = set()  # sub-groups accumulated into after their update started
        self._on_cpu = defaults.speculate_on_cpu()  # else only gradients of GPU params

    def register(self, plan: Sequence[Any]) -> None:
        """Hooks for the params of ``plan``'s sub-groups, and their buffers."""
        hooked = set(self._subgroups_of)
        for sg in plan:
            params = list({id(s.param): s.param for s in sg.slices}.values())
            self._params[sg.id] = params
            for p in params:
                self._subgroups_of.setdefault(id(p), []).append(sg)
            pin = sg.device.type == "cuda"
            self._out[sg.id] = torch.empty(sg.numel, dtype=sg.dtype, pin_memory=pin)
            if pin:
                self._grad_host[sg.id] = torch.empty(sg.numel, dtype=sg.dtype, pin_memory=True)
        for sg in plan:
            for p in self._params[sg.id]:
                if id(p) not in hooked and p.requires_grad:
                    hooked.add(id(p))
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def end_step(self) -> None:
        """At ``step()``: the accumulations of this step are what the next one expects."""
        with self._lock:
            if self._seen:
                self._expected = max(self._seen.values())
            self._seen = {}
            self._stale = set()

    def _accumulated(self, p: torch.Tensor) -> None:
        try:
            with self._lock:
                seen = self._seen[id(p)] = self._seen.get(id(p), 0) + 1
                for sg in self._subgroups_of.get(id(p), ()):
                    if self.speculation.flying(sg.id):
                        self._stale.add(sg.id)  # its gradient grew after the update started
                    elif seen == self._expected and all(
                            self._seen.get(id(q), 0) == self._expected for q in self._params[sg.id]):
                        self._start(sg)
        except Exception as e:  # backward must go on: the step updates it instead
            logger.warning("an update could not start during backward (%s): updates wait for "
                           "step() from now on", e)
            self.speculation.enabled = False

    def _start(self, sg: Any) -> None:
        if (sg.device.type != "cuda" and not self._on_cpu) or not self.speculation.may_start(sg.id):
            return
        if self.speculation.pipeline.gpu_of(sg.id) is not None:
            return  # updated on the GPU at step(), where its gradient is: milliseconds
        grads = []
        for p in self._params[sg.id]:
            g = p.grad
            if g is None or g.is_sparse:
                return
            grads.append((p, g, g._version))
        flat = self._gather(sg, {id(p): g.detach() for p, g, _ in grads})
        ready = None
        if flat.is_cuda:
            host = self._grad_host[sg.id]
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event(blocking=True)  # its waiter sleeps: the cores are the update's
            ready.record()  # the launch waits for it, not backward
            flat = host
        out, hyper = self._out[sg.id], self._hyper_of(sg)

        def guard() -> Optional[str]:
            if sg.id in self._stale:
                return "accumulated again"
            if any(p.grad is not g or g._version != version for p, g, version in grads):
                return "gradient changed"
            return None
        self.speculation.start(sg.id, hyper, out,
                               lambda scale: self._send(sg, flat, scale, hyper, out), ready, guard,
                               lambda: [s.param.grad.detach().reshape(-1)[s.start:s.stop]
                                        for s in sg.slices])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
