"""DeepSpeed ZeRO-3 with the optimizer step next to the storage.

``smartinf.integrations.deepspeed.initialize(...)`` takes exactly what
``deepspeed.initialize`` takes; a ``"smartinf"`` block in the config moves the fp32
master weights and optimizer states of every ZeRO-3 sub-group onto near-storage devices::

    "zero_optimization": {"stage": 3, "sub_group_size": 100000000},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
    "smartinf": {"devices": ["/nvme0/run1", "/nvme1/run1"],   # one directory per CSD
                 "chunk": 1048576, "io": "auto",
                 "compress": {"ratio": 0.01}}                  # optional SmartComp top-k

Plug-in point: DeepSpeed's engine builds its stage-3 optimizer by importing the name
``DeepSpeedZeroOptimizer_Stage3`` from ``deepspeed.runtime.zero.stage3`` at that moment
(as it does for its own ``SuperOffloadOptimizer_Stage3``). :class:`SmartInfEngine` builds
:class:`SmartInfinityStage3`, a subclass of it, by giving that name the subclass for the
duration of the call; ``initialize`` has ``deepspeed.initialize`` build a
``SmartInfEngine`` the same way. Nothing else of DeepSpeed is changed: partitioning,
gradient reduce-scatter, the overflow check, loss scaling, gradient clipping, schedulers
and checkpoints stay DeepSpeed's.

What the subclass changes: no fp32 partition, no optimizer state and no fp32 gradient
buffer is allocated or swapped; each sub-group's master weights and states live in a
:class:`smartinf.Pipeline` over ``devices/rank<R>`` (one set per rank). At ``step()`` each
sub-group's gradient partition (DeepSpeed's reduced, partitioned gradients; top-k
compressed on the accelerator when configured) goes to the pipeline with
``grad_scale = 1 / (loss scale x clip coefficient)``, and the updated params come out into
the sub-group's fp16/bf16/fp32 partition. ``engine.save_checkpoint`` / ``load_checkpoint``
copy the device directories into ``<checkpoint>/<tag>/smartinf/rank<R>``; DeepSpeed's own
files get the devices' fp32 masters (for ``zero_to_fp32``), and DeepSpeed's fp32 accessors
(``deepspeed.utils.safe_get_full_fp32_param`` ...) read and write the devices.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Optional

import torch

try:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero.config import get_zero_config
except ImportError as e:  # pragma: no cover - exercised only without DeepSpeed
    raise ImportError("smartinf.integrations.deepspeed needs DeepSpeed: "
                      "pip install 'smartinf[deepspeed]'") from e

from .. import defaults, edits, plan, update_rules
from ..checkpoint import restore_devices, save_devices
from ..compress import TopK
from ..devices import rank_directory, with_gpu
from ..driver import Driver, overrides, rule_for, stored_rule
from ..optim import _StorageOptimizer as StorageOptimizer
from ..pipeline import Pipeline
from ..rounding import to_bf16
from ..settings import KEYWORDS as PIPELINE_KEYWORDS, PipelineSettings
from ..speculation import Speculation
from ..step_tail import StepTail
from . import deepspeed_hook

logger = logging.getLogger("smartinf")
# DeepSpeed's own initialize, taken now: a user who sets deepspeed.initialize to ours by
# hand must not make ours call itself.
_deepspeed_initialize = deepspeed_hook.original_initialize(deepspeed)

__all__ = ["initialize", "SmartInfEngine", "SmartInfinityStage3", "Settings"]

CONFIG_KEY = deepspeed_hook.CONFIG_KEY
#: Updates started during backward while fewer than this are unfinished: one running and
#: one queued keep the devices busy; the rest wait for the tail, in the forward's order.
UNFINISHED_SPECULATIONS = 2


@dataclass
class Settings:
    """The ``"smartinf"`` block of a DeepSpeed config."""

    devices: list
    pipeline: PipelineSettings  # the rest of the block but compress and gpu, checked
    compress: Optional[dict] = None
    gpu_memory_budget: int = 0  # "gpu": {"memory_budget": ...}: the rank's GPU as a device
    gpu_twins: Optional[bool] = None  # "gpu": {"twins": ...}: CudaDevice's twins
    auto: tuple = ()  # "state_dtype": "auto": the settings given explicitly (plan.choose keeps them)

    @classmethod
    def from_config(cls, config: dict) -> "Settings":
        block = config.get(CONFIG_KEY)
        if not isinstance(block, dict):
            raise ValueError(f'the DeepSpeed config needs a "{CONFIG_KEY}" block (a dict with at '
                             f'least "devices": [directories]), got {block!r}')
        pipeline_keys = set(PIPELINE_KEYWORDS)
        known = {"devices", "compress", "gpu"} | pipeline_keys
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f'unknown keys {unknown} in the "{CONFIG_KEY}" config block; '
                             f'known: {sorted(known)}')
        devices = block.get("devices")
        if isinstance(devices, str):
            devices = [devices]
        if not isinstance(devices, list) or not devices or \
                not all(isinstance(d, str) and d for d in devices):
            raise ValueError(f'"{CONFIG_KEY}.devices" must be a non-empty list of directories, '
                             f'got {devices!r}')
        compress = block.get("compress")
        if compress is not None:
            if not isinstance(compress, dict) or not set(compress) <= {"ratio", "value_dtype",
                                                                       "error_feedback"}:
                raise ValueError(f'"{CONFIG_KEY}.compress" must be a dict with "ratio" and '
                                 f'optionally "value_dtype", "error_feedback"; got {compress!r}')
        gpu = block.get("gpu")
        if gpu is not None and (not isinstance(gpu, dict) or "memory_budget" not in gpu
                                or not set(gpu) <= {"memory_budget", "twins"}
                                or not isinstance(gpu.get("twins", False), (bool, type(None)))):
            raise ValueError(f'"{CONFIG_KEY}.gpu" must be a dict with "memory_budget" (bytes of '
                             f'the rank\'s GPU memory for states, e.g. "8GiB") and optionally '
                             f'"twins" (true, false or null: the model chooses); got {gpu!r}')
        try:
            gpu_budget = defaults.parse_bytes(gpu["memory_budget"], "gpu.memory_budget") if gpu else 0
        except (TypeError, ValueError) as e:
            raise ValueError(f'the "{CONFIG_KEY}" config block: {e}') from None
        given = {k: block[k] for k in pipeline_keys if k in block}
        auto = given.get("state_dtype") == "auto"
        if auto:  # chosen when the partition's size is known (SmartInfinityStage3._choose)
            given["state_dtype"] = "fp32"
        try:
            pipeline = PipelineSettings.resolve(**{"if_exists": "error", **given})
        except (TypeError, ValueError) as e:
            raise ValueError(f'the "{CONFIG_KEY}" config block: {e}') from None
        return cls(devices=devices, pipeline=pipeline, compress=compress,
                   gpu_memory_budget=gpu_budget, gpu_twins=(gpu or {}).get("twins"),
                   auto=tuple(k for k in ("master", "memory_budget", "commit_every", "copies") if k in given)
                   + ("auto",) if auto else ())

    def rank_devices(self, rank: int, gpu: int) -> list:
        """Each rank keeps its partition's states in its own sub-directories; with a GPU
        budget its GPU (``gpu``) is a device in front of them."""
        dirs = [rank_directory(d, rank) for d in self.devices]
        return with_gpu(dirs, self.gpu_memory_budget, gpu, self.gpu_twins) \
            if self.gpu_memory_budget else dirs

    def top_k(self) -> Optional[TopK]:
        if self.compress is None:
            return None
        c = dict(self.compress)
        if "value_dtype" in c:
            c["value_dtype"] = getattr(torch, str(c["value_dtype"]).replace("torch.", ""))
        return TopK(**c)


def check_config(config: dict) -> Settings:
    """Refuses configurations the integration does not run, before anything is built;
    returns the ``"smartinf"`` block's settings."""
    settings = Settings.from_config(config)
    zero = get_zero_config(config)  # DeepSpeed's reading, legacy spellings ("cpu_offload") included
    if zero.stage != 3:
        raise ValueError(f'smartinf runs the ZeRO stage 3 optimizer step: set '
                         f'"zero_optimization": {{"stage": 3}} (got stage {int(zero.stage)})')
    if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none":
        key = "cpu_offload" if "cpu_offload" in config["zero_optimization"] else "offload_optimizer"
        raise ValueError(f'"zero_optimization.{key}" offloads the optimizer to '
                         f'{zero.offload_optimizer.device!r}: the optimizer states live on the '
                         f'smartinf devices; remove {key}')
    if zero.offload_param is not None and zero.offload_param.device == "nvme":
        raise ValueError('"zero_optimization.offload_param" to nvme is not supported with '
                         'smartinf yet; use "cpu" or "none"')
    if (config.get("checkpoint") or {}).get("load_universal"):
        raise ValueError('"checkpoint.load_universal" is not supported with smartinf: a '
                         'universal checkpoint has no device directories; load a checkpoint '
                         'saved by this integration')
    if config.get("hybrid_engine", {}).get("enabled"):
        raise ValueError("the DeepSpeed hybrid engine is not supported with smartinf")
    _check_optimizer_block(config.get("optimizer"))
    return settings


