"""``SmartInfinityStage3``'s stored states as DeepSpeed reaches them: its pipeline opened on
the rank's devices (when the optimizer is built, or by the first step where that sizes the
GPU's budget) with every sub-group registered, its fp32 accessors (``safe_get_*``/
``safe_set_*``) and ``refresh_fp32_params`` on the devices, its checkpoint's masters and the
device directories copied with it, and the ranks' agreement on the step they open at."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import Any, Optional

import torch
from deepspeed import comm as dist
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS

from smartinf.step import edits
from smartinf.pipeline import at_exit
from smartinf.pipeline import checkpoint
from smartinf.pipeline.checkpoint import restore_devices, save_devices
from smartinf.pipeline.devices import rank_directory
from smartinf.step.driver import Driver, stored_rule
from smartinf.pipeline.pipeline import Pipeline
from smartinf.step.phases import Phases
from smartinf.step.rounding import to_bf16
from smartinf.step import ranks
from smartinf.step.session import StepSession
from smartinf.integrations.deepspeed_config import _rule, for_this_gpu

logger = logging.getLogger("smartinf")


def logged_step_decision(steps: list, pending: list) -> str:
    """copies="log", from every rank's durable step and whether it holds a sealed log of the
    next one: ``"finish"`` it on the ranks behind (one rank a step ahead had updated, so
    every rank had sealed; or all hold it), ``"drop"`` it (all at one step, some rank lacks
    it: no rank had updated), or ``"apart"`` (the ranks do not fit one run)."""
    low = min(steps)
    behind = [p for s, p in zip(steps, pending) if s == low]
    if max(steps) > low + 1 or (max(steps) > low and not all(behind)):
        return "apart"
    return "finish" if max(steps) > low or all(behind) else "drop"


class StoredStates:
    """Mixed into ``SmartInfinityStage3``."""

    def _open(self, measured: Optional[int] = None, if_exists: Optional[str] = None,
              phases: Optional[Phases] = None) -> None:
        """This rank's pipeline opened (a GPU budget of "auto" sized: ``measured`` by the first
        step, or ``for_this_gpu``'s), its sub-groups registered (``_attach``); where the first
        step opens it, its ``phases`` marked (``open_plan``, ``open_pipeline``, ``open_attach``:
        where the first step's seconds went)."""
        phases = phases or Phases()
        given = self.settings.pipeline.if_exists
        if_exists = if_exists or given
        sizing = dataclasses.replace(self.settings, pipeline=dataclasses.replace(
            self.settings.pipeline, if_exists=if_exists))
        rule = stored_rule([_rule(self._rule_class, g) for g in self.optimizer.param_groups])
        numels = [int(n) for n, s in zip(self.fp16_partitioned_groups_flat_numel, self._small) if not s]
        fitted = for_this_gpu(sizing, self._later, self._gpu, measured, numels,
                              1 + len(rule.state_names))
        self.settings = dataclasses.replace(
            fitted, pipeline=dataclasses.replace(fitted.pipeline, if_exists=given))
        phases.mark("open_plan")
        self._devices = self.settings.rank_devices(dist.get_rank(), self._gpu)
        self._dirs = self.settings.rank_paths(dist.get_rank(), self._gpu)
        ranks.leave_cleanly()
        ranks.refuse_moved(self._summed, dist.get_rank(), dist.get_world_size(),
                           rank_directory(self.settings.devices[0], dist.get_rank()), if_exists)
        with ranks.opening_together(self._summed, dist.get_rank(), dist.get_world_size()):
            self.pipeline = self._all_ranks(lambda: (checkpoint.refuse_never_committed(
                self._dirs, if_exists), self._open_pipeline(if_exists))[1])
        self._agree_on_step()
        phases.mark("open_pipeline")
        at_exit.register_front_end(self, "settle")  # its tail drained at exit, then the pipeline closed
        self._driver = Driver(self.pipeline, max(int(n) for n in self.fp16_partitioned_groups_flat_numel),
                              self._compress)
        # With a log every rank seals its step's log before any rank updates (_agree_on_step)
        self._session = StepSession(self.pipeline, self._driver, self._put_params,
                                    restored=self._release_kept_whole,
                                    sealed=dist.barrier if self.pipeline.logs_gradients else None)
        # What the partitions held when the step last put them (a split master's devices
        # check their own), and what the kept-whole params held when last gathered: edits
        # since become the masters at the next step.
        self._watch = None if self._split else \
            edits.ParamWatch(lambda i: [self.fp16_partitioned_groups_flat[i]])
        self._whole = edits.ParamWatch(lambda p: [p.data])
        self._attach()
        phases.mark("open_attach")

    def _opened(self) -> Pipeline:
        """The pipeline, opened now if the first step was to size its GPU budget and something
        needs it before (a checkpoint, an accessor): sized then from what is free."""
        if self.pipeline is None:
            self._open()
            self._agree_on_resume()
            self._start_speculation()
        return self.pipeline

    def _open_pipeline(self, if_exists: str) -> Pipeline:
        rule = stored_rule([_rule(self._rule_class, g) for g in self.optimizer.param_groups])
        numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        quantized = self.settings.pipeline.state_dtype != "fp32"
        return Pipeline(self._devices, rule,
                        settings=dataclasses.replace(self.settings.pipeline, if_exists=if_exists),
                        subgroup_sizes=[n for n, s in zip(numels, self._small) if not s],
                        small_sizes=[n for n, s in zip(numels, self._small) if s] if quantized else None,
                        gradient_bytes=self.gradient_accumulation_dtype.itemsize,  # (the partitions')
                        defer_logged_step=True)  # (copies="log": the ranks decide together)

    def _attach(self) -> None:
        """Registers every sub-group; resumed ones put their master weights into the model."""
        for i, flat in enumerate(self.fp16_partitioned_groups_flat):
            master = self._driver.staging.grad(0, torch.float32, flat.numel())
            master.copy_(flat)
            if self.pipeline.add_subgroup(flat.numel(), init=master, small=self._small[i]) != i:
                raise RuntimeError(f"sub-group {i} was registered out of order")
            if self.pipeline.resumed(i):
                self._resumed = True
                if not self._split:  # (else the partitions hold the high halves: loaded with the model)
                    self._put_params(i, torch.from_numpy(self.pipeline.read_states(i)["param"]))
                continue
            self._put(i)

    def _summed(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (an all-reduce every rank calls)."""
        t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def _all_ranks(self, action: Any) -> Any:
        """Runs ``action`` (opening the pipeline) on every rank; if it fails on any, it fails
        on all (a rank left waiting in the next collective would hang)."""
        return ranks.on_every_rank(action, self._summed, Pipeline.close)

    def _agree_on_step(self) -> None:
        """Every rank opens at one durable step (``step.ranks.agree_on_step``); with a log,
        the logged step is decided first."""
        world = dist.get_world_size()
        rank = dist.get_rank()
        if self.pipeline.logs_gradients:
            self._agree_on_logged_step(world, rank)

        ranks.agree_on_step(self.pipeline, self._summed, rank, world, self.settings.devices,
                            self.settings.pipeline.copies)

    def _agree_on_logged_step(self, world: int, rank: int) -> None:
        """copies="log": each rank seals its step's log before any rank updates (the step
        session waits for all), so where some rank's directories are at the step after the
        others', or every rank holds a sealed log of the next step, all finish it; where some
        rank lacks one, no rank had updated in it, and the ranks holding one forget it."""
        mine = torch.zeros(2 * world, dtype=torch.float64, device=self.device)
        mine[2 * rank] = float(self.pipeline.durable_step_count)
        mine[2 * rank + 1] = float(self.pipeline.logged_step_pending)
        dist.all_reduce(mine, op=dist.ReduceOp.SUM)
        steps, pending = [int(x) for x in mine[0::2].tolist()], [bool(x) for x in mine[1::2].tolist()]
        decision = logged_step_decision(steps, pending)
        if decision == "finish" and self.pipeline.logged_step_pending:
            self.pipeline.finish_logged_step()
            logger.warning("rank %d's directories %s held step %d's logged gradients, unfinished "
                           "(a crash during that step): finished from the log", rank, self._dirs,
                           min(steps) + 1)
        elif decision == "drop":
            self.pipeline.drop_logged_step()
        # "apart": refused by _agree_on_step, naming each rank's step

    def _agree_on_resume(self) -> None:
        """All ranks resume or none do (at one step: ``_agree_on_step`` saw to it at open)."""
        flags = torch.tensor([float(self._resumed), -float(self._resumed)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] != -flags[1]:
            raise RuntimeError(f"some ranks found stored states in {self.settings.devices} and "
                               f"others did not: load a checkpoint or use fresh directories")
        if self._resumed:
            logger.warning("resumed %d sub-groups at step %d from %s (if_exists=\"resume\"): "
                           "their stored weights replaced the model's", self.pipeline.num_subgroups,
                           self.pipeline.step_count, self._dirs)
            self._regather_persistent()

    def _get_fp32_opt_state_partition(self, param: Any, release_swap_buffers: bool,
                                      optim_state_key: Optional[str] = None) -> tuple:
        """This rank's part of ``param``'s master (or optimizer state), from the devices'
        committed step: what DeepSpeed's safe_get_*/safe_set_* read and write in place."""
        self._opened()  # (before the first step: see SmartInfinityStage3._opened)
        self.settle()
        names = self.pipeline.optimizer.state_names
        if optim_state_key not in (None, *names):
            raise KeyError(f"{optim_state_key!r} is not an optimizer state of smartinf's "
                           f"{self.pipeline.optimizer.name}: it keeps {list(names)}")
        group_idx, offset, numel = self.grad_position[self.get_param_id(param)]
        states = self.pipeline.read_states(group_idx, params=self._host_params(group_idx))
        # DeepSpeed's setters keep the buffers (release_swap_buffers=False) to write them
        self._read = None if release_swap_buffers else (group_idx, states)
        part = states["param" if optim_state_key is None else optim_state_key]
        return torch.from_numpy(part[offset:offset + numel]), group_idx

    def set_full_hp_param(self, value: Any, param: Any, optim_state_key: Any = None) -> None:
        self._write_through(super().set_full_hp_param, value, param, optim_state_key)

    def set_local_hp_param(self, value: Any, param: Any, optim_state_key: Any = None) -> None:
        self._write_through(super().set_local_hp_param, value, param, optim_state_key)

    def _write_through(self, setter: Any, *args: Any) -> None:
        """DeepSpeed's setter on the states read from the devices, which then go back as a
        step. As with DeepSpeed's own fp32 partitions, the model's param takes a new master
        at the next step."""
        self._opened()  # (before the first step: see SmartInfinityStage3._opened)
        self.settle()
        self._read = None
        setter(*args)
        read, self._read = self._read, None
        if read is not None:  # else the setter returned early (a frozen param)
            group_idx, states = read
            with self.pipeline.step():
                self.pipeline.write_states(group_idx, states,
                                           self.pipeline.subgroup_steps(group_idx))
            if self._split:  # the new master's high halves are the params now
                flat = self.fp16_partitioned_groups_flat[group_idx]
                flat.copy_(to_bf16(torch.from_numpy(states["param"])).to(flat.device))
                self._unflatten_partitioned_parameters(group_idx)

    def _host_params(self, i: int) -> Optional[torch.Tensor]:
        """Sub-group ``i``'s bf16 params on the host: a split master is rebuilt from them."""
        return self.fp16_partitioned_groups_flat[i].to("cpu").contiguous() if self._split else None

    def _restore_from_bit16_weights(self) -> None:
        """DeepSpeed's masters := the model's partitions (``refresh_fp32_params``, loads
        without optimizer states): written to the devices as a step; the optimizer states
        stay, as DeepSpeed's do."""
        self._opened()  # (before the first step: see SmartInfinityStage3._opened)
        self.settle()
        with self.pipeline.step():
            for i, flat in enumerate(self.fp16_partitioned_groups_flat):
                self.pipeline.write_master(i, flat.detach().to("cpu", torch.float32))
        for i in range(len(self.fp16_groups)):
            self._put(i)

    def state_dict(self) -> dict:
        """DeepSpeed's, with the devices' committed masters in place of the empty fp32
        partitions, so that zero_to_fp32 consolidates the true fp32 weights (``save_checkpoint``
        has taken params edited since the last step as the masters: ``save_states``)."""
        self._opened()  # (before the first step: see SmartInfinityStage3._opened)
        self.settle()
        state = super().state_dict()
        state[FP32_FLAT_GROUPS] = [
            torch.from_numpy(self.pipeline.read_states(i, params=self._host_params(i))["param"])
            for i in range(len(self.fp16_groups))]
        return state

    def _rigid_load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """DeepSpeed's load without the file's masters: the devices' copies carry them. With
        a split master the devices hold only their low halves: the partitions take the high
        halves, the file's masters rounded as the devices round them (the params the step
        that saved them emitted), which the module file of a ZeRO-3 checkpoint does not hold."""
        super()._rigid_load_state_dict({**state_dict, FP32_FLAT_GROUPS: []},
                                       load_optimizer_states)
        if self._split:
            for i, (flat, master) in enumerate(zip(self.fp16_partitioned_groups_flat,
                                                   state_dict[FP32_FLAT_GROUPS])):
                flat.copy_(to_bf16(master.float()).to(flat.device))
                self._unflatten_partitioned_parameters(i)

    def save_states(self, directory: str) -> None:
        """Copies this rank's device directories (the last committed step) to ``directory``,
        replacing an earlier copy under the same tag (the transformers Trainer saves a tag
        twice), as DeepSpeed replaces its own files. Params edited since the last step are
        taken as the masters first, as a step would (every rank saves: ``_adopt`` is a
        collective)."""
        self._opened()  # (before the first step: see SmartInfinityStage3._opened)
        self.settle()
        self._adopt(self._edited())
        self.pipeline.flush()  # the directories hold every committed step
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        save_devices(self._dirs, directory)

    def restore_states(self, directory: str) -> None:
        """Replaces this rank's device directories with a copy saved by ``save_states`` and
        puts the restored master weights into the model's partitions."""
        self.settle()
        if self.pipeline is None:  # before the first step: opened on what it restores
            restore_devices(directory, self._dirs)
            self._open(if_exists="resume")
            self._start_speculation()
        else:
            self.pipeline.close()
            restore_devices(directory, self._dirs)
            self.pipeline = self._driver.pipeline = self._session.pipeline = self._open_pipeline("resume")
            if self._speculation is not None:
                self._speculation.pipeline = self.pipeline
            self._attach()
        missing = [i for i in range(len(self.fp16_groups)) if not self.pipeline.resumed(i)]
        if missing:
            raise ValueError(f"the checkpoint in {directory} lacks sub-groups {missing} of "
                             f"this model; was it saved with another model or world size?")
        self._regather_persistent()

    def traffic(self) -> dict[str, float]:
        """Bytes moved so far per link and the steps committed (this rank)."""
        self._opened()
        return self._driver.traffic()
