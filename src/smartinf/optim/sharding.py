"""``smartinf.optim`` over FSDP2-sharded params (``torch.distributed.fsdp.fully_shard``): each
param is a DTensor sharded on dim 0 over a 1-D mesh, its gradient too (FSDP2's
reduce-scatter sets it before the param's post-accumulate-grad hook runs). The optimizer
keeps states for the rank's own shard only (``local``: the tensor sharing the param's storage,
possibly empty), in the rank's own directories; what must hold across ranks goes through the
mesh's process group (``Sharding``): the gradients' norm and their inf/NaN, so every rank
clips by the same coefficient and skips the same steps, and the durable step every rank
opens at. ``state_dict()`` gives each state as a DTensor of the param's global shape and
placements, so ``torch.distributed.checkpoint`` saves it sharded and loads it at another
world size. Without FSDP2, the ranks of the default process group (``Ranks.default``: DDP,
any torchrun job of several processes) agree on that step through the same sum.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch


def _dtensor() -> Any:
    """torch's DTensor module where it is imported, else None: no DTensor can exist before
    it is, and importing it costs every process ~0.9 s (read here, not imported)."""
    return sys.modules.get("torch.distributed.tensor")


def is_sharded(t: Any) -> bool:
    module = _dtensor()
    return module is not None and isinstance(t, module.DTensor)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The elements of ``t`` this rank holds: a DTensor's local shard (the same storage), else
    ``t`` itself."""
    return t._local_tensor if is_sharded(t) else t


def announced(params: Sequence[torch.Tensor]) -> bool:
    """Whether FSDP2 will shard ``params`` after the optimizer is made: Accelerate's
    ``prepare()`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (the Trainer's
    ``fsdp`` too) takes an optimizer made over the whole model, shards the model and puts
    the sharded params into the optimizer's groups. Only Accelerate's state says so (read
    where Accelerate is imported already)."""
    state = sys.modules.get("accelerate.state")
    if state is None or not params or any(is_sharded(p) for p in params):
        return False
    shared = state.AcceleratorState._shared_state
    plugin = shared.get("fsdp_plugin")
    return shared.get("distributed_type") == "FSDP" and \
        plugin is not None and getattr(plugin, "fsdp_version", 1) == 2


class Ranks:
    """A process group's ranks and what they sum over it, on the device of its collectives
    (inactive: no group, a process alone)."""

    rank, world, device = 0, 1, torch.device("cpu")  # (inactive)

    def __init__(self, group: Any = None, device: Optional[torch.device] = None) -> None:
        self.group = group
        if group is not None:
            self.rank = torch.distributed.get_rank(group)
            self.world = torch.distributed.get_world_size(group)
            self.device = device

    @classmethod
    def default(cls) -> "Ranks":
        """The default process group's ranks where ``torch.distributed`` runs several (DDP,
        any torchrun job): they open one run's directories, ``rank%05d`` each; else
        inactive. nccl reduces CUDA tensors (on this rank's GPU), gloo (and a
        ``"cpu:gloo,cuda:nccl"`` pair) CPU ones."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return cls()
        group = dist.group.WORLD
        return cls(group, torch.device("cuda", torch.cuda.current_device())
                   if str(dist.get_backend(group)) == "nccl" else torch.device("cpu"))

    @property
    def active(self) -> bool:
        return self.group is not None

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, on the device of the group's collectives (``t``
        itself where there is no group)."""
        if self.group is None:
            return t
        t = t.to(self.device)
        torch.distributed.all_reduce(t, group=self.group)
        return t

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return bool(self.sum(torch.tensor([float(flag)])).item())


class Sharding(Ranks):
    """The process group an optimizer's sharded params live on, and what it reduces over it."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        meshes = {(p.device_mesh.device_type, tuple(p.device_mesh.mesh.flatten().tolist())): p
                  for p in params if is_sharded(p)}  # (each fully_shard call: a mesh object)
        super().__init__()
        if not meshes:
            return
        for p in params:
            if not is_sharded(p):
                raise ValueError(f"a param of shape {tuple(p.shape)} is a plain tensor beside "
                                 f"FSDP2-sharded ones: shard the whole model (fully_shard on "
                                 f"the root too), or give smartinf.optim only sharded params")
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (_dtensor().Shard(0),):
                raise ValueError(f"a param of shape {tuple(p.shape)} is a DTensor on a "
                                 f"{p.device_mesh.ndim}-D mesh with placements "
                                 f"{tuple(p.placements)}: smartinf.optim takes FSDP2's "
                                 f"fully_shard over a 1-D mesh (Shard(0)); HSDP and tensor "
                                 f"parallelism are not supported")
        if len(meshes) > 1:
            raise ValueError("the params are sharded over more than one device mesh: "
                             "smartinf.optim takes one FSDP2 mesh")
        mesh = next(iter(meshes.values())).device_mesh
        super().__init__(mesh.get_group(), torch.device("cuda", torch.cuda.current_device())
                         if mesh.device_type == "cuda" else torch.device(mesh.device_type))

    @staticmethod
    def state(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """A state of ``param``'s local shard as torch's sharded optimizers hold it: a DTensor
        of the param's global shape and placements (a plain tensor for a plain param)."""
        if not is_sharded(param):
            return value
        return _dtensor().DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())


def refuse_replaced(opt: Any, laid_out: Sequence[torch.Tensor]) -> None:
    """Params put into ``opt``'s groups in place of those its states were laid out for (what
    Accelerate's prepare() and the Trainer do with FSDP2 once they have sharded the model)
    have no states there: refused, saying how to make it instead."""
    current = {id(p) for group in opt.param_groups for p in group["params"]}
    if all(id(p) in current for p in laid_out):
        return
    name = type(opt).__name__
    raise RuntimeError(
        f"smartinf.optim.{name}'s params were replaced after its states were laid out for "
        f"them (Accelerate's prepare() and the Trainer with FSDP2 shard the model after the "
        f"optimizer is made and put the sharded params in its groups). Make the optimizer "
        f"after Accelerator(fsdp_plugin=...) (it then waits for the sharded params: the "
        f"Trainer makes it so), or after calling fully_shard yourself; an optimizer made "
        f"before the Accelerator cannot know the sharding to come (docs/fsdp.md)")
