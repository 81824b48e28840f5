"""A ``smartinf.optim`` step's gradients as torch's optimizers take them: each param's dense
and checked (``dense``), each sub-group's in parts where the model holds them (``in_place``:
host sub-groups whose update reads and writes them there) or as one flat tensor (``flat``, on
the host gathered into staging), checked for inf/NaN as they are gathered (``gather_checked``)
or where they are (``finite``), and the factor they are multiplied by after clipping (``scale``: the norm, which
checks them too), with torch.amp.GradScaler's loss scale and inf flag (``amp``)."""
from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors

from smartinf import _native, update_rules
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


def flat(sg: Subgroup, grads: dict, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sub-group's gradient as one flat tensor on its own device. A param without a
    gradient gets zeros when others in its sub-group have one (torch would skip it; here
    its states still decay: the optimizer warns once). ``into``: a flat host buffer of the
    sub-group's size and dtype (staging) that the parts are gathered into, where they are
    on the host; a sub-group of one whole contiguous gradient is that gradient."""
    if into is not None and sg.device.type == "cpu":
        gathered = _gathered(sg, grads, into)
        if gathered is not None:
            return gathered
    parts = []
    for s in sg.slices:
        g = grads.get(id(s.param))
        parts.append(torch.zeros(s.stop - s.start, dtype=sg.dtype, device=sg.device) if g is None
                     else g if s.stop - s.start == g.numel()  # (whole: flattened by the cat, no view op)
                     else g.reshape(-1)[s.start:s.stop])
    return _flatten_dense_tensors(parts)  # (one part: its flat view, no copy)


class Staged(dict):
    """{sub-group id: (its staging buffer, its flat gradient)} gathered by the step's check."""

    def __init__(self, staging: Any = None) -> None:
        super().__init__()
        self.staging = staging

    def take(self, sg: Subgroup, grads: dict, buffer: int) -> torch.Tensor:
        """Sub-group ``sg``'s flat gradient for staging buffer ``buffer``: the one gathered
        there by the check, or gathered now."""
        held = self.pop(sg.id, None)
        if held is not None and held[0] == buffer:
            return held[1]
        host = self.staging is not None and sg.device.type == "cpu"  # (a GPU's: none taken)
        return flat(sg, grads, self.staging.grad(buffer, sg.dtype, sg.numel) if host else None)

    def drop_if(self, through: Any) -> Any:
        """Forgets what was gathered where ``through`` is true: edits of the states (through
        ``opt.state``) or of the params are written through staging before the updates, and
        the gradients are gathered again. Returns ``through``."""
        if through:
            self.clear()
        return through


def in_place(plan: Sequence[Subgroup], grads: dict, takes: Any) -> dict:
    """{sub-group id: (its gradient's parts, its params' parts)} of the sub-groups in ``takes``
    (``Pipeline.takes_parts``) whose every slice has a contiguous host gradient of the
    sub-group's dtype and contiguous host params: updated where the model holds them. The
    others are gathered into staging and their params copied back out."""
    found = {}
    for sg in plan:
        if sg.id not in takes:
            continue
        gs, ps = [], []
        for s in sg.slices:
            g, p = grads.get(id(s.param)), local(s.param)
            if g is None or not (g.is_cpu and p.is_cpu and g.dtype == p.dtype == sg.dtype and
                                 g.is_contiguous() and p.is_contiguous()):
                break
            gs.append(g.view(-1)[s.start:s.stop])
            ps.append(p.detach().view(-1)[s.start:s.stop])
        else:  # (a gradient in a param's own memory, however odd, is read before it is written)
            held = {t.untyped_storage().data_ptr() for t in ps}
            if not any(t.untyped_storage().data_ptr() in held for t in gs):
                found[sg.id] = (gs, ps)
    return found


def decide(grads: dict, grad_scale: float, found_inf: bool, scaler_checked: bool,
           opt: Any, parts: Any = ()) -> tuple:
    """(the gradients' scale, None where the step is skipped; their norm where ``opt``'s
    clipping took one; ``Staged``). No pass over the gradients of their own where nothing
    clips: GradScaler's found_inf where it checked them (as torch's fused optimizers take it),
    else on the host the inf/NaN check fused into their gathering into ``opt``'s staging, as
    far as it holds sub-groups before the first update (sent in plan order, buffer after
    buffer, where no update starts during backward or in a tail, nothing is compressed and no
    split master sends params), the rest checked where they are; updates started during
    backward read them already: they are checked where they are. GPU gradients: their norm."""
    max_grad_norm, sharding, plan = opt.max_grad_norm, opt._sharding, opt._plan
    staging = opt._driver.staging
    fused = opt._speculation is None and opt._tail is None and opt.compress is None and \
        not opt._split
    staged = Staged(staging)
    if found_inf:
        return None, None, staged
    sharded = sharding is not None and sharding.active
    if max_grad_norm is not None or not (scaler_checked or all(g.is_cpu for g in grads.values())):
        return (*scale(grad_scale, list(grads.values()), max_grad_norm, sharding), staged)
    if scaler_checked:
        return grad_scale, None, staged
    if fused:  # (those updated in place, ``parts``, are read where they are)
        active = [sg for sg in plan if any(id(s.param) in grads for s in sg.slices)]
        first = [sg for sg in active if sg.id not in parts][:staging.depth]
        flats, ok = gather_checked(first, grads, [staging.grad(b, sg.dtype, sg.numel)
                                                  for b, sg in enumerate(first)])
        gathered = {sg.id for sg in first}
        ok = ok and finite([g for sg in active if sg.id not in gathered
                            for g in parts_of(sg, grads)])
        staged.update({sg.id: (b, flats[sg.id]) for b, sg in enumerate(first) if sg.id in flats})
    else:
        ok = finite(list(grads.values()))
    if sharded:  # (every rank is here: the same branch)
        ok = not sharding.any(not ok)
    if not ok:
        staged.clear()
        return None, None, staged
    return grad_scale, None, staged


def gather_checked(sgs: Sequence[Subgroup], grads: dict,
                   into: Sequence[torch.Tensor]) -> tuple[dict, bool]:
    """({sub-group id: its flat gradient} of the host sub-groups ``sgs`` gathered into the
    staging buffers ``into``, one each; whether every gradient of theirs is finite): each
    piece checked for inf/NaN as it is copied, while in the core's cache, rather than in a
    pass of its own before (``finite``). A sub-group that cannot be gathered so is checked
    where it is and left out."""
    staged: dict = {}
    ok = True
    for sg, buffer in zip(sgs, into):
        flat_ = _gathered(sg, grads, buffer, check=True) if sg.device.type == "cpu" else None
        if flat_ is False:
            return staged, False
        if flat_ is None:
            ok = finite(parts_of(sg, grads)) and ok
        else:
            staged[sg.id] = flat_
    return staged, ok


def finite(parts: Sequence[torch.Tensor]) -> bool:
    """Whether no element of ``parts`` is inf/NaN: on the host, their bits' exponents,
    piece by piece on every core (exact: no sum to overflow, no fp64 pass again)."""
    walks: dict = {}  # dtype -> (the tensors walked, kept alive; their parts)
    for t in parts:
        t = t.reshape(-1)
        if not t.is_cpu or t.dtype not in _EXPONENT or not t.is_contiguous():
            if not bool(torch.isfinite(t).all()):
                return False
            continue
        held, walk = walks.setdefault(t.dtype, ([], []))
        held.append(t)
        walk.append((0, t.data_ptr(), t.numel() * t.element_size()))
    return all(_walk(walk, dtype, True) for dtype, (_, walk) in walks.items())


#: bytes walked (copied, then checked) at a time (``gather_checked``): in L2
PIECE = 256 << 10
#: per dtype: the bits but the sign, the exponent all ones (store/host_pieces.h's check)
_EXPONENT = {torch.float32: (0x7FFFFFFF, 0x7F800000),
             torch.float16: (0x7FFF, 0x7C00),
             torch.bfloat16: (0x7FFF, 0x7F80)}


def parts_of(sg: Subgroup, grads: dict) -> list[torch.Tensor]:
    """The parts of the sub-group's params' gradients it holds."""
    return [g.reshape(-1)[s.start:s.stop] for s in sg.slices
            if (g := grads.get(id(s.param))) is not None]


def _gathered(sg: Subgroup, grads: dict, into: torch.Tensor, check: bool = False) -> Any:
    """``flat`` into ``into`` (None where a part is not a host tensor of the sub-group's
    dtype): each part copied once into its place. A fresh tensor per step, as ``flat``'s cat
    makes, took 2.3x a copy's time on the 2-core VM (the kernel's zeroed pages, faulted in);
    and torch's copy on its two threads, beside the update's threads or other processes,
    waited for a thread descheduled: 16 Mi params gathered in 343 ms against numpy's 31 ms
    on one thread (load 10 on 2 cores), the core left to the update running beside it.
    ``check``: each piece checked for inf/NaN right after its copy, in cache (False where
    one is)."""
    gs = [grads.get(id(s.param)) for s in sg.slices]
    if sg.dtype not in _EXPONENT or \
            any(g is not None and (not g.is_cpu or g.dtype != sg.dtype) for g in gs):
        return None
    if len(gs) == 1 and gs[0] is not None and gs[0].is_contiguous() and \
            sg.slices[0].stop - sg.slices[0].start == gs[0].numel():
        whole = gs[0].view(-1)  # (the gradient itself: no copy)
        return False if check and not finite([whole]) else whole
    held, walk = [], []
    for s, g in zip(sg.slices, gs):
        dst = into[s.offset:s.offset + s.stop - s.start]
        if g is None:
            dst.zero_()
            continue
        src = g.reshape(-1)[s.start:s.stop].contiguous()
        held.append(src)
        walk.append((dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()))
    # (checked: before any update, every core's; else beside the updates, one thread)
    return into[:sg.numel] if _walk(walk, sg.dtype, check) else False


#: threads that gather and check the gradients before the first update: 22 M fp32
#: gradients gathered and checked in ms on two against ms on one (the 2-core VM)
_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def _walk(walk: list, dtype: torch.dtype, check: bool) -> bool:
    """The (dst, src, bytes) parts copied (dst 0: none) and where ``check``ed tested for
    inf/NaN right after, piece by piece (``_native.walk_pieces``: every core before the first
    update, else one thread beside the updates); False where a piece holds inf/NaN."""
    if not check:
        return _native.walk_pieces(walk, PIECE, 1)[0]
    magnitude, exponent = _EXPONENT[dtype]
    return _native.walk_pieces(walk, PIECE, _THREADS, dtype.itemsize, magnitude, exponent)[0]


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


def amp(opt: Any, grad_scale: float) -> tuple[float, bool, bool]:
    """(``grad_scale`` times 1/the loss scale torch.amp.GradScaler set on ``opt`` for this
    step() call, whether it found inf/NaN, whether it checked the gradients): its protocol for
    optimizers that unscale themselves (``_step_supports_amp_scaling``). After
    ``scaler.unscale_(opt)`` it sets no scale: the gradients were divided in place (the
    digests of ``Speculation`` see it); its found_inf is still set, from that unscale."""
    amp_scale, found_inf = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
    if amp_scale is not None:
        amp_scale = float(amp_scale)
        if not math.isfinite(amp_scale) or amp_scale <= 0:
            raise ValueError(f"GradScaler's scale is {amp_scale}: a positive finite loss "
                             f"scale is needed (its init_scale, or a scale it never "
                             f"backed off to 0)")
        grad_scale = grad_scale / amp_scale
    return grad_scale, found_inf is not None and bool(found_inf), found_inf is not None


def forget_amp(opt: Any) -> None:
    """GradScaler deletes the attributes it set only when step() returns: after a failed
    step they would multiply into its next scale."""
    for name in ("grad_scale", "found_inf"):
        opt.__dict__.pop(name, None)
