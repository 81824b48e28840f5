"""A ``smartinf.optim`` step's gradients as torch's optimizers take them: each param's dense
and checked (``dense``), each sub-group's as one flat tensor (``flat``), and the factor
they are multiplied by after the inf/NaN check and clipping (``scale``), with torch.amp.GradScaler's
loss scale and inf flag (``amp``)."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors

from smartinf import update_rules
from smartinf.optim.sharding import Sharding, local
from smartinf.optim.subgroups import Subgroup


def dense(p: torch.Tensor, optimizer: torch.optim.Optimizer, stored: set,
          rule_class: type) -> Optional[torch.Tensor]:
    """``p``'s gradient, dense (a sparse one is densified where torch's optimizer takes
    sparse gradients: the same update, absent entries being zeros); ``stored``: the ids of
    the params the devices hold states for."""
    g = local(p.grad)
    if g is None:
        return None
    if id(p) not in stored:
        raise ValueError(f"a param of shape {tuple(p.shape)} has a gradient, but it was "
                         f"frozen (requires_grad=False) when smartinf.optim."
                         f"{type(optimizer).__name__} was created, so the devices hold no "
                         f"states for it: create the optimizer after unfreezing, or put "
                         f"newly trained params in a group of their own (add_param_group)")
    if g.is_sparse:
        if issubclass(rule_class, update_rules.Adam):
            raise RuntimeError("Adam does not support sparse gradients, please consider "
                               "SparseAdam instead (or nn.Embedding(sparse=False))")
        if not getattr(rule_class, "sparse_gradients", False):
            raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients "
                               f"(use nn.Embedding(sparse=False))")
        if any(q is p for group in optimizer.param_groups if group["weight_decay"] != 0
               for q in group["params"]):
            raise RuntimeError("weight_decay option is not compatible with sparse gradients")
        g = g.to_dense()
    return g.detach()


def flat(sg: Subgroup, grads: dict) -> torch.Tensor:
    """The sub-group's gradient as one flat tensor on its own device. A param without a
    gradient gets zeros when others in its sub-group have one (torch would skip it; here
    its states still decay: the optimizer warns once)."""
    parts = []
    for s in sg.slices:
        g = grads.get(id(s.param))
        parts.append(torch.zeros(s.stop - s.start, dtype=sg.dtype, device=sg.device) if g is None
                     else g if s.stop - s.start == g.numel()  # (whole: flattened by the cat, no view op)
                     else g.reshape(-1)[s.start:s.stop])
    return _flatten_dense_tensors(parts)  # (one part: its flat view, no copy)


def total_norm(grads: Sequence[torch.Tensor], dtype: torch.dtype,
               sharding: Optional[Sharding] = None) -> torch.Tensor:
    """The L2 norm of all gradients, computed in ``dtype``, on the host (one sync); of every
    rank's shards where ``sharding`` is active (their squares summed over the ranks)."""
    # GPU gradients by torch's multi-tensor kernel, as clip_grad_norm_ takes them there (one
    # launch for many tensors: a per-tensor norm was 580 launches of GPT-2 XL's step)
    on_gpu: dict = {}
    for g in grads:
        if g.is_cuda:
            on_gpu.setdefault((g.device, g.dtype), []).append(g)
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=dtype) for g in grads if not g.is_cuda]
    one_gpu = not norms and len(on_gpu) == 1  # (every norm on one GPU: none to move)
    for group in on_gpu.values():
        norms.extend(torch._foreach_norm(group, 2.0, dtype=dtype))
    device = norms[0].device if norms else torch.device("cpu")
    together = norms if one_gpu else [n.to(device) for n in norms]
    norm = torch.linalg.vector_norm(torch.stack(together), 2.0) if norms else torch.zeros((), dtype=dtype)
    if sharding is None or not sharding.active:
        return norm.cpu()
    return sharding.sum(norm.pow(2).reshape(1)).sqrt()[0].cpu()


def scale(grad_scale: float, grads: Sequence[torch.Tensor], max_grad_norm: Optional[float],
          sharding: Optional[Sharding] = None) -> tuple[Optional[float], Optional[float]]:
    """(the factor every gradient is multiplied by: ``grad_scale``, 1/loss scale, then
    clipping; None when a gradient holds inf/NaN and the step must be skipped, the norm of
    the unscaled gradients, or None where there are none). With ``sharding`` active, of every
    rank's gradients: each rank gets the same answer."""
    sharded = sharding is not None and sharding.active
    if not grads and not sharded:
        return grad_scale, None
    total = total_norm(grads, torch.float32, sharding)  # fp16's own norm overflows at 65504
    if not torch.isfinite(total):
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if sharded:  # (every rank is here: the norm is theirs)
            finite = not sharding.any(not finite)
        if not finite:
            return None, None
        total = total_norm(grads, torch.float64, sharding)  # finite, only the fp32 sum overflowed
    norm = float(total) * grad_scale
    if max_grad_norm is None:
        return grad_scale, norm
    # torch.nn.utils.clip_grad_norm_ on the unscaled gradients: the same coefficient,
    # rounded to fp32 as torch multiplies the gradients by an fp32 tensor.
    coef = torch.clamp(max_grad_norm / (total * grad_scale + 1e-6), max=1.0)
    return grad_scale * float(coef), norm


#: said once (with the sub-groups) where ``partial`` finds any
PARTIAL = ("sub-groups %s hold params without a gradient beside params with one: those get a "
           "zero gradient (their moments decay and weight decay applies), where torch leaves "
           "them untouched. Freeze them (requires_grad=False) before creating the optimizer, or "
           "give them a param group of their own (warned once)")


def partial(subgroups: Sequence[Subgroup]) -> list[int]:
    """The sub-groups with params without a gradient beside params with one (``flat``
    gives those zeros)."""
    return [sg.id for sg in subgroups if any(s.param.grad is None for s in sg.slices)]


def amp(opt: Any, grad_scale: float) -> tuple[float, bool]:
    """(``grad_scale`` times 1/the loss scale torch.amp.GradScaler set on ``opt`` for this
    step() call, whether it found inf/NaN): its protocol for optimizers that unscale
    themselves (``_step_supports_amp_scaling``). After ``scaler.unscale_(opt)`` it sets no
    scale: the gradients were divided in place (the digests of ``Speculation`` see it)."""
    amp_scale, found_inf = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
    if amp_scale is not None:
        amp_scale = float(amp_scale)
        if not math.isfinite(amp_scale) or amp_scale <= 0:
            raise ValueError(f"GradScaler's scale is {amp_scale}: a positive finite loss "
                             f"scale is needed (its init_scale, or a scale it never "
                             f"backed off to 0)")
        grad_scale = grad_scale / amp_scale
    return grad_scale, found_inf is not None and bool(found_inf)


def forget_amp(opt: Any) -> None:
    """GradScaler deletes the attributes it set only when step() returns: after a failed
    step they would multiply into its next scale."""
    for name in ("grad_scale", "found_inf"):
        opt.__dict__.pop(name, None)
