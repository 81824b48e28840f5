"""``smartinf.optim``'s step finished while the next forward runs (``BackgroundStep``), as
DeepSpeed's tail finishes it (``step/tail.py``).

``step()`` decides everything on the caller's thread (edits, inf/NaN, the norm and clipping,
hyper-parameters, which updates started during backward hold) and hands the same calls with
the same inputs to a thread of their own; it returns. Until a sub-group's params are put
into the model, its params and their gradients are *pending*: their class is swapped for a
subclass whose ``__torch_function__`` first waits for their sub-groups (any op: the
forward's, ``.data``, ``state_dict``, an EMA's read, an edit, ``torch.save``; not metadata
such as ``.shape`` or ``.grad``), and the swap is undone as each one lands. What no op on
the param itself can see waits explicitly: FSDP2's all-gathers (which copy from the shard's
storage) wait for their group's sub-groups, the next backward's first gradient, a
``zero_grad`` that zeroes in place, anything that reads or writes the states (``settle``) and
a compiled module's forward wait for the whole step; once torch.compile has made a graph (its
code reads the params' storage), the step stays in ``step()``. The bits are those of a step that waited: the same updates, only
later; nothing reads a param before its update put it, nor writes a gradient an update still
reads.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._pytree import tree_leaves

from smartinf.optim.finder import ForwardFinder

_METADATA_PROPERTIES = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad",
                        "grad_fn", "_version", "ndim", "is_cuda", "is_cpu", "layout",
                        "is_sparse", "is_meta", "is_quantized", "itemsize", "nbytes", "names",
                        "is_nested", "output_nr", "_post_accumulate_grad_hooks", "_backward_hooks")
_METADATA_METHODS = ("size", "dim", "numel", "stride", "storage_offset", "data_ptr",
                     "element_size", "is_contiguous", "is_floating_point", "is_complex",
                     "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
                     "retain_grad", "get_device", "__len__", "_is_view", "is_pinned")


def _metadata() -> frozenset:
    """The torch functions that read no values of a tensor (its getters, as
    ``__torch_function__`` is handed them, and methods)."""
    found: list = []
    for name in _METADATA_PROPERTIES:
        d = getattr(torch._C.TensorBase, name, None) or getattr(torch.Tensor, name, None)
        if d is not None and hasattr(d, "__get__"):
            found.append(d.__get__)
            if hasattr(d, "__set__") and name in ("grad", "requires_grad"):
                found.append(d.__set__)
    for name in _METADATA_METHODS:
        for owner in (torch.Tensor, torch._C.TensorBase):
            if name in vars(owner):
                found.append(getattr(owner, name))
    return frozenset(found)


_READS_NO_VALUES = _metadata()
_PENDING: dict[int, Callable[[], None]] = {}  # id(tensor) -> waits for its sub-groups
_CLASSES: dict[type, type] = {}  # a tensor's class -> its pending subclass
_BASES: dict[type, type] = {}  # pending subclass -> the class it stands for


def _torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """A pending class's: an op that reads values waits for the pending tensors among its
    arguments (their classes restored) and runs as it would have; metadata runs at once."""
    kwargs = kwargs or {}
    if func not in _READS_NO_VALUES:
        for t in tree_leaves((args, kwargs)):
            if type(t) in _BASES:
                waiter = _PENDING.get(id(t))
                if waiter is not None:
                    waiter()
                if type(t) in _BASES:  # landed, or a copy of a pending one (deepcopy)
                    t.__class__ = _BASES[type(t)]
        return func(*args, **kwargs)
    base = _BASES[cls]
    types = tuple(_BASES.get(t, t) for t in types)
    return base.__torch_function__(func, types, args, kwargs)


# A DTensor's shard is read past any torch function (its attribute, and autograd Functions)
_SHARD_READS = frozenset({"_local_tensor", "to_local", "full_tensor", "redistribute"})
_thread = threading.local()  # .stepping: on a step's own thread (its reads never wait); .stream


def _pending_class(cls: type) -> type:
    if cls not in _CLASSES:
        body: dict = {"__torch_function__": classmethod(_torch_function), "__module__": __name__}
        if hasattr(cls, "to_local"):
            def __getattribute__(self: Any, name: str, _get: Any = cls.__getattribute__) -> Any:
                if name in _SHARD_READS and not getattr(_thread, "stepping", False):
                    waiter = _PENDING.get(id(self))
                    if waiter is not None:
                        waiter()
                return _get(self, name)
            body["__getattribute__"] = __getattribute__
        sub = type(f"Pending{cls.__name__}", (cls,), body)
        _CLASSES[cls], _BASES[sub] = sub, cls
    return _CLASSES[cls]


def _compiled() -> bool:
    """Whether torch.compile has made a graph in this process: compiled code takes the params
    as inputs and reads their storage, past ``__torch_function__``, so a step it may run
    beside finishes in ``step()``."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and utils.counters["stats"]["unique_graphs"] > 0


