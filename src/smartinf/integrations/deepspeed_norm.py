"""DeepSpeed ZeRO-3's gradient norms by sub-group (``norm_groups``) with one all-reduce and one
inf/NaN check for all of them. DeepSpeed's ``get_grad_norm_direct`` reduces each sub-group's sum
over the ranks on its own and makes its -1 (an invalid norm) from a host float, which waits for
the GPU: once a sub-group, about 1 ms each of the host's time in a 7 B step's timeline
(``bench/measured/h200-g-*``), about 0.1 s of every 13 B step() (121 sub-groups). The values are
DeepSpeed's: each sub-group's sum of its gradients' squared norms by the same ops on the host
(on a GPU by one read of each gradient, adding in fp64: ``square_sum``), the sums reduced over
the ranks together, then the roots and the -1s as DeepSpeed takes them (on the host the same
bits up to two ranks; with more, a collective may add a vector's elements in another order
than a scalar's). Configurations whose norm DeepSpeed counts otherwise (model parallelism,
AutoEP experts, Muon, sub-groups in different partition groups) keep DeepSpeed's own."""
from __future__ import annotations

from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.utils import get_norm_dtype

_OWN = "own"  # (a configuration whose norm stays DeepSpeed's)
_UNDECIDED = object()


def norm_groups(opt: Any) -> list:
    """``opt._get_norm_groups()``'s values (each sub-group's L2 norm of its gradient partitions
    over the ranks, -1 where inf/NaN)."""
    group = _partition_group(opt)
    if group is _OWN:
        return opt._get_norm_groups()
    device = get_accelerator().device_name()
    total = torch.stack([square_sum([g.to(device, non_blocking=True) for g in opt.averaged_gradients[i]],
                                    get_norm_dtype(), device) for i in range(len(opt.fp16_groups))])
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    total = total ** (1. / 2.0)
    return list(torch.where(total.isnan().logical_or(total.isinf()), -1.0, total).unbind())


def square_sum(grads: list, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The sum of the squares of the gradients' L2 norms, each norm in ``dtype`` (DeepSpeed's
    fp64), as DeepSpeed sums them. On the host by DeepSpeed's ops (the same bits). On a GPU by
    torch's multi-tensor norm, which reads each gradient once and adds its squares in
    ``dtype``: DeepSpeed first copies every gradient into ``dtype`` (8 B a param written,
    then read), 42 ms of a 7 B step's GPU time on an H200 (``h200-j-7b-*``'s timeline). The
    squares of bf16, fp16 and fp32 values are exact in fp64, so the two differ only in the
    order of their additions: within 2 (n + k + 1) units of fp64 rounding of the sum (n
    elements, k tensors; ``tests/test_deepspeed.py::test_the_gpu_norms_are_deepspeeds_to_the_order_of_additions``)."""
    if all(g.is_cuda for g in grads):  # (an empty tensor's result there is not set: left out)
        grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    if grads[0].is_cuda:
        norms = torch._foreach_norm(grads, 2.0, dtype=dtype)
    else:
        norms = [g.to(dtype).norm(2.0) for g in grads]
    return torch.sum(torch.pow(torch.stack(norms), 2.0))


def _partition_group(opt: Any) -> Any:
    """The one partition group every sub-group's norm is reduced over, or ``_OWN`` (decided at
    the first step: the params' groups do not change)."""
    found = opt.__dict__.get("_smartinf_norm_group", _UNDECIDED)
    if found is _UNDECIDED:
        found = opt.__dict__["_smartinf_norm_group"] = _decide(opt)
    return found


def _decide(opt: Any) -> Any:
    if opt.offload_optimizer or getattr(opt, "model_parallel_group", None) is not None or \
            getattr(opt, "use_muon", False):
        return _OWN
    # (as DeepSpeed 0.19.8 finds them; a release without these has neither AutoEP nor groups
    # other than the data-parallel one)
    autoep = getattr(opt, "_autoep_expert_parallel_group", lambda params: None)
    group_of = getattr(opt, "_get_param_partition_group", lambda param: opt.dp_process_group)
    groups = {id(group_of(p)): group_of(p) for params in opt.fp16_groups for p in params}
    if len(groups) != 1 or any(params and autoep(params) is not None for params in opt.fp16_groups):
        return _OWN
    return next(iter(groups.values()))