# The params of a config "Lion" block: LionParams's. (DeepSpeed's CPU Lion and FusedLion
# options choose their own kernels and state dtypes; the devices keep fp32 states.)
LION_KEYS = ("lr", "betas", "weight_decay", "maximize")


def _check_optimizer_block(block: Any) -> None:
    """Refuses options of a config "optimizer" block that its base optimizer here would not
    carry to the devices (the rest are checked where the rule is read: ``_rule``)."""
    if not isinstance(block, dict):
        return
    kind = str(block.get("type", "")).lower()
    params = block.get("params") or {}
    if kind in ("adam", "adamw") and "torch_adam" in params and not params["torch_adam"]:
        for key in ("amsgrad", "maximize"):
            if params.get(key):
                raise ValueError(f'"optimizer.params.{key}" needs torch\'s Adam(W) as the base '
                                 f'optimizer (smartinf\'s default): remove "torch_adam": false '
                                 f'(it builds DeepSpeed\'s FusedAdam, which has no {key})')
    if kind in ("sgd", "adagrad", "lion") and "amsgrad" in params:
        raise ValueError(f'"optimizer.params.amsgrad" is an option of Adam and AdamW (a fourth '
                         f'state array); the {block["type"]} block has none: remove it')
    if kind == "lion":
        unknown = sorted(set(params) - set(LION_KEYS))
        if unknown:
            raise ValueError(f'"optimizer.params" {unknown} of the Lion block: smartinf\'s Lion '
                             f'takes {list(LION_KEYS)} (its states are fp32 on the devices): '
                             f'remove {"it" if len(unknown) == 1 else "them"}')


