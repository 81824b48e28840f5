"""The step protocol of a ``Pipeline``: ``update`` (a sub-group's gradient in, its params
out, as a future: ``UpdateFuture``), ``retract`` a speculative one, and the step ended:
``commit``, ``discard``, ``settle`` a background commit, ``with pipe.step():``."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
import torch

from smartinf.pipeline import buffers
from smartinf.pipeline.compress import Compressed
from smartinf.update_rules import UpdateRule

if TYPE_CHECKING:
    from smartinf.pipeline.pipeline import Pipeline


class ParamsChangedWarning(UserWarning):
    """With ``master="split"``: params came back other than the devices emitted them, so
    the changed ones were taken as the new fp32 masters (where a stored low half does not
    round back to its param)."""


class UpdateFuture:
    """Completion of one ``Pipeline.update``: done when every updated param is in ``out``.

    The gradient and ``out`` buffers must stay untouched until then; the future keeps
    them alive. Write-back of the states continues after it is done.
    """

    __slots__ = ("_native", "_buffers")

    def __init__(self, native: Any, keep_alive: tuple) -> None:
        self._native = native
        self._buffers = keep_alive

    def done(self) -> bool:
        return self._native.done()

    def wait(self) -> None:
        """Blocks until the params are out; raises the update's error, if any. Once waited
        for, the buffers are the caller's again: the future lets them go (a step's flat
        gradients would otherwise all be held until its commit, GPU memory included)."""
        self._native.wait()
        self._buffers = ()

    get = result = wait


class Steps:
    """Mixed into ``Pipeline`` (its ``_open``, ``_subgroup``, ``gpu_of``, ``_warn_foreign``)."""

    __slots__ = ()

    @property
    def step_count(self) -> int:
        """Steps committed (with ``commit_every`` > 1, durable or not)."""
        return self._open().step

    @property
    def durable_step_count(self) -> int:
        """Steps committed durably: what reopening the directories resumes at."""
        return self._open().durable_step

    @property
    def previous_step_count(self) -> int:
        """The durable step before ``durable_step_count`` that the directories still hold
        (their shadow copies), or ``durable_step_count`` where they hold none in common."""
        return self._open().previous_step

    def roll_back_to(self, step: int) -> None:
        """Before any sub-group is added: back to ``step``, the durable step or the one
        before it (``previous_step_count``), as other ranks are after a crash between their
        commits; another step is refused (ValueError) naming what the directories hold."""
        self._open().roll_back_to(step)

    @property
    def logs_gradients(self) -> bool:
        """Whether each step's gradients are logged before its first update (``copies="log"``:
        ``update(..., log_only=True)`` for every sub-group first)."""
        return self.settings.copies == "log"

    def seal_log(self) -> None:
        """The step's logged gradients made its complete input, on every device, before its
        first update (which does it otherwise): a front-end of several processes seals, then
        waits for the others, so that no process updates before all have sealed."""
        self._open().seal_logs()

    @property
    def logged_step_pending(self) -> bool:
        """After a reopen with ``defer_logged_step``: whether every device holds a sealed log
        of the step after its own (a crash left it unfinished)."""
        return self._open().logged_step_pending()

    def finish_logged_step(self) -> None:
        """Finishes the logged step from its log (``defer_logged_step``)."""
        self._open().finish_logged_step()

    def drop_logged_step(self) -> None:
        """Forgets the logged step (``defer_logged_step``): no process had updated in it."""
        self._open().drop_logged_step()

    @property
    def commit_pending(self) -> bool:
        """Whether a durable commit is being written in the background (``overlap``)."""
        return self._open().commit_pending

    def _warn_foreign(self, found: Optional[list] = None) -> None:
        if self._native is None or self.settings.master != "split":
            return
        found = self._native.take_foreign() if found is None else found
        if found:
            groups = sorted({sg for sg, _ in found})
            warnings.warn(ParamsChangedWarning(
                f"master='split': the bf16 params of sub-groups {groups} ({len(found)} chunks) "
                f"were not the ones the devices emitted (weights loaded or edited since?): the "
                f"changed params were taken as the new fp32 masters, the others' kept"),
                stacklevel=3)

    def update(self, sg: int, grad: Any, out: Any, *, grad_scale: float = 1.0,
               speculative: bool = False, log_only: bool = False, **overrides: Any) -> UpdateFuture:
        """Starts the update of sub-group ``sg``; returns a future done when ``out`` is.

        ``grad`` is the sub-group's gradient: a dense fp32/fp16/bf16 buffer, or a
        ``smartinf.pipeline.compress.Compressed`` (top-k int32 indices + fp16/bf16 values, on the
        CPU) that the device decompresses. Buffers are contiguous CPU numpy arrays or
        tensors. The gradient is multiplied by ``grad_scale`` (1/loss scale, times a
        clipping coefficient) before use. ``out`` receives the updated params
        (fp32/fp16/bf16; with ``master="split"`` bf16, holding the current params on entry).
        On a ``CudaDevice`` (``gpu_of(sg)``) ``grad`` and ``out`` may be CUDA tensors on its
        GPU: read and written there (a split master's params checksummed there too), nothing
        crosses PCIe (what the caller's current stream queued is waited for first). Where
        ``takes_parts(sg)``, ``grad`` and ``out`` may be lists of parts (a model's gradients
        and params where it holds them, in the sub-group's order: pairs of one size), read and
        written where they lie. Keyword ``overrides`` replace the optimizer's hyper-parameters
        for this update (``lr=``, ``weight_decay=``, ``betas=``, ``momentum=`` ...:
        schedulers, param groups). Each sub-group is updated at most once per step; the
        step becomes durable with ``commit()`` (or ``with pipe.step():``).
        ``speculative=True`` (where ``retractable(sg)``): the update may be taken back with
        ``retract(sg)`` before the step is committed (its gradient or the step's global
        decisions turned out other than assumed).
        ``log_only=True`` (``copies="log"``, ``logs_gradients``): the gradient and
        hyper-parameters are logged, nothing is updated (the future is done at once); every
        sub-group a step updates is logged so before the step's first update, and updated
        with the same gradient and hyper-parameters.
        """
        native = self._open()
        sg = self._subgroup(sg)
        numel = native.numel(sg)
        allowed = [self._param_dtype] if self._param_dtype is not None else \
            [buffers.F32, buffers.F16, buffers.BF16]
        gpu = self.gpu_of(sg)
        parts = None
        if isinstance(grad, (list, tuple)) and all(isinstance(g, torch.Tensor) for g in grad):
            # parts (takes_parts): no flat buffer either side
            if not native.takes_parts(sg):
                raise ValueError(f"sub-group {sg}'s update cannot take its gradient and params "
                                 f"in parts (a cpu device's fp32 states only, without a log): "
                                 f"pass one buffer each")
            g, o, parts = _caller_parts(numel, grad, out, allowed)
            index, nnz, keep, spans = None, 0, (g.owner, o.owner), []
        elif isinstance(grad, Compressed):
            o = buffers.host_buffer("out", out, numel, allowed, writable=True, gpu=gpu)
            if grad.numel != numel:
                raise ValueError(f"the compressed gradient is of {grad.numel} params, "
                                 f"sub-group {sg} has {numel}")
            nnz = len(grad.values)
            g = buffers.host_buffer("grad.values", grad.values, nnz, [buffers.F16, buffers.BF16],
                                    writable=False)
            index = buffers.index_buffer("grad.indices", grad.indices, nnz)
            keep = (g.owner, index.owner, o.owner)
            spans = [(g, nnz), (index, nnz)]
        else:
            o = buffers.host_buffer("out", out, numel, allowed, writable=True, gpu=gpu)
            g = buffers.host_buffer("grad", grad, numel, [buffers.F32, buffers.F16, buffers.BF16],
                                    writable=False, gpu=gpu)
            index, nnz, keep, spans = None, 0, (g.owner, o.owner), [(g, numel)]
        if any(_overlaps(b, n, o, numel) for b, n in spans):
            raise ValueError("grad and out overlap; give out its own memory")
        rule = self._rule(overrides)
        if not np.isfinite(grad_scale) or grad_scale <= 0:
            raise ValueError(f"grad_scale={grad_scale!r} must be a positive finite number")
        # maximize: torch negates the gradient first; a negated scale is the same, exactly
        hyper = dict(rule.hyper(), grad_scale=-float(grad_scale) if rule.maximize else float(grad_scale))
        on_gpu = [b.owner for b in (g, o) if isinstance(b.owner, torch.Tensor) and b.owner.is_cuda]
        ready = None
        if on_gpu:  # the device's own stream reads them once what the caller queued has run:
            # it waits for this event, where a host sync here held the caller's thread (DDP at
            # GPT-2 XL: a wait a sub-group, with nothing queued meanwhile)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(on_gpu[0].device))
        done = native.update(sg, g.address, g.dtype, index is not None,
                             index.address if index else 0, nnz, o.address, o.dtype, hyper,
                             bool(speculative), bool(log_only),
                             ready.cuda_event if ready is not None else 0, parts)
        future = UpdateFuture(done, keep + (ready,))  # (the event too, until every chunk waited)
        self._inflight.append(future)
        return future

    def retractable(self, sg: int) -> bool:
        """Whether ``sg`` can be updated speculatively now: its update would leave the states
        it reads untouched (a streamed sub-group not updated since the last durable commit;
        a resident one with a twin, see ``overlap``), and it was not updated in this step."""
        return self._open().retractable(self._subgroup(sg))

    def takes_parts(self, sg: int) -> bool:
        """Whether ``update(sg, ...)`` takes its gradient and params as lists of parts: the
        sub-group's device updates in host memory (a cpu device) fp32 states, element by
        element, and no log is kept (``copies="log"`` hashes one flat gradient)."""
        return self._open().takes_parts(self._subgroup(sg))

    def retract(self, sg: int) -> None:
        """Takes back ``sg``'s speculative update of the step in progress (waiting for it):
        its states and step count are as before it; its ``out`` holds params to ignore."""
        self._open().retract(self._subgroup(sg))

    def wait(self) -> None:
        """Waits until every update started so far has its params out."""
        for future in self._inflight:
            future.wait()

    def commit(self) -> None:
        """Ends the step: waits for its write-backs; every ``commit_every``-th step also
        writes the resident states, makes the writes durable, then flips the sub-groups'
        shadow copies in one atomic manifest update per device (with ``overlap``, once the
        resident states are written in the background: ``commit_pending``). If an update
        failed, the step is undone alone (``undo_step``); if the durable commit fails, the
        steps stand in memory, nothing undone, and the next durable commit writes them."""
        native = self._open()
        self._refuse_other_params_after_resume()
        try:
            native.commit()
            self._params_unchecked = False
        finally:
            self._inflight.clear()
            self._warn_foreign()

    def _refuse_other_params_after_resume(self) -> None:
        """The first step after a resume with a split master: the directories hold only the
        masters' low halves, so the resumed sub-groups' bf16 params must be the ones of the
        step they were committed at. Other params (a model freshly built whose weights were
        not loaded) would pair their weights with the stored moments and low halves: the
        step is discarded and refused, before it commits. (Params changed later, between
        steps, are taken as the masters with a warning.)"""
        if not self._params_unchecked or self.settings.master != "split":
            return
        found = self._native.take_foreign()
        resumed = sorted({sg for sg, _ in found if sg in self._resumed})
        if not resumed:
            self._warn_foreign(found)
            return
        step = self.step_count
        self.discard()
        raise ValueError(
            f"master='split': sub-groups {resumed} were resumed from "
            f"{[d.path for d in self.devices]} at step {step}, whose directories hold only the "
            f"low halves of the fp32 masters, and the model's bf16 params are not the ones of "
            f"that step (its weights not loaded?). The step was discarded. Load the model's "
            f"weights of step {step} (the checkpoint saved with it) before training on, or start "
            f"afresh with if_exists='overwrite'")

    def flush(self) -> None:
        """Makes the committed steps durable now (between steps; a no-op when they are)."""
        self._open().flush()

    def settle(self) -> None:
        """Waits for a durable commit being written in the background (``overlap``) to
        land. If it fails, its error is raised here; the steps stand (``durable_step_count``
        stays where it was, the next durable commit writes them)."""
        self._open().settle()

    def discard(self) -> None:
        """Ends the step without committing it and goes back to the last durable commit
        (with ``commit_every`` 1: the last committed step)."""
        native = self._open()
        try:
            native.discard()
        finally:
            self._inflight.clear()
            self._warn_foreign()

    def undo_step(self) -> list[int]:
        """Ends a failed step without committing it, undoing it alone: each update is
        retracted (or its resident states reloaded from the committed copy), the steps
        before it stay. An update made in place over steps not yet durable (``commit_every``
        > 1, states resident without a twin) cannot be undone: it is kept, as torch keeps
        what its loop updated before an exception; those sub-groups are returned. With a log
        or one copy written over, back to the durable commit as ``discard()``. After a
        ``commit()`` whose updates failed (it undid the step), the sub-groups it kept."""
        native = self._open()
        try:
            return native.undo_step()
        finally:
            self._inflight.clear()
            self._warn_foreign()

    @contextlib.contextmanager
    def step(self) -> Iterator["Pipeline"]:
        """``with pipe.step(): pipe.update(...)`` commits on success; on error the step is
        undone alone (``undo_step``)."""
        self._open()
        try:
            yield self
        except BaseException:
            self.undo_step()
            raise
        self.commit()

    def _rule(self, overrides: dict) -> UpdateRule:
        """The optimizer with this update's hyper-parameter overrides (validated)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if not overrides:
            return self.optimizer
        fields = {f.name for f in dataclasses.fields(self.optimizer)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"unknown hyper-parameters {sorted(unknown)} for "
                            f"{type(self.optimizer).__name__}: expected some of {sorted(fields)}")
        rule = dataclasses.replace(self.optimizer, **overrides)
        if rule.name != self.optimizer.name:  # amsgrad: another state layout
            raise ValueError(f"an update cannot change the rule from {self.optimizer.name} to "
                             f"{rule.name}: it is fixed for the directories")
        return rule


def _caller_parts(numel: int, grads: Sequence[Any], outs: Sequence[Any],
                  allowed: Sequence[int]) -> tuple:
    """(a Buffer of the gradient's dtype, one of the params', holding the parts; each part's
    (first param, gradient address, params address)) of a sub-group's gradient and params in
    parts: pairs of contiguous host tensors of one size, of one dtype a side, covering the
    sub-group, no gradient overlapping any params."""
    if len(grads) != len(outs) or not grads:
        raise ValueError(f"{len(grads)} gradient parts and {len(outs)} params parts: give one "
                         f"params part for each gradient part")
    if sum(int(g.numel()) for g in grads) != numel:
        raise ValueError(f"the gradient parts hold {sum(int(g.numel()) for g in grads)} "
                         f"elements, the sub-group has {numel}")
    gs = [buffers.host_buffer(f"grad part {i}", g, g.numel(), [buffers.F32, buffers.F16, buffers.BF16],
                              writable=False) for i, g in enumerate(grads)]
    os_ = [buffers.host_buffer(f"out part {i}", o, g.numel(), allowed, writable=True)
           for i, (g, o) in enumerate(zip(grads, outs))]
    if len({b.dtype for b in gs}) > 1 or len({b.dtype for b in os_}) > 1:
        raise TypeError("the gradient parts, and the params parts, must each be of one dtype")
    starts = [0]
    for g in grads[:-1]:
        starts.append(starts[-1] + int(g.numel()))
    spans = sorted((b.address, b.address + int(g.numel()) * g.element_size(), side)
                   for side, bs, ts in ((0, gs, grads), (1, os_, outs)) for b, g in zip(bs, ts))
    last_end = {0: 0, 1: 0}
    for begin, end, side in spans:  # (sorted by start: a part overlaps an earlier one of the
        if begin < last_end[1 - side]:  # other side where it starts before that one ends)
            raise ValueError("a gradient part and a params part overlap; give out its own memory")
        last_end[side] = max(last_end[side], end)
    holder = (tuple(b.owner for b in gs), tuple(b.owner for b in os_))
    return (buffers.Buffer(0, gs[0].dtype, holder[0]), buffers.Buffer(0, os_[0].dtype, holder[1]),
            [(start, g.address, o.address) for start, g, o in zip(starts, gs, os_)])


def _overlaps(a: buffers.Buffer, a_numel: int, out: buffers.Buffer, numel: int) -> bool:
    size = {buffers.F32: 4, buffers.F16: 2, buffers.BF16: 2, -1: 4}  # -1: int32 indices
    return (a.address < out.address + numel * size[out.dtype]
            and out.address < a.address + a_numel * size[a.dtype])
