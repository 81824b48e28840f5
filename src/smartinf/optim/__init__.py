"""Drop-in ``torch.optim`` optimizers whose states live on near-storage devices.

``smartinf.optim.AdamW(model.parameters(), lr=..., devices=["/nvme0/run1"])`` behaves like
``torch.optim.AdamW`` but keeps the fp32 master weights and the optimizer states only on
the devices' storage, in sub-groups of flattened parameters. ``step()`` sends each
sub-group's gradient through host staging buffers (top-k compressed when ``compress`` is
given), the device updates the states next to the storage, and the updated params come
back into the model (fp32, fp16 or bf16, on CPU or CUDA). Host memory is N + 1 staging
pairs of one sub-group each with N devices (2 with one), whatever the model size.

Per-group hyper-parameters are read at every step, so ``torch.optim.lr_scheduler`` works.
``state_dict()`` / ``load_state_dict()`` speak torch's format, streamed one sub-group at a
time; ``save(dir)`` copies the device directories as a native checkpoint, resumed by
constructing the optimizer on them.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from typing_extensions import Unpack

from smartinf import update_rules
from smartinf.optim.base import DEFAULT_SUBGROUP_SIZE, _StorageOptimizer  # noqa: F401 (public)
from smartinf.optim.drop_in import drop_in
from smartinf.optim.options import StorageOptions
from smartinf.pipeline.devices import DeviceLike


class Adam(_StorageOptimizer):
    """``torch.optim.Adam`` with states on near-storage devices."""

    torch_class = torch.optim.Adam
    rule_class = update_rules.Adam

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 devices: DeviceLike | Sequence[DeviceLike] | None = None,
                 **options: Unpack[StorageOptions]) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "amsgrad": amsgrad},
                         devices=devices, **options)


class AdamW(Adam):
    """``torch.optim.AdamW`` with states on near-storage devices."""

    torch_class = torch.optim.AdamW
    rule_class = update_rules.AdamW

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 devices: DeviceLike | Sequence[DeviceLike] | None = None,
                 **options: Unpack[StorageOptions]) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, devices=devices, **options)


class Lion(_StorageOptimizer):
    """Lion (Chen et al. 2023) with its momentum on near-storage devices: 8 B/param of fp32
    states, ~5 with ``state_dtype="int8"``. Its ``state_dict`` has torch's layout
    (``exp_avg``, decoded to fp32 with int8 states, and ``step`` per param)."""

    torch_class = None
    rule_class = update_rules.Lion

    def __init__(self, params: Iterable, lr: float = update_rules.Lion.lr,
                 betas: tuple = update_rules.Lion.betas,
                 weight_decay: float = update_rules.Lion.weight_decay, *,
                 devices: DeviceLike | Sequence[DeviceLike] | None = None,
                 **options: Unpack[StorageOptions]) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay,
                                  "maximize": False}, devices=devices, **options)


class SGD(_StorageOptimizer):
    """``torch.optim.SGD`` with the momentum buffer on near-storage devices."""

    torch_class = torch.optim.SGD
    rule_class = update_rules.SGD

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 devices: DeviceLike | Sequence[DeviceLike] | None = None,
                 **options: Unpack[StorageOptions]) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov},
                         devices=devices, **options)

    def _torch_state(self, steps: int, arrays: dict, group: dict) -> dict:
        # torch keeps a momentum buffer only once a step with momentum ran.
        buf = arrays["momentum_buffer"] if group["momentum"] != 0 and steps > 0 else None
        return {"momentum_buffer": buf}

    def _stored_steps(self, state: dict, group: dict) -> int:
        return 1 if state.get("momentum_buffer") is not None else 0


class Adagrad(_StorageOptimizer):
    """``torch.optim.Adagrad`` with the squared-gradient sum on near-storage devices."""

    torch_class = torch.optim.Adagrad
    rule_class = update_rules.Adagrad

    def __init__(self, params: Iterable, lr: float = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, *, devices: DeviceLike | Sequence[DeviceLike] | None = None,
                 **options: Unpack[StorageOptions]) -> None:
        super().__init__(params, {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
                                  "initial_accumulator_value": initial_accumulator_value,
                                  "eps": eps}, devices=devices, **options)



# Every other rule row that names a torch optimizer (update_rules.py) gets its class here.
for _rule in dict.fromkeys(update_rules.RULES.values()):
    if hasattr(_rule, "torch_name") and _rule.__name__ not in globals():
        globals()[_rule.__name__] = drop_in(_rule, _StorageOptimizer)