# The update rule for DeepSpeed's base optimizer: its Adam variants and torch's Adam(W)
# by their decoupled-weight-decay flag, SGD, Adagrad, Lion; any other optimizer is refused.
# amsgrad and maximize come with the param groups (rule_for).
def _rule_class(optimizer: torch.optim.Optimizer) -> type:
    name = type(optimizer).__name__
    if name in ("DeepSpeedCPUAdam", "FusedAdam", "ZenFlowCPUAdam"):
        decoupled = bool(getattr(optimizer, "adamw_mode", getattr(optimizer, "adam_w_mode", True)))
        return update_rules.AdamW if decoupled else update_rules.Adam
    if isinstance(optimizer, torch.optim.Adam):  # torch's AdamW is an Adam subclass
        decoupled = isinstance(optimizer, torch.optim.AdamW) or \
            optimizer.defaults.get("decoupled_weight_decay", False)
        return update_rules.AdamW if decoupled else update_rules.Adam
    if isinstance(optimizer, torch.optim.SGD):
        return update_rules.SGD
    if name in ("Adagrad", "DeepSpeedCPUAdagrad"):
        return update_rules.Adagrad
    if name in ("FusedLion", "DeepSpeedCPULion", "LionParams"):
        return update_rules.Lion
    raise ValueError(f"smartinf runs Adam, AdamW, SGD, Adagrad and Lion; the DeepSpeed optimizer is "
                     f"{name}")


def _rule(rule_class: type, group: dict) -> Any:
    """The update rule with a param group's current hyper-parameters (read every step)."""
    if not group.get("bias_correction", True):
        raise ValueError("bias_correction=False is not supported by smartinf")
    return rule_for(rule_class, group)


