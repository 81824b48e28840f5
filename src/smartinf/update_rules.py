"""Optimizer update rules a Pipeline applies next to the storage, with their hyper-parameters.

Each rule names its native kernel (``name``), the fp32 state arrays it keeps on storage
after the master weight (``state_names``, named as in torch's optimizer state) and the
value those start at (``initial_state``). ``hyper()`` is what one update sends to the
kernel; a rule is immutable, ``dataclasses.replace`` makes a per-update variant.
``maximize`` (as in torch) ascends: the gradient's sign is flipped with its scale, exactly.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Tuple, Union


def _check(name: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        bound = "(" if open_low else "["
        raise ValueError(f"{name}={value!r} is outside {bound}{low}, {high}]")


def _check_betas(rule: object) -> None:
    """A rule's ``betas``: a pair in [0, 1], stored as a tuple of floats."""
    betas = rule.betas  # type: ignore[attr-defined]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    object.__setattr__(rule, "betas", (float(betas[0]), float(betas[1])))
    _check("betas[0]", rule.betas[0], 0.0, 1.0)  # type: ignore[attr-defined]
    _check("betas[1]", rule.betas[1], 0.0, 1.0)  # type: ignore[attr-defined]


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class Adam:
    """Adam (L2 weight decay added to the gradient), as ``torch.optim.Adam``; with
    ``amsgrad`` the largest ``exp_avg_sq`` so far is a fourth array (fixed for a directory)."""

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    kind = "adam"
    initial_state = 0.0

    @property
    def name(self) -> str:
        return self.kind + ("_amsgrad" if self.amsgrad else "")

    @property
    def state_names(self) -> tuple:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, math.inf)
        _check_betas(self)
        if self.betas[0] == 1.0 or self.betas[1] == 1.0:
            raise ValueError(f"betas must be < 1, got {self.betas}")
        _check("eps", self.eps, 0.0, math.inf, open_low=True)
        _check("weight_decay", self.weight_decay, 0.0, math.inf)
        _check_flag("amsgrad", self.amsgrad)
        _check_flag("maximize", self.maximize)

    def hyper(self) -> dict:
        return {"lr": self.lr, "weight_decay": self.weight_decay, "beta1": self.betas[0],
                "beta2": self.betas[1], "eps": self.eps}


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``."""

    weight_decay: float = 1e-2
    kind = "adamw"


@dataclass(frozen=True)
class SGD:
    """SGD with momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

    The momentum buffer is stored even when ``momentum`` is 0 (then it is not read), so
    the layout of a directory does not depend on a hyper-parameter a scheduler may change.
    """

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    name = "sgd"
    sparse_gradients = True  # as torch's SGD: densified
    base_optimizers = ("SGD",)  # the optimizers (by class name) whose param groups it runs
    state_names = ("momentum_buffer",)
    initial_state = 0.0

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, math.inf)
        _check("momentum", self.momentum, 0.0, math.inf)
        _check("dampening", self.dampening, -math.inf, math.inf)
        _check("weight_decay", self.weight_decay, 0.0, math.inf)
        _check_flag("nesterov", self.nesterov)
        _check_flag("maximize", self.maximize)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def hyper(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "maximize"}


@dataclass(frozen=True)
class Adagrad:
    """AdaGrad with learning-rate decay and L2 weight decay, as ``torch.optim.Adagrad``."""

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False
    name = "adagrad"
    sparse_gradients = True  # as torch's Adagrad: densified
    base_optimizers = ("Adagrad", "DeepSpeedCPUAdagrad")
    state_names = ("sum",)

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, math.inf)
        _check("lr_decay", self.lr_decay, 0.0, math.inf)
        _check("weight_decay", self.weight_decay, 0.0, math.inf)
        _check("initial_accumulator_value", self.initial_accumulator_value, 0.0, math.inf)
        _check("eps", self.eps, 0.0, math.inf)
        _check_flag("maximize", self.maximize)

    @property
    def initial_state(self) -> float:
        return self.initial_accumulator_value

    def hyper(self) -> dict:
        return {"lr": self.lr, "lr_decay": self.lr_decay, "weight_decay": self.weight_decay,
                "eps": self.eps}


@dataclass(frozen=True)
class Lion:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign
    of a momentum interpolated with the gradient, decoupled weight decay; one state array,
    8 B/param of fp32 states against Adam's 12 (~5 with int8 states)."""

    lr: float = 1e-4
    betas: Tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    maximize: bool = False
    name = "lion"
    base_optimizers = ("FusedLion", "DeepSpeedCPULion", "LionParams")
    state_names = ("exp_avg",)
    initial_state = 0.0

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, math.inf)
        _check_betas(self)
        _check("weight_decay", self.weight_decay, 0.0, math.inf)
        _check_flag("maximize", self.maximize)

    def hyper(self) -> dict:
        return {"lr": self.lr, "weight_decay": self.weight_decay, "beta1": self.betas[0],
                "beta2": self.betas[1]}


@dataclass(frozen=True)
class Adamax:
    """Adamax (Kingma & Ba 2015, section 7.1: Adam's second moment replaced by an infinity
    norm, ``exp_inf``), with L2 weight decay, as ``torch.optim.Adamax``. 12 B/param of fp32
    states, as Adam's."""

    lr: float = 2e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    name = "adamax"
    torch_name = "Adamax"  # smartinf.optim.Adamax: torch's signature (optim/drop_in.py)
    base_optimizers = ("Adamax",)
    state_names = ("exp_avg", "exp_inf")
    initial_state = 0.0

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0, math.inf)
        _check_betas(self)
        if self.betas[0] == 1.0:
            raise ValueError(f"betas[0] must be < 1, got {self.betas}")
        _check("eps", self.eps, 0.0, math.inf)
        _check("weight_decay", self.weight_decay, 0.0, math.inf)
        _check_flag("maximize", self.maximize)

    def hyper(self) -> dict:
        return {"lr": self.lr, "weight_decay": self.weight_decay, "beta1": self.betas[0],
                "beta2": self.betas[1], "eps": self.eps}


# The Python side of src/native/kernels/rules.h: the rules by their manifest names. Which
# rules take quantized states is decided there only (a row's `quantized`); the pipeline refuses others.
# Everything else that names the rules (the exports, messages, the DeepSpeed block's checks)
# reads this table.
RULES = {"adam": Adam, "adamw": AdamW, "adam_amsgrad": Adam, "adamw_amsgrad": AdamW,
         "sgd": SGD, "adagrad": Adagrad, "lion": Lion, "adamax": Adamax}
__all__ = list(dict.fromkeys(rule.__name__ for rule in RULES.values()))
UpdateRule = Union[tuple(dict.fromkeys(RULES.values()))]