def _is_compiled(module: Any) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None or \
        type(module).__name__ == "OptimizedModule"


class BackgroundStep:
    """The step of one ``smartinf.optim`` optimizer finishing on a thread of its own.

    ``start(guarded, run)``: ``guarded`` maps each sub-group whose params the step puts to
    the tensors to hold (its params and their gradients); ``run()`` is the step (on a CUDA
    stream of its own, after what the caller queued), and ``landed(sg)``, called by it as
    each sub-group's params are put, lets that sub-group's tensors go once that stream has
    done its puts."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._events: dict[int, threading.Event] = {}
        self._holds: dict[int, list] = {}  # sg -> its tensors
        self._subgroups_of: dict[int, list] = {}  # id(tensor) -> its sub-groups not landed
        self._lock = threading.Lock()
        self._unsharded: set[int] = set()  # FSDP2 param groups whose all-gathers wait
        self._finder: Optional[ForwardFinder] = None  # finds FSDP2's modules (find_fsdp)
        self._compile_guard: Any = None  # while a step runs: compiled modules wait for it
        # FSDP2: the sub-groups in the order the last forward's all-gathers asked for them
        # (the root's group, which holds the output layer, first: ``ordered``)
        self._needed: dict[int, None] = {}  # (ordered: a set in the order first asked)
        self._streams: dict[Any, Any] = {}  # the step's own CUDA stream, per device
        self.deferred = 0  # sub-groups landed after step() returned
        self.waits = 0  # ops that waited for one
        self.wait_seconds = 0.0
        self.drain_seconds = 0.0  # waits for the whole step

    def ordered(self, subgroups: list[int]) -> list[int]:
        """``subgroups`` in the order the next forward needs them: as the last forward's FSDP2
        all-gathers asked for them, the others after, in their own order. (FSDP2's root group
        holds the embedding and the output layer, the last sub-groups of the model's params:
        updated in plan order, the forward's first all-gather waited for the whole step.)"""
        rank = {sg: i for i, sg in enumerate(self._needed)}
        return sorted(subgroups, key=lambda sg: rank.get(sg, len(rank)))

    def start(self, guarded: dict[int, list], run: Callable[[], None]) -> None:
        self._needed = {}
        on_gpu = next((t.device for ts in guarded.values() for t in ts if t.is_cuda), None)
        if _compiled():  # (compiled code reads the params' storage past any torch function)
            run()
            return
        try:
            for sg, tensors in guarded.items():
                self._events[sg] = threading.Event()
                self._holds[sg] = tensors
                for t in tensors:
                    self._subgroups_of.setdefault(id(t), []).append(sg)
                    if id(t) not in _PENDING:
                        t.__class__ = _pending_class(type(t))
                        _PENDING[id(t)] = partial(self._wait_for, id(t))
        except TypeError:  # a class that cannot be swapped: the step finishes now
            self._release(dict(self._holds))
            self._events.clear()
            run()
            return
        stream = self._stream_of_its_own(on_gpu) if on_gpu is not None else None
        # (not a daemon: an interpreter exiting waits for the step to commit)
        self._thread = threading.Thread(target=self._run, args=(run, stream), name="smartinf-step")
        # a module compiled since (torch.compile(model), model.compile()) waits for it all
        self._compile_guard = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: self.drain() if _is_compiled(module) else None)
        self._thread.start()

    def _stream_of_its_own(self, device: torch.device) -> Any:
        """The step's CUDA stream on ``device``, after what the caller's queued there (the
        gradients, the clipping's scale): on the forward's, each update's wait for its
        inputs (``Pipeline.update``) would also wait for the forward's kernels queued so
        far, and the forward would wait for the next update: the two in lockstep."""
        caller = torch.cuda.current_stream(device)
        stream = self._streams.get(caller.device)
        if stream is None:
            stream = self._streams[caller.device] = torch.cuda.Stream(caller.device)
        stream.wait_stream(caller)
        return stream

    def _wait_for(self, ident: int) -> None:
        self.wait(list(self._subgroups_of.get(ident, ())))

    def _run(self, run: Callable[[], None], stream: Any) -> None:
        _thread.stepping = True
        _thread.stream = stream
        try:
            # (this thread's ops never wait for what it puts; each put is on the GPU before
            # its sub-group lands, so the forward's ops on any stream read it)
            with torch._C.DisableTorchFunctionSubclass(), torch.no_grad(), \
                    (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                run()
        except BaseException as e:  # raised by the next wait or drain, on the caller's thread
            self._error = e
        finally:
            if stream is not None:
                stream.synchronize()  # (a failed step's puts, before anything reads them)
            with self._lock:
                self._release(dict(self._holds))
                for event in self._events.values():
                    event.set()

    def landed(self, sg: int) -> None:
        """Sub-group ``sg``'s params are in the model."""
        stream = getattr(_thread, "stream", None)  # (on the step's thread: its puts alone)
        if stream is not None:
            stream.synchronize()
        with self._lock:
            held = self._holds.get(sg)
            if held is None:
                return
            self._release({sg: held})
            self.deferred += 1
            self._events[sg].set()

    def _release(self, holds: dict) -> None:
        for sg in list(holds):
            for t in self._holds.pop(sg, ()):
                left = self._subgroups_of.get(id(t), [])
                if sg in left:
                    left.remove(sg)
                if not left:
                    self._subgroups_of.pop(id(t), None)
                    _PENDING.pop(id(t), None)
                    if type(t) in _BASES:
                        t.__class__ = _BASES[type(t)]

    def wait(self, subgroups: Iterable[int]) -> None:
        """Until ``subgroups``' params are put (the step's error raised, if it failed)."""
        events = [self._events[sg] for sg in subgroups if sg in self._events]
        if events and not all(e.is_set() for e in events):
            self.waits += 1
            start = time.perf_counter()
            for e in events:
                e.wait()
            self.wait_seconds += time.perf_counter() - start
        self._raise()

    def drain(self) -> None:
        """Until the whole step is done and committed (its error raised, if it failed)."""
        thread = self._thread
        if thread is not None:
            start = time.perf_counter()
            thread.join()
            self.drain_seconds += time.perf_counter() - start
            self._thread = None
            self._events.clear()
            self._compile_guard.remove()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- FSDP2: all-gathers copy from the shards' storage, under any op on the params ---------
    def find_fsdp(self, subgroups_of: Callable[[list], list]) -> None:
        """Until a step after a forward that found them (``step_ended``): each FSDP2 module
        that runs a forward has its param groups' all-gathers wait (``wait_in_unshards``).
        (Global forward pre-hooks run before a module's own: before FSDP2's all-gather of the
        first forward. States laid out by the first step are laid out after its forward.)"""
        def found(module: Any) -> bool:
            if not hasattr(module, "_get_fsdp_state"):
                return False
            self.wait_in_unshards(module, subgroups_of)
            return True
        self._finder = ForwardFinder(found)

    def step_ended(self) -> None:
        if self._finder is not None:
            self._finder.step_ended()

    def stop_finding(self) -> None:
        if self._finder is not None:
            self._finder.stop()

    def wait_in_unshards(self, module: Any, subgroups_of: Callable[[list], list]) -> None:
        """Each FSDP2 param group in ``module`` (an ``FSDPModule``) waits, before it all-gathers
        (forward, prefetch, backward, ``unshard()``), for the sub-groups of its params."""
        for m in module.modules():
            get = getattr(m, "_get_fsdp_state", None)
            if get is None:
                continue
            state = get()
            groups = getattr(state, "_fsdp_param_groups", None) or \
                [getattr(state, "_fsdp_param_group", None)]
            for group in groups:
                if group is None or id(group) in self._unsharded:
                    continue
                self._unsharded.add(id(group))
                params = [fp.sharded_param for fp in getattr(group, "fsdp_params", ())]
                group.unshard = self._waiting(group.unshard, params, subgroups_of)

    def _waiting(self, unshard: Callable, params: list, subgroups_of: Callable[[list], list]) -> Callable:
        mine: list = []  # (their sub-groups: known once the states are laid out)

        def wait_then_unshard(*args: Any, **kwargs: Any) -> Any:
            if self._thread is not None:
                if not mine:
                    mine.extend(subgroups_of(params) or [None])
                self._needed.update(dict.fromkeys(sg for sg in mine if sg is not None))
                self.wait(mine)
            return unshard(*args, **kwargs)
        return wait_then_unshard


class InBackground:
    """Mixed into ``_StorageOptimizer`` (its ``_tail``, ``_session``): what a step finishing in
    the background holds, each sub-group let go as it lands, and what waits for it."""

    def _held(self, sg: Any) -> list[torch.Tensor]:
        """What a sub-group's update in the background puts or reads: its params and their
        gradients."""
        held = {id(s.param): s.param for s in sg.slices}
        held.update({id(s.param.grad): s.param.grad for s in sg.slices if s.param.grad is not None})
        return list(held.values())

    def _on_its_gpu(self, sg: int) -> bool:
        """Whether sub-group ``sg``'s update is a GPU's work on states in its own memory: kernels
        the next forward's queue behind anyway, where a thread of their own only adds its host
        work to the forward's. Measured on an H200 with the step on its own stream (GPT-2 XL,
        iterations 2-12): under FSDP2 0.264 s an iteration in step(), 0.316 s through the
        thread; under DDP 0.2986 s and 0.2982 s (the forward waits for what step() saved)."""
        device = self.pipeline.device_of(sg)
        return getattr(device, "kind", None) == "cuda" and device.memory == "gpu" and \
            self.pipeline.resident(sg)

    def _landed(self, sg: Any) -> None:
        if self._tail is not None:
            self._tail.landed(sg.id)  # (its params' uses go on: queued behind the put)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; gradients zeroed in place wait for the last step's updates that read them."""
        if not set_to_none and self._tail is not None:
            self._tail.drain()
        super().zero_grad(set_to_none)

    @property
    def overlap_stats(self) -> dict[str, float]:
        """With the step finished during the next forward, so far (DeepSpeed's names):
        ``deferred_updates`` (sub-groups put after ``step()`` returned), ``gather_waits`` (uses
        of a pending param, or all-gathers, that waited), ``gather_wait_s`` (their seconds) and
        ``drain_s`` (seconds the next backward, ``step()`` or a state read waited for the rest)."""
        tail = self._tail
        if tail is None:
            return {}
        return {"deferred_updates": tail.deferred, "gather_waits": tail.waits,
                "gather_wait_s": tail.wait_seconds, "drain_s": tail.drain_seconds}

    def settle(self) -> None:
        """The last step finished: its updates done and put into the model, committed (they
        finish while the next forward runs, each param's use waiting for its own). To time a
        step whole; nothing else needs it."""
        if self.pipeline is not None:
            self._session.settle()