class SmartInfinityStage3(stage3.DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 whose per-sub-group optimizer step runs in a :class:`smartinf.Pipeline`."""

    def __init__(self, module: Any, init_optimizer: Any, param_names: Any, timers: Any,
                 ds_config: dict, **kwargs: Any) -> None:
        self.settings = check_config(ds_config)
        self._rule_class = _rule_class(init_optimizer)
        self._compress = self.settings.top_k()
        self.pipeline: Optional[Pipeline] = None
        self._read: Optional[tuple] = None  # states read by an accessor, for a setter to write
        self.last_step_seconds = 0.0
        self._resumed = False
        super().__init__(module, init_optimizer, param_names, timers, ds_config, **kwargs)
        self._agree_on_resume()
        self._start_speculation()

    # -- updates during backward (overlap) ----------------------------------------------
    def _speculates(self, backward_on_gpu: bool) -> bool:
        """Whether updates start during backward: with ``overlap``, not with top-k compression
        (whose error feedback a retracted update would have advanced), and where backward runs
        on the CPU only when asked (it holds the cores the update needs)."""
        return self.settings.pipeline.overlap and self._compress is None and \
            (backward_on_gpu or defaults.speculate_on_cpu())

    def _start_speculation(self) -> None:
        """With ``overlap`` (not with top-k compression, whose error feedback a retracted
        update would have advanced): a sub-group's update starts when the last of its
        gradient partitions is reduced at an accumulation boundary (``partition_grads``),
        into host buffers of one copy of the partitions (gradients in, params out); the
        updates not done when backward ends finish while the next forward runs, each param's
        gather waiting for its own sub-group (``StepTail``)."""
        self._speculation: Optional[Speculation] = None
        self._tail: Optional[StepTail] = None
        if not self._speculates(self.grad_partitions_flat_buffer.is_cuda):
            return
        self._speculation = Speculation(self.pipeline)
        self._subgroup_of = {p.ds_id: i for i, group in enumerate(self.fp16_groups) for p in group}
        self._awaited = [sum(p.requires_grad for p in group) for group in self.fp16_groups]
        self._reduced = [0] * len(self.fp16_groups)
        pin = self.grad_partitions_flat_buffer.is_cuda
        self._speculated_grads = [
            torch.empty(flat.numel(), dtype=self.grad_partitions_flat_buffer.dtype, pin_memory=pin)
            for flat in self.fp16_partitioned_groups_flat] if pin else None
        self._speculated_params = [torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=pin)
                                   for flat in self.fp16_partitioned_groups_flat]
        self._tail = StepTail(lambda i: self._put_params(i, self._speculated_params[i]),
                              lambda: self.pipeline.commit(),  # a checkpoint load opens
                              lambda: self.pipeline.discard())  # another pipeline
        for param in self.module.parameters():  # a gathered list may begin with any param
            if hasattr(param, "all_gather_coalesced"):
                self._gathers_wait(param)

    def _gathers_wait(self, param: Any) -> None:
        """``param``'s gathers (ZeRO-3's fetch and prefetch, ``GatheredParameters``, the
        kept-whole params' gather) first wait for the updates of the params they gather."""
        gather, coalesced = param.all_gather, param.all_gather_coalesced

        def all_gather(param_list: Any = None, *args: Any, **kwargs: Any) -> Any:
            self._wait_for([param] if param_list is None else param_list)
            return gather(param_list, *args, **kwargs)

        def all_gather_coalesced(params: Any, *args: Any, **kwargs: Any) -> Any:
            params = list(params)
            self._wait_for(params)
            return coalesced(params, *args, **kwargs)
        param.all_gather, param.all_gather_coalesced = all_gather, all_gather_coalesced

    def _wait_for(self, params: Any) -> None:
        if self._tail is not None:
            self._tail.wait(self._subgroup_of.get(p.ds_id) for p in params)

    def partition_grads(self, params_to_release: Any, grad_partitions: Any) -> Any:
        """DeepSpeed's, then the update of each sub-group whose gradient it completed. The
        last step is finished first: its updates may still read the gradient buffer."""
        if getattr(self, "_tail", None) is not None:
            self._tail.drain()
        buffers = super().partition_grads(params_to_release, grad_partitions)
        if getattr(self, "_speculation", None) is not None and self.is_gradient_accumulation_boundary():
            for param in params_to_release:
                i = self._subgroup_of.get(param.ds_id)
                if i is not None:
                    self._reduced[i] += 1
                    if self._reduced[i] == self._awaited[i]:
                        self._speculate(i)
        return buffers

    def _speculate(self, i: int) -> None:
        # Only while the devices keep up (UNFINISHED_SPECULATIONS): backward reduces the last
        # sub-groups first and the next forward gathers the first ones first, so the rest
        # goes to the tail, in the forward's order. A sub-group a GPU updates takes its
        # gradient where it is, at step() (as smartinf.optim's). A resident one is left to the tail, which
        # updates it in place: its speculative update works on a second copy of its states,
        # and on the H100 hosts that was no faster (GPT-2 XL, clip off: 1.08 / 1.42 / 1.49
        # s an iteration with, 1.66 / 1.13 without, alternated; an earlier host 2.12 / 1.15;
        # an H200 host 1.06 with, 1.19 / 1.07 without). SMARTINF_SPECULATE_RESIDENT starts it.
        if self.pipeline.gpu_of(i) is not None or \
                (self.pipeline.resident(i) and not defaults.speculate_resident()) or \
                not self._speculation.may_start(i) or \
                self._speculation.unfinished() >= UNFINISHED_SPECULATIONS:
            return
        hyper = overrides(_rule(self._rule_class, self.optimizer.param_groups[self.sub_group_to_group_id[i]]))
        send, ready = self._host_update(i, hyper, speculative=True)
        self._speculation.start(i, hyper, self._speculated_params[i], send, ready)

    def _host_update(self, i: int, hyper: dict, speculative: bool) -> tuple:
        """Sub-group ``i``'s update through the host buffers of the speculation: its
        ``send(scale)`` and the event its inputs' host copies were recorded after (None: on
        the host already)."""
        flat = self.fp16_partitioned_groups_flat[i]
        grad = self._grad_partition(i)
        out = self._speculated_params[i]
        ready = None
        if self._speculated_grads is not None:  # on the current stream (backward: the reduce one)
            self._speculated_grads[i].copy_(grad, non_blocking=True)
            grad = self._speculated_grads[i]
        if self._split:  # the current params go in with the gradient
            out.copy_(flat, non_blocking=True)
        if self._speculated_grads is not None:
            ready = torch.cuda.Event(blocking=True)  # its waiter sleeps: the cores are the update's
            ready.record()
        return (lambda scale: self._driver.send(i, grad, 0, scale, hyper, out=out, out_dtype=flat.dtype,
                                                speculative=speculative)), ready

    def _take_speculated(self, scale: Optional[float], hyper: list, later: Any = None) -> dict:
        """The speculative updates that hold (the others retracted; with ``later``, those
        that hold are handed to it unfinished); the next step's bookkeeping begins."""
        if self._speculation is None:
            return {}
        self._reduced = [0] * len(self._reduced)
        return self._speculation.take(scale, lambda i: hyper[self.sub_group_to_group_id[i]], later)

    def settle(self) -> None:
        """Finishes the last step now (with ``overlap`` its updates may still run after
        ``step()`` returned: done, params in the model, committed) and retracts updates
        started during a backward since (``step()`` redoes them). Called before the states
        are read or written and before checkpoints; call it before reading params without a
        gather, or to time a step whole."""
        if getattr(self, "_tail", None) is not None:
            self._tail.drain()
        if getattr(self, "_speculation", None) is not None:
            self._speculation.cancel()

    # -- layout: sub-groups live on the devices ---------------------------------------
    def _create_fp16_sub_groups(self, params_group: list) -> list:
        """DeepSpeed's, with the kept-whole (persistent) params in sub-groups of their own
        in front: ``step()`` updates those before it returns (they are small: DeepSpeed's
        ``stage3_param_persistence_threshold``), so they are gathered again with their new
        values however much of the rest finishes during the next forward (``overlap``).
        With overlap or without, so that both group the norm's sums alike. With int8/int4
        states the small tensors (``defaults.SMALL_TENSOR`` elements) come first, in
        sub-groups of their own: their moments stay fp32 (``Pipeline(small_sizes=)``)."""
        self._choose(params_group)
        small = defaults.small_tensor(self.settings.pipeline.state_dtype)
        kinds = [[p for p in params_group if p.ds_numel <= small],
                 [p for p in params_group if p.ds_numel > small and getattr(p, "ds_persist", False)],
                 [p for p in params_group if p.ds_numel > small and not getattr(p, "ds_persist", False)]]
        split = super()._create_fp16_sub_groups  # (no super() inside the comprehension)
        if sum(bool(k) for k in kinds) < 2:
            return split(params_group)
        return [g for k in kinds if k for g in split(k)]

    def _choose(self, params: list) -> None:
        """``"state_dtype": "auto"``: rank 0 asks ``plan.choose`` for its share of the params
        (the host's memory and disks shared by its ranks), every rank takes that choice."""
        if not self.settings.auto:
            return
        world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        chosen = [None]
        if dist.get_rank() == 0:
            given = self.settings.pipeline
            devices = self.settings.rank_devices(0, 0)
            numel = sum(p.ds_numel for p in params) // world
            # with speculation, the host copies of the partitions (params out, and on a GPU
            # gradients in: _start_speculation) hold host memory beside the states
            on_gpu = torch.cuda.is_available()
            partition_copies = (2 if on_gpu else 1) if self._speculates(on_gpu) else 0
            buffers = partition_copies * numel * max(p.element_size() for p in params)
            choice = plan.choose(
                numel,
                [d if isinstance(d, str) else d.path for d in devices],
                bf16_params=all(p.dtype == torch.bfloat16 for p in params), ranks=local,
                if_exists=given.if_exists, host_buffers=buffers,
                gpu_budget=self.settings.gpu_memory_budget,
                **{k: getattr(given, k) for k in self.settings.auto if k != "auto"})
            logger.warning("%s (each of %d ranks)", choice.report(), world)
            chosen = [choice.settings()]
        dist.broadcast_object_list(chosen, src=0)
        self.settings = dataclasses.replace(
            self.settings, auto=(), pipeline=dataclasses.replace(self.settings.pipeline, **chosen[0]))

    def _create_fp32_partitions(self) -> None:
        """Instead of fp32 partitions in memory: one pipeline sub-group per ZeRO sub-group,
        started from the partition's params (or resumed from the devices)."""
        numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        if any(flat is None for flat in self.fp16_partitioned_groups_flat):
            raise ValueError("parameter partitions swapped to NVMe are not supported with smartinf")
        self._offsets = [sum(numels[:i]) for i in range(len(numels))]
        self._persistent_subgroups = [i for i, group in enumerate(self.fp16_groups) if group and all(
            getattr(p, "ds_persist", False) for p in group)]
        small = defaults.small_tensor(self.settings.pipeline.state_dtype)
        self._small = [bool(group) and all(p.ds_numel <= small for p in group)
                       for group in self.fp16_groups]
        gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self._devices = self.settings.rank_devices(dist.get_rank(), gpu)
        self._dirs = [d if isinstance(d, str) else d.path for d in self._devices]
        self._split = self.settings.pipeline.master == "split"
        if self._split and any(f.dtype != torch.bfloat16 for f in self.fp16_partitioned_groups_flat):
            raise ValueError("master='split' keeps the low halves of the fp32 masters of bf16 "
                             "params: enable \"bf16\" in the DeepSpeed config, or use "
                             "master='fp32'")
        self.pipeline = self._all_ranks(lambda: self._open_pipeline(self.settings.pipeline.if_exists))
        self._agree_on_step()
        self._driver = Driver(self.pipeline, max(numels), self._compress)
        # What the partitions held when the step last put them (a split master's devices
        # check their own), and what the kept-whole params held when last gathered: edits
        # since become the masters at the next step.
        self._watch = None if self._split else \
            edits.ParamWatch(lambda i: [self.fp16_partitioned_groups_flat[i]])
        self._whole = edits.ParamWatch(lambda p: [p.data])
        self._attach()
        for i, numel in enumerate(numels):
            placeholder = torch.empty(0, dtype=torch.float32)  # DeepSpeed's bookkeeping only
            ids = self.fp16_partitioned_groups_flat_id[i]
            placeholder.ds_id = f"{ids[0]}_{ids[-1]}"
            self.fp32_partitioned_groups_flat.append(placeholder)
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []

    def _open_pipeline(self, if_exists: str) -> Pipeline:
        rule = stored_rule([_rule(self._rule_class, g) for g in self.optimizer.param_groups])
        numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
        quantized = self.settings.pipeline.state_dtype != "fp32"
        return Pipeline(self._devices, rule,
                        settings=dataclasses.replace(self.settings.pipeline, if_exists=if_exists),
                        subgroup_sizes=[n for n, s in zip(numels, self._small) if not s],
                        small_sizes=[n for n, s in zip(numels, self._small) if s] if quantized else None)

    def _all_ranks(self, action: Any) -> Any:
        """Runs ``action`` on every rank; if it fails on any, it fails on all (a rank left
        waiting in the next collective would hang)."""
        error: Optional[BaseException] = None
        try:
            result = action()
        except (ValueError, OSError) as e:
            error, result = e, None
        failed = torch.tensor([float(error is not None)], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError("another rank could not open its smartinf directories (its error "
                               "says why); nothing was changed here")
        return result

    def _attach(self) -> None:
        """Registers every sub-group; resumed ones put their master weights into the model."""
        for i, flat in enumerate(self.fp16_partitioned_groups_flat):
            master = self._driver.staging.grad(0, torch.float32, flat.numel())
            master.copy_(flat)
            if self.pipeline.add_subgroup(flat.numel(), init=master, small=self._small[i]) != i:
                raise RuntimeError(f"sub-group {i} was registered out of order")
            if self.pipeline.resumed(i):
                self._resumed = True
                if self._split:  # the partitions hold the high halves: loaded with the model
                    continue
                flat.copy_(torch.from_numpy(self.pipeline.read_states(i)["param"]))
                self._unflatten_partitioned_parameters(i)
            if self._watch is not None:
                self._watch.record(i)

    def _agree_on_step(self) -> None:
        """Every rank opens at one durable step: a crash between the ranks' commits leaves
        some one commit ahead, whose shadow copies hold the others' step: they go back to it
        (before any sub-group is attached). Ranks further apart are refused, naming each
        rank's step."""
        world = dist.get_world_size()
        mine = torch.zeros(2 * world, dtype=torch.float64, device=self.device)
        rank = dist.get_rank()
        mine[2 * rank] = float(self.pipeline.durable_step_count)
        mine[2 * rank + 1] = float(self.pipeline.previous_step_count)
        dist.all_reduce(mine, op=dist.ReduceOp.SUM)
        steps, previous = [int(x) for x in mine[0::2].tolist()], [int(x) for x in mine[1::2].tolist()]
        low = min(steps)
        if all(s == low or p == low for s, p in zip(steps, previous)):
            if steps[rank] != low:
                self.pipeline.roll_back_to(low)
                logger.warning("rank %d's directories %s were one commit ahead of the other "
                               "ranks' (step %d; a crash between the ranks' commits): rolled back "
                               "to step %d", rank, self._dirs, steps[rank], low)
            return
        held = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
        why = ("of one copy (copies=1), which holds no earlier step to bring them together"
               if self.settings.pipeline.copies == 1 else "more than one commit apart")
        raise RuntimeError(f"the ranks' directories in {self.settings.devices} hold different "
                           f"durable steps ({held}), {why}: load a checkpoint or use fresh "
                           f"directories")

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

    def _regather_persistent(self) -> None:
        """The kept-whole (persistent) params gathered again from their partitions: an
        all-gather skips params still gathered, so they are released first."""
        if self.persistent_parameters:
            self.persistent_parameters[0].partition(self.persistent_parameters)
            self.persistent_parameters[0].all_gather(self.persistent_parameters)
        for p in self.persistent_parameters:
            self._whole.record(p)

    def initialize_optimizer_states(self) -> None:
        """Nothing to allocate: the states were created on the devices with the sub-groups."""

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """DeepSpeed's ZeRO-3 step (overflow check, loss scale, norm, clipping) with the
        per-sub-group update in the pipeline, N + 1 sub-groups in flight with N devices
        (with ``overlap``: the updates not done during backward finish while the next
        forward runs)."""
        if self._tail is not None:
            self._tail.drain()  # a step without a backward since the last one
        self._pre_step()
        self._adopt(self._edited())  # even if the step is skipped: the caller's weights stand
        self._partition_all_parameters()
        self._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_norm = None
        if not self.overflow:
            scaled_norm = combine_grad_norm_groups(self._get_norm_groups())
            if is_invalid_grad_norm(scaled_norm):
                self.overflow = True
        hyper = [overrides(_rule(self._rule_class, g)) for g in self.optimizer.param_groups]
        if self._loss_scale_update_and_overflow_cleanup():
            self._take_speculated(None, hyper)  # all retracted
            if self._speculation is not None:
                self._speculation.predict(None)
            return  # skipped: the stored states are untouched
        self._global_grad_norm = scaled_norm / self.loss_scale
        self.timers(stage3.OPTIMIZER_STEP_TIMER).start()
        start = time.perf_counter()
        self.zero_grad(set_to_none=True)
        combined = self._combined_scale(scaled_norm)
        scale = float(1.0 / combined)
        if self._tail is None:
            with self.pipeline.step():
                kept = self._take_speculated(scale, hyper)
                for i, out in kept.items():
                    self._put_params(i, out)
                self._driver.run(
                    [i for i in range(len(self.fp16_groups)) if i not in kept],
                    lambda i, b: self._send(i, b, scale, hyper[self.sub_group_to_group_id[i]]),
                    self._finish)
        else:
            self._finish_later(scale, hyper)
        if self._speculation is not None:  # the next step: the same scale, unless clipped
            self._speculation.predict(scale if float(combined) == float(self.loss_scale) else None)
        self.last_step_seconds = time.perf_counter() - start
        self.timers(stage3.OPTIMIZER_STEP_TIMER).stop()
        self._post_step({stage3.OPTIMIZER_STEP_TIMER})

    def _edited(self) -> list[int]:
        """The sub-groups whose partitions the caller changed since the step put them
        (through ``GatheredParameters(modifier_rank=...)``, or in a kept-whole param's
        gathered copy, which is written into its partition here, as DeepSpeed's
        ``partition(has_been_updated=True)`` would)."""
        whole = [p for p in self.persistent_parameters if p.data.numel() == p.ds_numel]
        for p in self._whole.changed(whole):  # (one partitioned since holds its edits there)
            part, flat = p.ds_tensor, p.data.reshape(-1)
            start = part.ds_numel * dist.get_rank(group=self.dp_process_group)
            count = max(0, min(part.ds_numel, p.ds_numel - start))
            part.narrow(0, 0, count).copy_(flat.narrow(0, start, count))
        return [] if self._watch is None else self._watch.changed(range(len(self.fp16_groups)))

    def _adopt(self, edited: list) -> None:
        """The edited partitions become the masters (``ParamWatch.adopt``), as a step of their
        own on every rank at once (the ranks' directories keep one step count)."""
        anywhere = torch.tensor([float(bool(edited))], device=self.device)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if not anywhere.item():
            return
        flats = self.fp16_partitioned_groups_flat
        self._watch.adopt(self.pipeline, edited,
                          lambda i: (flats[i].detach().to("cpu", torch.float32), flats[i].dtype),
                          self._speculation)

    def _finish_later(self, scale: float, hyper: list) -> None:
        """The updates started during backward that held are put; the rest are launched in
        the order the next forward gathers their params, and the step is committed when
        the tail drains."""
        self._tail.begin()
        try:
            # those that held finish in the tail too (their params put when the forward
            # gathers them), in the speculation's buffers, where the others' go
            kept = self._take_speculated(scale, hyper, later=self._tail.start)
            # Sub-groups on this GPU are updated where they are, now (milliseconds), and so
            # are the kept-whole params' (gathered again with their new values before
            # step() returns); the others through the host buffers, while the forward runs.
            self._tail.wait(self._persistent_subgroups)
            rest = [i for i in range(len(self.fp16_groups)) if i not in kept]
            here = [i for i in rest if i in self._persistent_subgroups or (
                self._in_place(i) and not self.fp16_partitioned_groups_flat[i].is_cpu)]
            self._driver.run(here, lambda i, b: self._send(i, b, scale, hyper[self.sub_group_to_group_id[i]]),
                             self._finish)
            for i in rest:
                if i not in here:
                    send, ready = self._host_update(i, hyper[self.sub_group_to_group_id[i]],
                                                    speculative=False)
                    self._tail.start(i, self._speculation.launch(partial(send, scale), ready))
        except BaseException:
            self._tail.abort()
            raise

    def _post_step(self, timer_names: Any) -> None:
        """DeepSpeed's (the kept-whole params gathered again: their sub-groups are done),
        then what they hold is what an edit is told from."""
        super()._post_step(timer_names)
        for p in self.persistent_parameters:
            self._whole.record(p)

    def _combined_scale(self, total_norm: Any) -> Any:
        """What DeepSpeed divides the gradients by: loss scale times the clip coefficient."""
        combined = self.loss_scale
        if self.clip_grad > 0.0:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined = torch.clamp(clip, min=1.0) * self.loss_scale
        return combined

    def _grad_partition(self, i: int) -> torch.Tensor:
        flat = self.fp16_partitioned_groups_flat[i]
        return self.grad_partitions_flat_buffer.narrow(0, self._offsets[i], flat.numel())

    def _send(self, i: int, buffer: int, scale: float, hyper: dict) -> Any:
        flat = self.fp16_partitioned_groups_flat[i]
        return self._driver.send(i, self._grad_partition(i), buffer, scale, hyper,
                                 out=flat if self._in_place(i) else None, out_dtype=flat.dtype,
                                 params=flat if self._split else None)

    def _in_place(self, i: int) -> bool:
        """Whether the device writes sub-group ``i``'s params into its partition itself: one
        in host memory, or in the memory of the GPU that updates it (but a split master's,
        which are checksummed on the host)."""
        flat = self.fp16_partitioned_groups_flat[i]
        return flat.is_cpu or (not self._split and self.pipeline.gpu_of(i) == flat.device.index)

    def _finish(self, i: int, future: Any, buffer: int) -> None:
        future.wait()
        flat = self.fp16_partitioned_groups_flat[i]
        if self._in_place(i):
            self._unflatten_partitioned_parameters(i)
            self._put(i)
        else:
            self._put_params(i, self._driver.out(buffer, flat.dtype, flat.numel()))

    def _put_params(self, i: int, params: torch.Tensor) -> None:
        """Sub-group ``i``'s updated params (a host buffer) into its partition."""
        flat = self.fp16_partitioned_groups_flat[i]
        flat.copy_(params, non_blocking=True)
        if not flat.is_cpu:
            torch.cuda.current_stream(flat.device).synchronize()  # before the buffer is reused
        self._unflatten_partitioned_parameters(i)
        self._put(i)

    def _put(self, i: int) -> None:
        """Sub-group ``i``'s partition holds what the step put: an edit is told from it."""
        if self._watch is not None:
            self._watch.record(i)

    # -- DeepSpeed's accessors of the fp32 masters and optimizer states -------------------
    def _get_fp32_opt_state_partition(self, param: Any, release_swap_buffers: bool,
                                      optim_state_key: Optional[str] = None) -> tuple:
        """This rank's part of ``param``'s master (or optimizer state), from the devices'
        committed step: what DeepSpeed's safe_get_*/safe_set_* read and write in place."""
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
        self.settle()
        with self.pipeline.step():
            for i, flat in enumerate(self.fp16_partitioned_groups_flat):
                self.pipeline.write_master(i, flat.detach().to("cpu", torch.float32))
        for i in range(len(self.fp16_groups)):
            self._put(i)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """DeepSpeed's, with the devices' committed masters in place of the empty fp32
        partitions, so that zero_to_fp32 consolidates the true fp32 weights (``save_checkpoint``
        has taken params edited since the last step as the masters: ``save_states``)."""
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
        self.pipeline.close()
        restore_devices(directory, self._dirs)
        self.pipeline = self._driver.pipeline = self._open_pipeline("resume")
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
        return self._driver.traffic()

    @property
    def overlap_stats(self) -> dict[str, float]:
        """With ``overlap``, so far: ``deferred_updates`` (updates finished after ``step()``
        returned), ``gather_waits`` (gathers that waited for one) and ``gather_wait_s``
        (seconds they waited)."""
        tail = getattr(self, "_tail", None)
        if tail is None:
            return {}
        return {"deferred_updates": tail.deferred, "gather_waits": tail.waits,
                "gather_wait_s": tail.wait_seconds}

    def destroy(self) -> None:
        self.settle()
        if getattr(self, "_speculation", None) is not None:
            self._speculation.close()
        if self.pipeline is not None:
            self.pipeline.close()
        super().destroy()


class SmartInfEngine(DeepSpeedEngine):
    """DeepSpeed's engine with :class:`SmartInfinityStage3` and checkpoints that carry the
    smartinf device directories."""

    def _configure_zero_optimizer(self, optimizer: Any) -> Any:
        with _named(stage3, "DeepSpeedZeroOptimizer_Stage3", SmartInfinityStage3):
            return super()._configure_zero_optimizer(optimizer)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Any:
        """DeepSpeed's checkpoint plus ``<save_dir>/<tag>/smartinf/rank<R>``: the device
        directories, copied first so a ``latest`` tag never names a checkpoint without them
        (after DeepSpeed's checks of the arguments)."""
        if not save_dir:  # DeepSpeed's checks, before anything is copied
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        self._checkpoint_tag_validation(tag)
        self.optimizer.save_states(self._states_dir(save_dir, tag))
        dist.barrier()
        return super().save_checkpoint(save_dir, tag, client_state or {}, save_latest,
                                       exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
        """DeepSpeed's load, then the device directories of the same tag (unless only the
        module is loaded). The last step is finished first: its updates would land over the
        loaded weights."""
        self.optimizer.settle()
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if os.path.isfile(latest):
                with open(latest) as f:
                    tag = f.read().strip()
        path, client_state = super().load_checkpoint(
            load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
            load_module_only, custom_load_fn)
        if path is not None and load_optimizer_states and not load_module_only:
            states = self._states_dir(load_dir, str(tag))
            if not os.path.isdir(states):
                raise FileNotFoundError(f"{states} does not exist: the checkpoint was not saved "
                                        f"by smartinf.integrations.deepspeed (or with another "
                                        f"world size)")
            self.optimizer.restore_states(states)
            dist.barrier()
        return path, client_state

    def _states_dir(self, root: str, tag: str) -> str:
        return rank_directory(os.path.join(root, tag, "smartinf"), dist.get_rank())


@contextlib.contextmanager
def _named(module: Any, name: str, value: Any) -> Iterator[None]:
    """Gives ``module.name`` another value for the duration of a call (the engine looks
    its classes up by name at construction)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def initialize(*args: Any, config: Any = None, **kwargs: Any) -> tuple:
    """``deepspeed.initialize`` with the ZeRO-3 optimizer step on smartinf devices, as
    configured by the ``"smartinf"`` block of the config (``config=``, ``config_params=``
    or ``args.deepspeed_config``: a dict or a JSON path).
    Returns ``(engine, optimizer, dataloader, lr_scheduler)`` like DeepSpeed."""
    optimizer = kwargs.get("optimizer")
    if isinstance(optimizer, StorageOptimizer):
        optimizer.close()
        raise ValueError(
            f"a smartinf.optim.{type(optimizer).__name__} was given to DeepSpeed, whose ZeRO-3 "
            f"partitions the params it would update: give DeepSpeed a torch optimizer (or an "
            f'"optimizer" block in its config) and put the devices in the config\'s "{CONFIG_KEY}" '
            f'block, e.g. "{CONFIG_KEY}": {{"devices": {[d.path for d in optimizer.pipeline.devices]}}}'
            f' (with the transformers Trainer: its default optimizer, no optimizer_cls_and_kwargs)')
    if config is None and "config_params" in kwargs:
        config = kwargs.pop("config_params")
    ds_args = kwargs.get("args", args[0] if args else None)
    in_args = None  # the argparse way: the config only in args.deepspeed_config
    if config is None:
        in_args = next((name for name in ("deepspeed_config", "deepscale_config")
                        if getattr(ds_args, name, None) is not None), None)
        config = getattr(ds_args, in_args) if in_args else None
    if config is None:
        raise ValueError("pass the DeepSpeed config (a dict or a JSON path) as config= or "
                         "args.deepspeed_config")
    if not isinstance(config, dict):
        config = deepspeed.load_ds_config(config)  # a path, or base64 JSON, as DeepSpeed reads it
    check_config(config)
    config = _with_torch_adam(config)
    config, kwargs = _with_lion_params(config, args, kwargs)
    # DeepSpeed gets the checked config as config= (and refuses a second one in args)
    with _named(deepspeed, "DeepSpeedEngine", SmartInfEngine), \
            _named(ds_args, in_args, None) if in_args else contextlib.nullcontext():
        return _deepspeed_initialize(*args, config=config, **kwargs)


class LionParams(torch.optim.Optimizer):
    """The base optimizer of a config's ``"Lion"`` block: it only holds the param groups'
    hyper-parameters (the update runs on the devices), where DeepSpeed would build its
    FusedLion, a CUDA op (none on CPU)."""

    def __init__(self, params: Any, lr: float = update_rules.Lion.lr,
                 betas: tuple = update_rules.Lion.betas,
                 weight_decay: float = update_rules.Lion.weight_decay,
                 maximize: bool = False) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      maximize=maximize))

    def step(self, closure: Any = None) -> None:  # pragma: no cover - never called
        raise RuntimeError("LionParams holds hyper-parameters; the devices run the update")


def _with_lion_params(config: dict, args: tuple, kwargs: dict) -> tuple:
    """A config "Lion" block becomes a LionParams client optimizer (see there)."""
    opt = config.get("optimizer")
    if not (isinstance(opt, dict) and str(opt.get("type", "")).lower() == "lion"):
        return config, kwargs
    if kwargs.get("optimizer") is not None:
        raise ValueError('the config has an "optimizer" block and an optimizer was passed too')
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    params = kwargs.get("model_parameters")
    params = list(params) if params is not None else list(model.parameters())
    kwargs = dict(kwargs, model_parameters=params,
                  optimizer=LionParams(params, **opt.get("params", {})))
    config = {k: v for k, v in config.items() if k != "optimizer"}
    config["zero_allow_untested_optimizer"] = True  # it never steps: the devices do
    return config, kwargs


def _with_torch_adam(config: dict) -> dict:
    """The base optimizer only holds hyper-parameters here; torch's Adam(W) does that
    without DeepSpeed's FusedAdam, which would compile a CUDA op on first use."""
    opt = config.get("optimizer")
    if isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        params = dict(opt.get("params", {}))
        params.setdefault("torch_adam", True)
        config = dict(config, optimizer=dict(opt, params=params))
    return config
