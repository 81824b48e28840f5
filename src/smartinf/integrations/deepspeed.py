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

The code: ``deepspeed_config`` (the blocks of the config), ``deepspeed_zero3`` (the
optimizer: layout and step), ``deepspeed_overlap`` (updates during backward and the step's
tail), ``deepspeed_states`` (DeepSpeed's accessors, checkpoints, the ranks' agreement),
``deepspeed_offload`` (``engine.offload_states()`` / ``reload_states()``); this module, the
engine and ``initialize``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

try:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import stage3
except ImportError as e:  # pragma: no cover - exercised only without DeepSpeed
    raise ImportError("smartinf.integrations.deepspeed needs DeepSpeed: "
                      "pip install 'smartinf[deepspeed]'") from e

from smartinf.pipeline.devices import rank_directory
from smartinf.optim import _StorageOptimizer as StorageOptimizer
from smartinf.integrations import deepspeed_hook
from smartinf.integrations.deepspeed_config import (CONFIG_KEY, LionParams, Settings,
                               _with_unsynchronized_timer, check_config)
from smartinf.integrations.deepspeed_zero3 import SmartInfinityStage3

# DeepSpeed's own initialize, taken now: a user who sets deepspeed.initialize to ours by
# hand must not make ours call itself.
_deepspeed_initialize = deepspeed_hook.original_initialize(deepspeed)

__all__ = ["initialize", "SmartInfEngine", "SmartInfinityStage3", "Settings", "LionParams",
           "check_config"]


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
    config = _with_unsynchronized_timer(_with_torch_adam(config))
    config, kwargs = _with_lion_params(config, args, kwargs)
    # DeepSpeed gets the checked config as config= (and refuses a second one in args)
    with _named(deepspeed, "DeepSpeedEngine", SmartInfEngine), \
            _named(ds_args, in_args, None) if in_args else contextlib.nullcontext():
        return _deepspeed_initialize(*args, config=config, **kwargs)
