"""``smartinf.optim``'s trigger for updates started during backward (``ParamHooks``): a
post-accumulate-grad hook per param says when a sub-group's gradient is final, and starts
its update through the step's ``Speculation``; under DDP, its averaged gradients do
(``averaged``, told by ``optim/ddp.py``)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from smartinf import defaults
from smartinf.optim.sharding import local
from smartinf.step.speculation import Speculation

logger = logging.getLogger("smartinf")


class ParamHooks:
    """``smartinf.optim``'s trigger: a post-accumulate-grad hook per param; a sub-group's
    gradient is final when each of its params has been accumulated as many times as in the
    last step (gradient accumulation), and an update is stale if one is accumulated again, or
    if its gradient is replaced (``is``) or its bits change (the digest) before
    ``step()``.

    ``send(sg, grad, scale, hyper, out)`` starts an update and returns its future;
    ``hyper_of(sg)`` gives a sub-group's current hyper-parameters; ``gather(sg, grads)`` its
    flat gradient from {id(param): grad}. Only for GPU params (``defaults.speculate_on_cpu``:
    a backward on the CPU holds the cores). Its params come out into buffers of this class (and
    GPU params' gradients go through host buffers): one copy of the params of the sub-groups
    no GPU updates, allocated when they are registered."""

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
        # Under DDP (optim/ddp.py): updates start from each bucket's averaged gradients, which
        # it hands to ``averaged``, not from the local ones accumulated here
        self.ddp: Callable[[], bool] = lambda: False
        self._averaged: dict[int, torch.Tensor] = {}  # id(param) -> its averaged gradient
        # Before a gradient is written or an update starts: the last step done (its tail;
        # set before ``register``, which then hooks each param's gradient for it)
        self.before: Optional[Callable[[], None]] = None
        # Whether a sub-group's states hold an edit not applied yet (``opt.state``): its update
        # waits for step(), which applies the edit first, as torch's next step sees it
        self.edited: Callable[[Any], bool] = lambda sg: False

    def register(self, plan: Sequence[Any]) -> None:
        """Hooks for the params of ``plan``'s sub-groups, and their buffers."""
        hooked = set(self._subgroups_of)
        for sg in plan:
            params = list({id(s.param): s.param for s in sg.slices}.values())
            self._params[sg.id] = params
            for p in params:
                self._subgroups_of.setdefault(id(p), []).append(sg)
            if self.speculation.pipeline.gpu_of(sg.id) is not None:
                continue  # (updated at step(), where its gradient is: no buffers, see _start)
            pin = sg.device.type == "cuda"
            self._out[sg.id] = torch.empty(sg.numel, dtype=sg.dtype, pin_memory=pin)
            if pin:
                self._grad_host[sg.id] = torch.empty(sg.numel, dtype=sg.dtype, pin_memory=True)
        for sg in plan:
            for p in self._params[sg.id]:
                if id(p) not in hooked and p.requires_grad:
                    hooked.add(id(p))
                    if self.before is not None:
                        self._hooks.append(p.register_hook(self._gradient))
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def subgroups(self) -> list[int]:
        """The ids of the sub-groups hooked."""
        return list(self._params)

    def end_step(self) -> None:
        """At ``step()``: the accumulations of this step are what the next one expects."""
        with self._lock:
            if self._seen:
                self._expected = max(self._seen.values())
            self._seen = {}
            self._stale = set()
            self._averaged = {}

    # The hooks run in autograd's engine, inside torch.compile's frame where a compiled
    # function calls backward: kept out of its graphs, as the step is.
    @torch.compiler.disable
    def _gradient(self, grad: torch.Tensor) -> None:
        """A gradient computed, before it is accumulated into ``.grad`` (maybe in place)."""
        self.before()

    @torch.compiler.disable
    def _accumulated(self, p: torch.Tensor) -> None:
        if self.before is not None:
            self.before()
        try:
            with self._lock:
                seen = self._seen[id(p)] = self._seen.get(id(p), 0) + 1
                for sg in self._subgroups_of.get(id(p), ()) if not self.ddp() else ():
                    if self.speculation.flying(sg.id):
                        self._stale.add(sg.id)  # its gradient grew after the update started
                    elif seen == self._expected and all(
                            self._seen.get(id(q), 0) == self._expected for q in self._params[sg.id]):
                        self._start(sg)
        except Exception as e:  # backward must go on: the step updates it instead
            logger.warning("an update could not start during backward (%s): updates wait for "
                           "step() from now on", e)
            self.speculation.enabled = False

    @torch.compiler.disable
    def averaged(self, pairs: list) -> None:
        """DDP's averaged gradients of a bucket's params: each sub-group whose params all have
        theirs starts its update from them (what DDP then puts into ``.grad``)."""
        if self.before is not None:
            self.before()
        with self._lock:
            ready = {}
            for p, g in pairs:
                if id(p) in self._subgroups_of:
                    self._averaged[id(p)] = g
                    ready.update((sg.id, sg) for sg in self._subgroups_of[id(p)])
            for sg in ready.values():
                if all(id(q) in self._averaged for q in self._params[sg.id]):
                    self._start(sg, self._averaged)

    def _start(self, sg: Any, given: Optional[dict] = None) -> None:
        if (sg.device.type != "cuda" and not self._on_cpu) or not self.speculation.may_start(sg.id) \
                or self.edited(sg):
            return
        if self.speculation.pipeline.gpu_of(sg.id) is not None:
            return  # updated on the GPU at step(), where its gradient is: milliseconds
        grads = []
        for p in self._params[sg.id]:
            # (an FSDP2 param's: its shard, reduce-scattered; DDP's: the ranks' average)
            g = local(p.grad) if given is None else given[id(p)].view(p.shape)
            if g is None or g.is_sparse:
                return
            grads.append((p, g))
        flat = self._gather(sg, {id(p): g.detach() for p, g in grads})
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
            # replaced; in place, the digests tell (not ``_version``: FSDP2's gradients of one
            # group share one, which every accumulation into any of them advances). DDP copies
            # its averaged ones into ``.grad``: only their bits can tell.
            if given is None and any(local(p.grad) is not g for p, g in grads):
                return "gradient changed"
            if given is not None and any(p.grad is None for p, _ in grads):
                return "gradient changed"
            return None
        by_param = {id(p): g for p, g in grads}
        read = None if given is None else [
            by_param[id(s.param)].detach().reshape(-1)[s.start:s.stop] for s in sg.slices]
        self.speculation.start(sg.id, hyper, out,
                               lambda scale: self._send(sg, flat, scale, hyper, out), ready, guard,
                               lambda: [local(s.param.grad).detach().reshape(-1)[s.start:s.stop]
                                        for s in sg.slices], read)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
