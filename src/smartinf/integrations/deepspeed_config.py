"""The DeepSpeed config as smartinf reads it: the ``"smartinf"`` block (``Settings``), the
ZeRO options and the ``"optimizer"`` block it runs (``check_config``), the update rule of
DeepSpeed's base optimizer (``_rule_class``, ``_rule``), and the base optimizers it gives
DeepSpeed in place of ones that would build CUDA ops only to hold hyper-parameters
(``LionParams``, torch's Adam)."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from deepspeed import comm as dist
from deepspeed.runtime.zero.config import get_zero_config

from smartinf import _native, defaults, update_rules
from smartinf.planning import gpu_cores, host_states, plan, space, twins
from smartinf.planning.gpu_budget import free_and_total, held as held_gpu_budget
from smartinf.pipeline.checkpoint import manifest_fields
from smartinf.pipeline.compress import TopK
from smartinf.pipeline.devices import GPU_DIRECTORY, rank_directory, with_gpu
from smartinf.step.driver import rule_for
from smartinf.pipeline.settings import KEYWORDS as PIPELINE_KEYWORDS, PipelineSettings
from smartinf.integrations import deepspeed_hook

logger = logging.getLogger("smartinf")
CONFIG_KEY = deepspeed_hook.CONFIG_KEY


@dataclass
class Settings:
    """The ``"smartinf"`` block of a DeepSpeed config."""

    devices: list
    pipeline: PipelineSettings  # the rest of the block but compress and gpu, checked
    compress: Optional[dict] = None
    # "gpu": {"memory_budget": ...}: the rank's GPU as a device; "auto": what its memory
    # leaves (``gpu_budget``), less ``gpu_reserve`` ("gpu": {"reserve": ...}; None: a share)
    gpu_memory_budget: Union[int, str] = 0
    gpu_twins: Union[bool, str, None] = None  # "gpu": {"twins": ...}: CudaDevice's twins
    gpu_reserve: Optional[int] = None
    # "gpu": {"host_states": true}: the memory tier (memory_budget) is updated on the GPU, its
    # states crossing PCIe (CudaDevice(memory="host")); "auto" (the default with a "gpu" block):
    # where faster than the cores (host_states.gpu_takes_host_states); a share from 0 to 1: that
    # share, the rest on the cores. Its bytes, once moved (``with_host_states_on_gpu``): gpu_host_budget
    gpu_host_states: Union[bool, str, float] = False
    gpu_host_budget: int = 0
    # A budget of "auto" sized here (with_gpu_budget): ``fitted_to`` then gives the host
    # what the GPU leaves of the rank's states, and the GPU a host twin where one fits.
    gpu_sized: bool = False
    # the placement settings given (block or environment: kept; "auto": the format chosen too)
    planned: Optional[tuple] = None  # (None: placed already)

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
        if "gpu" not in block and torch.cuda.is_available():
            gpu = {"memory_budget": "auto"}  # (a rank's params are on its GPU: states there first)
        if gpu is not None and (not isinstance(gpu, dict)
                                or not ({"memory_budget", "host_states"} & set(gpu))
                                or not set(gpu) <= {"memory_budget", "twins", "reserve", "host_states"}
                                or not (isinstance(gpu.get("twins"), (bool, type(None)))
                                        or gpu.get("twins") == "host")):
            raise ValueError(f'"{CONFIG_KEY}.gpu" must be a dict with "memory_budget" (bytes of '
                             f'the rank\'s GPU memory for states, e.g. "8GiB", or "auto") and '
                             f'optionally "twins" (true, false, "host": a host copy of the budget '
                             f'that durable commits write from, or null: chosen) and, '
                             f'with "auto", "reserve" (bytes left to the activations), and/or '
                             f'"host_states" (where the states the memory_budget keeps in host '
                             f'memory are updated); got {gpu!r}')
        if gpu:
            host_states.check(gpu.get("host_states", "auto"), f'"{CONFIG_KEY}.gpu.host_states"')
        try:
            gpu_auto = bool(gpu) and gpu.get("memory_budget") == "auto"
            gpu_budget = "auto" if gpu_auto else \
                defaults.parse_bytes(gpu.get("memory_budget", 0), "gpu.memory_budget") if gpu else 0
            if gpu and "reserve" in gpu and not gpu_auto:
                raise ValueError('"gpu.reserve" sizes a "memory_budget" of "auto"; give one or '
                                 'the other')
            gpu_reserve = defaults.parse_bytes(gpu["reserve"], "gpu.reserve") \
                if gpu and "reserve" in gpu else None
        except (TypeError, ValueError) as e:
            raise ValueError(f'the "{CONFIG_KEY}" config block: {e}') from None
        given = {k: block[k] for k in pipeline_keys if k in block}
        placed = {**defaults.placement_given(), **given}
        if given.get("state_dtype") == "auto":  # chosen when the partition's size is known
            given["state_dtype"] = "fp32"  # (``choose``, below)
            placed["auto"] = placed.pop("state_dtype")
        try:
            pipeline = PipelineSettings.resolve(**{"if_exists": "error", **given})
        except (TypeError, ValueError) as e:
            raise ValueError(f'the "{CONFIG_KEY}" config block: {e}') from None
        return cls(devices=devices, pipeline=pipeline, compress=compress,
                   gpu_memory_budget=gpu_budget, gpu_twins=(gpu or {}).get("twins"),
                   gpu_reserve=gpu_reserve, gpu_host_states=gpu.get("host_states", "auto") if gpu else False,
                   planned=tuple(k for k in ("auto", "state_dtype", "master", "memory_budget",
                                             "commit_every", "commit_waits", "copies", "overlap")
                                 if k in placed))

    def measures_gpu_budget(self, rank: int) -> bool:
        """Whether a budget of ``"auto"`` is sized by the first step, from what the first
        iteration took of this rank's GPU (``measured_gpu_budget``): with no ``"reserve"``
        given, a GPU here, and no run held in rank ``rank``'s directory to resume (whose
        budget is what its GPU's states take: ``held_gpu_budget``)."""
        return self.gpu_memory_budget == "auto" and self.gpu_reserve is None and \
            torch.cuda.is_available() and (self.pipeline.if_exists == "overwrite" or
                                           manifest_fields(rank_directory(self.devices[0], rank)) is None)

    def with_gpu_budget(self, params_bytes: int, rank: int = 0,
                        measured: Optional[int] = None) -> "Settings":
        """A budget of ``"auto"`` sized: ``measured`` (by the first step), what the states of
        a run that rank ``rank``'s directory holds take of its GPU (``held_gpu_budget``), or
        from this rank's GPU now (``gpu_budget``), given the bytes DeepSpeed allocates on it
        after the optimizer is built (its gradient buffer and buckets). Twins, unless asked
        for, are chosen by ``fitted_to``."""
        if self.gpu_memory_budget != "auto":
            return self
        held = None if self.pipeline.if_exists == "overwrite" else \
            held_gpu_budget(os.path.join(rank_directory(self.devices[0], rank), GPU_DIRECTORY))
        if held is not None and self.gpu_twins is True:
            held *= 2  # (each resident sub-group with room for its twin)
        budget = measured if measured is not None else held if held is not None else \
            gpu_budget(params_bytes, self.gpu_reserve)
        return dataclasses.replace(self, gpu_memory_budget=budget, gpu_sized=True)

    def fitted_to(self, numels: Sequence[int], arrays: int, rank: int = 0) -> "Settings":
        """After a budget of ``"auto"`` is sized (``with_gpu_budget``, ``with_host_states_on_gpu``),
        for a rank whose sub-groups (not the small tensors') have ``numels`` params, states
        of ``arrays`` fp32 arrays: the GPU's budget holds whole sub-groups first, as the
        pipeline places them; the host's budget (the memory tier, the GPU's in host memory,
        or both in their shares) shrinks to what is left, with room for its twins (the plan
        sized it for all of the states; at least 1 MiB: the device list stays as it was). Twins
        not asked for: a host twin of what the GPU holds where the host's memory takes it
        (``twins.host_twin_fits``; the GPU's budget then shrinks to that), else none (the
        budget's room for states first)."""
        if not self.gpu_sized:
            return self
        p = self.pipeline
        held = (manifest_fields(rank_directory(self.devices[0], rank)) or {}).get("chunk", "")
        # the pipeline's chunk (pipeline._default_chunk): given, the held run's, or a GPU's
        chunk = p.chunk or defaults.chunk() or (int(held) if held.isdigit() else defaults.GPU_CHUNK)

        from smartinf.planning import placement  # (its formulas; not at import, as twins does)
        per = 2 if self.gpu_twins is True else 1
        sizes = [_native.copy_bytes(p.state_dtype, p.master, chunk, n, arrays) for n in numels]
        tiers = placement.fill(sizes, {"gpu": self.gpu_memory_budget}, {"gpu": per})
        used = sum(per * b for b, t in zip(sizes, tiers) if t == "gpu")
        host_need = sum(b for b, t in zip(sizes, tiers) if t != "gpu")
        holders = len(self.devices)
        cores = (p.memory_budget if isinstance(p.memory_budget, int) else 0) * holders
        host = self.gpu_host_budget + cores
        kept = max(min(host, 2 * host_need), 1 << 20) if host else 0
        if kept < host:
            logger.info("smartinf: rank %d's host budget %d bytes, not %d: the GPU's budget holds "
                        "all but %d bytes of its states", rank, kept, host, host_need)
        on_gpu = max(kept * self.gpu_host_budget // host, 1 << 20) if self.gpu_host_budget else 0
        fitted = dataclasses.replace(self, gpu_host_budget=on_gpu, pipeline=dataclasses.replace(
            p, memory_budget=-(-(kept - on_gpu) // holders)))
        if self.gpu_twins is not None:
            return fitted
        fits, why = twins.host_twin_fits(used, kept)
        logger.info("smartinf: rank %d's GPU budget: %s", rank, why)
        if fits and used and p.overlap:
            return dataclasses.replace(fitted, gpu_twins="host", gpu_memory_budget=used)
        return dataclasses.replace(fitted, gpu_twins=False)

    def with_host_states_on_gpu(self, rank: int = 0) -> "Settings":
        """``"host_states"``: the memory tier's bytes (``memory_budget`` on each directory)
        move to the GPU's device for states in host memory, the directories keeping none, or
        with a share what the GPU leaves (``host_states.host_states_budget``: ``"auto"`` where
        faster, or where rank ``rank``'s directory holds a run with them there)."""
        if self.gpu_host_budget:
            return self
        given = self.pipeline
        budget = host_states.host_states_budget(self.gpu_host_states, given.state_dtype, given.master,
                                         given.memory_budget, len(self.devices),
                                         rank_directory(self.devices[0], rank))
        rest = host_states.cores_keep(given.memory_budget, len(self.devices), budget)
        return dataclasses.replace(self, gpu_host_states=bool(budget), gpu_host_budget=budget,
                                   pipeline=dataclasses.replace(given, memory_budget=rest))

    def rank_devices(self, rank: int, gpu: int) -> list:
        """Each rank keeps its partition's states in its own sub-directories; with a GPU
        budget (of its memory, or of host memory it updates) its GPU (``gpu``) is a device
        in front of them."""
        dirs = [rank_directory(d, rank) for d in self.devices]
        return with_gpu(dirs, self.gpu_memory_budget or None, gpu, self.gpu_twins,
                        self.gpu_host_budget) if self.gpu_memory_budget or self.gpu_host_budget else dirs

    def rank_paths(self, rank: int, gpu: int) -> list[str]:
        """The directories of rank ``rank``'s devices (``rank_devices``), known before a GPU
        budget of ``"auto"`` is sized: which devices there are does not depend on its size."""
        sized = dataclasses.replace(self, gpu_memory_budget=1) if self.gpu_memory_budget == "auto" else self
        return [d if isinstance(d, str) else d.path for d in sized.rank_devices(rank, gpu)]

    def top_k(self) -> Optional[TopK]:
        if self.compress is None:
            return None
        c = dict(self.compress)
        if "value_dtype" in c:
            c["value_dtype"] = getattr(torch, str(c["value_dtype"]).replace("torch.", ""))
        return TopK(**c)


def gpu_budget(later_bytes: int, reserve: Optional[int] = None) -> int:
    """Bytes of the current GPU's memory for states: what is free (torch's cached blocks
    given back first), less ``later_bytes`` that the training allocates after the optimizer
    is built, less ``reserve`` for the activations (None: ``defaults.GPU_RESERVE_SHARE`` of
    the GPU's memory, ``gpu_budget.free_and_total``'s). 0 where nothing is left; logged with
    its terms."""
    if not torch.cuda.is_available():
        raise ValueError('"gpu": {"memory_budget": "auto"} sizes a budget on this rank\'s CUDA '
                         'GPU, and none is visible here: remove the "gpu" block')
    torch.cuda.empty_cache()
    free, total = free_and_total()
    reserve = int(total * defaults.GPU_RESERVE_SHARE) if reserve is None else reserve
    budget = max(0, free - later_bytes - reserve)
    logger.warning("smartinf: a GPU budget of %.1f GB for states: %.1f GB free, less %.1f GB "
                   "DeepSpeed allocates later (gradients, buckets), less %.1f GB for the "
                   "activations (\"gpu\": {\"reserve\": ...})", budget / 1e9, free / 1e9,
                   later_bytes / 1e9, reserve / 1e9)
    return budget


def for_this_gpu(settings: Settings, later_bytes: int, gpu: int,
                 measured: Optional[int] = None, numels: Sequence[int] = (),
                 arrays: int = 3) -> Settings:
    """Where this rank has a GPU: its budget sized if ``"auto"`` (``Settings.with_gpu_budget``;
    ``measured`` by the first step; then ``fitted_to`` the rank's sub-groups, ``numels`` of
    ``arrays`` state arrays) and its update threads on the cores nearest it (``gpu_cores``),
    before its pipeline opens."""
    rank = dist.get_rank()
    if not torch.cuda.is_available():  # (refuses "auto" and "host_states" clearly)
        return settings.with_gpu_budget(later_bytes, rank).with_host_states_on_gpu(rank)
    cores = gpu_cores.set_rank_cores(int(os.environ.get("LOCAL_RANK", "0")),
                                     defaults.local_ranks(), gpu)
    if cores:
        logger.info("smartinf: rank %d's update on cores %s, its GPU's NUMA node's", rank, cores)
    return settings.with_gpu_budget(later_bytes, rank, measured).with_host_states_on_gpu(
        rank).fitted_to(numels, arrays, rank)


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



def choose(settings: Settings, params: list, speculates: Callable[[bool], bool]) -> Settings:
    """The placement the block leaves out (the memory tier, commit interval and copies; with
    ``"state_dtype": "auto"`` the format and master too; else fp32 states and, unless given,
    an fp32 master): rank 0 asks ``plan.choose`` for its share of the params (the host's
    memory and disks shared by its ranks), every rank takes that choice.
    ``speculates(on_gpu)``: whether updates start during backward (their host copies of
    the partitions hold host memory beside the states)."""
    if settings.planned is None:
        return settings
    release_cached_pinned()  # (every rank: each measures its host's memory before opening)
    world, local = dist.get_world_size(), defaults.local_ranks()
    chosen = [None]
    auto = "auto" in settings.planned
    if dist.get_rank() == 0:
        given = settings.pipeline
        numel = sum(p.ds_numel for p in params) // world
        on_gpu = torch.cuda.is_available()
        # ZeRO-3's offload_param: the partitions in host memory, already taken from it
        on_host = on_gpu and all(getattr(p, "ds_tensor", p).device.type == "cpu" for p in params)
        partition_copies = _partition_copies(settings.gpu_host_states, on_gpu, speculates)
        choice = plan.choose(
            numel, [rank_directory(d, 0) for d in settings.devices],
            bf16_params=all(p.dtype == torch.bfloat16 for p in params), ranks=local,
            if_exists=given.if_exists,
            host_buffers=int(partition_copies * numel * max(p.element_size() for p in params)),
            gpu_budget=0 if settings.gpu_memory_budget == "auto" else settings.gpu_memory_budget,
            gpu_budget_later=settings.gpu_memory_budget == "auto",
            state_dtype=None if auto else given.state_dtype,
            master=None if auto and "master" not in settings.planned else given.master,
            processes=world, **{k: getattr(given, k) for k in settings.planned
                                if k not in ("auto", "state_dtype", "master")})
        held = (f"; the params' partitions in host memory (offload_param), taken before this "
                f"choice: {space._size(numel * params[0].element_size())} a rank") if on_host else ""
        logger.warning("%s (each of %d ranks)%s", choice.report(), world, held)
        chosen = [choice.settings()]
    dist.broadcast_object_list(chosen, src=0)
    return dataclasses.replace(settings, planned=None,
                               pipeline=dataclasses.replace(settings.pipeline, **chosen[0]))


def release_cached_pinned() -> None:
    """torch's unoccupied cached page-locked host blocks given back to the system before the
    host's memory is measured for a choice. ZeRO-3's ``offload_param`` pins each param's
    partition, then copies them all into flat pinned buffers; the partitions it frees stay in
    torch's cache, counted as taken (2 B a param: 25 GB at 13 B, which left a 13 B model's
    states too little host memory to fit)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return  # (no pinned block can be cached)
    release = getattr(torch.accelerator, "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)  # (torch before the public call)
    if release is not None:
        release()


def _partition_copies(gpu_host_states: "bool | str | float", on_gpu: bool,
                      speculates: Callable[[bool], bool]) -> float:
    """Host copies of each partition a rank's run holds beside the states (the overlap's,
    ``deepspeed_overlap._start_speculation``): where updates start during backward, params
    out and, on a GPU, gradients in; none where the GPU updates the sub-groups in place
    (its states in host memory it updates): their gradients stay in its memory and their
    params go into their partitions, in its memory or, with ``offload_param``, the host's.
    With a share of them on the GPU, copies of the cores' part only."""
    gpu_share = float(on_gpu) if gpu_host_states == "auto" else \
        float(gpu_host_states) if on_gpu or gpu_host_states is True else 0.0
    return ((2 if on_gpu else 1) if speculates(on_gpu) else 0) * (1 - gpu_share)

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
    if "amsgrad" in params and kind in update_rules.RULES and \
            not hasattr(update_rules.RULES[kind], "amsgrad"):
        raise ValueError(f'"optimizer.params.amsgrad" is an option of Adam and AdamW (a fourth '
                         f'state array); the {block["type"]} block has none: remove it')
    if kind == "lion":
        unknown = sorted(set(params) - set(LION_KEYS))
        if unknown:
            raise ValueError(f'"optimizer.params" {unknown} of the Lion block: smartinf\'s Lion '
                             f'takes {list(LION_KEYS)} (its states are fp32 on the devices): '
                             f'remove {"it" if len(unknown) == 1 else "them"}')


# The update rule for DeepSpeed's base optimizer: its Adam variants and torch's Adam(W)
# by their decoupled-weight-decay flag; the others by each rule's ``base_optimizers``
# (class names, a subclass's too); any other optimizer is refused. amsgrad and maximize
# come with the param groups (rule_for).
def _rule_class(optimizer: torch.optim.Optimizer) -> type:
    name = type(optimizer).__name__
    if name in ("DeepSpeedCPUAdam", "FusedAdam", "ZenFlowCPUAdam"):
        decoupled = bool(getattr(optimizer, "adamw_mode", getattr(optimizer, "adam_w_mode", True)))
        return update_rules.AdamW if decoupled else update_rules.Adam
    if isinstance(optimizer, torch.optim.Adam):  # torch's AdamW is an Adam subclass
        decoupled = isinstance(optimizer, torch.optim.AdamW) or \
            optimizer.defaults.get("decoupled_weight_decay", False)
        return update_rules.AdamW if decoupled else update_rules.Adam
    rules = list(dict.fromkeys(update_rules.RULES.values()))
    for rule in rules:
        if any(c.__name__ in getattr(rule, "base_optimizers", ()) for c in type(optimizer).__mro__):
            return rule
    raise ValueError(f"smartinf runs {', '.join(r.__name__ for r in rules)}; the DeepSpeed "
                     f"optimizer is {name}")


def _rule(rule_class: type, group: dict) -> Any:
    """The update rule with a param group's current hyper-parameters (read every step)."""
    if not group.get("bias_correction", True):
        raise ValueError("bias_correction=False is not supported by smartinf")
    return rule_for(rule_class, group)


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


def _with_unsynchronized_timer(config: dict) -> dict:
    """DeepSpeed's throughput timer synchronizes the whole device at each forward's start and
    each step's end (``"timers": {"throughput": {"synchronized": true}}``, its default), which
    waits for the updates a GPU finishes on its own streams while the next forward runs
    (``overlap``): unsynchronized unless the config says (its figures then read the host's
    clock, which DeepSpeed's docs call accurate enough in many cases)."""
    timers = config.get("timers") or {}
    throughput = dict(timers.get("throughput") or {})
    if throughput.get("synchronized", False):
        logger.warning('smartinf: "timers": {"throughput": {"synchronized": true}} waits for the '
                       "GPU's updates at every forward and step, so none finishes while the "
                       "next forward runs: leave it out to let them")
    if "synchronized" in throughput:
        return config
    return dict(config, timers=dict(timers, throughput=dict(throughput, synchronized=False)))
