"""One optimizer step, below the front-ends (``smartinf.optim``, the DeepSpeed integration).

A front-end says when a gradient is final and what the step's global decisions are (the
gradient scale after inf/NaN checks and clipping, each group's hyper-parameters); the
session does the rest, the same way for both: the updates started during backward kept or
retracted (``Speculation``), the other sub-groups sent through the driver, each one's params
put into the model as its update lands, and the step committed. Where the step fails, it is
undone alone (``Pipeline.undo_step``): its updates retracted and the params it put rebuilt
from the stored masters; the steps before stay. An update made in place over steps not yet
durable cannot be undone: it is kept, params and states, as torch keeps what its loop
updated before an exception, and that is said. Where only the step's durable commit
failed, the step stands: nothing is undone. With a split master the params are the masters'
high halves and cannot be put back; that is said, and they are taken as the masters at the
next step.

The step finishes ``now`` (before ``step()`` returns) or ``later``: DeepSpeed with
``overlap`` hands the updates to a ``StepTail``, which puts each sub-group's params when the
next forward gathers them and commits when it drains (``settle``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from smartinf.step.driver import Driver
from smartinf.pipeline.pipeline import Pipeline
from smartinf.step.speculation import Speculation
from smartinf.step.tail import StepTail

logger = logging.getLogger("smartinf")


class StepSession:
    """The steps of one front-end's pipeline. ``put(sg, params)`` writes a flat tensor of
    sub-group ``sg``'s params (updated ones, or fp32 masters) into the model;
    ``restored(subgroups)``, if given, is told which were put back after a failure."""

    def __init__(self, pipeline: Pipeline, driver: Driver, put: Callable[[int, torch.Tensor], None],
                 speculation: Optional[Speculation] = None,
                 restored: Optional[Callable[[list], None]] = None,
                 sealed: Optional[Callable[[], None]] = None) -> None:
        self.pipeline = pipeline
        self.driver = driver
        self.speculation = speculation
        self.tail: Optional[StepTail] = None
        self._put = put
        self._restored = restored  # told which sub-groups' params were put back
        self._sealed = sealed  # with a log: waits until every process sealed its step's log
        self._before = 0  # the step count when the step began
        self._touched: list[int] = []  # sub-groups whose params this step put

    def with_tail(self, finish: Callable[[int], None]) -> StepTail:
        """The tail a ``later`` step hands its updates to; ``finish(sg)`` puts a landed
        sub-group's params (through ``put``)."""
        self.tail = StepTail(finish, self._commit, lambda: self.fail(undo=True))
        return self.tail

    def _commit(self) -> None:
        """The tail's step committed; if its updates failed, the step is undone alone."""
        try:
            self.pipeline.commit()
        except BaseException:
            self.fail()
            raise

    # -- a step ---------------------------------------------------------------------------
    def begin(self) -> None:
        """A step begins: nothing put yet; a failure goes back from here."""
        self._before = self.pipeline.step_count
        self._touched = []

    def take(self, scale: Optional[float], hyper_of: Callable[[int], dict],
             later: Any = None) -> dict:
        """The updates started during backward that hold (``Speculation.take``), by
        sub-group; the others retracted. ``scale`` None: the step is skipped."""
        if self.speculation is None:
            return {}
        return self.speculation.take(scale, hyper_of, later)

    def predict(self, scale: Optional[float]) -> None:
        """The scale the next step's updates started during backward assume (None: none start)."""
        if self.speculation is not None:
            self.speculation.predict(scale)

    def put(self, sg: int, params: torch.Tensor) -> None:
        """Sub-group ``sg``'s updated params into the model (counted first: a failed put is
        restored too)."""
        self._touched.append(sg)
        self._put(sg, params)

    def landed(self, sg: int) -> None:
        """Sub-group ``sg``'s update put its params into the model itself (in place)."""
        self._touched.append(sg)

    def now(self, kept: dict, rest: Sequence[int], send: Callable[[int, int], Any],
            finish: Callable[[int, int], None]) -> None:
        """The step finished before it returns: the kept updates' params put, the ``rest``
        sent (``send(sg, buffer)`` returns the update's future) with every device busy,
        each landed one finished (``finish(sg, buffer)`` puts its params), then committed."""
        try:
            with self.pipeline.step():
                for sg, out in kept.items():
                    self.put(sg, out)
                if self.pipeline.logs_gradients:  # the step's input, durable before any update
                    self.driver.log(rest, send)
                    self.pipeline.seal_log()
                    if self._sealed is not None:
                        self._sealed()  # every process sealed before any updates
                self.run(rest, send, finish)
        except BaseException:
            self.fail(undo=True)
            raise

    def run(self, subgroups: Sequence[int], send: Callable[[int, int], Any],
            finish: Callable[[int, int], None]) -> None:
        """``subgroups`` sent and finished as in ``now``, within a step left open."""
        def landed(sg: int, future: Any, buffer: int) -> None:
            future.wait()
            self.landed(sg)
            finish(sg, buffer)
        self.driver.run(subgroups, send, landed)

    def fail(self, undo: bool = False) -> None:
        """After a failure: the step undone alone (``undo``: the pipeline's step may still be
        open), and the model's params of the sub-groups it put with it, but those whose
        update was kept; where the devices went back further (a log, one copy written over),
        every sub-group's. A step that stands (only its durable commit failed) keeps its
        params."""
        kept: list = []
        if undo:
            try:
                kept = self.pipeline.undo_step()
            except Exception as e:  # the original error is the one to raise
                logger.error("undoing the failed step failed too: %s", e)
        # (a kept update whose params the step had not put yet: its masters put too)
        touched = [sg for sg in self._touched if sg not in set(kept)] + \
            [sg for sg in kept if sg not in set(self._touched)]
        if self.pipeline.closed:
            touched = []
        elif self.pipeline.step_count > self._before:  # only its durable commit failed
            self._commit_failed()
            touched = []
        elif self.pipeline.step_count < self._before:  # back to a durable commit further back
            logger.warning("the step failed: the devices are back at step %d, their last "
                           "durable commit (commit_every=%d), and so are the model's params",
                           self.pipeline.step_count, self.pipeline.settings.commit_every)
            touched = range(self.pipeline.num_subgroups)
        if kept:
            logger.warning("the step failed after sub-groups %s were updated in place over "
                           "steps not yet durable: their updates are kept (params and states, "
                           "one step ahead of the others), as torch keeps what its loop updated "
                           "before an exception; the other sub-groups' updates were undone",
                           sorted(kept))
        self._restore(touched)
        self._touched = []

    def _commit_failed(self) -> None:
        logger.warning("a durable commit failed (the error follows): the steps stand, in "
                       "memory, nothing undone (step %d; do not redo it); the directories stay "
                       "at step %d until a durable commit lands (the next one due, save(), "
                       "close(), or the interpreter's exit)", self.pipeline.step_count,
                       self.pipeline.durable_step_count)

    def _restore(self, subgroups: Sequence[int]) -> None:
        """The model's params of ``subgroups`` rebuilt from the stored masters."""
        subgroups = sorted(set(subgroups))
        if self.pipeline.settings.master == "split":
            if subgroups:
                logger.error("the step failed after sub-groups %s had their params updated; "
                             "with master='split' the params are the masters' high halves, so "
                             "they cannot be put back: they keep the failed step's values and "
                             "are taken as the masters at the next step (ParamsChangedWarning)",
                             subgroups)
            return
        try:
            for sg in subgroups:
                self._put(sg, torch.from_numpy(self.pipeline.read_states(sg)["param"]))
            if self._restored is not None and subgroups:
                self._restored(subgroups)
        except Exception as e:  # the original error is the one to raise
            logger.error("the step failed and the model's params could not be restored (%s): "
                         "%d sub-groups hold the failed step's update; reopen the directories "
                         "to put the committed weights back", e, len(subgroups))

    # -- between steps ----------------------------------------------------------------------
    def settle(self) -> None:
        """Before the states are read, written or copied: the last step finished (its tail
        drained, committed), updates started during a backward since retracted (the step
        redoes them), and a durable commit written in the background landed. If that commit
        failed, its error is raised; the steps stand, in memory, for the next durable commit
        (with a log: back at the commit before, and so are the model's params)."""
        if self.tail is not None:
            self.tail.drain()
        if self.speculation is not None:
            self.speculation.cancel()
        self.begin()
        try:
            self.pipeline.settle()  # (a failed commit's steps stand: nothing to restore)
        except BaseException:
            if self.pipeline.step_count == self._before:
                self._commit_failed()
            if self.pipeline.step_count < self._before:  # a log's: back to the commit before
                logger.warning("a durable commit written in the background failed: the devices "
                               "are back at step %d, their last durable commit, and so are the "
                               "model's params", self.pipeline.step_count)
                self._restore(range(self.pipeline.num_subgroups))
            raise
