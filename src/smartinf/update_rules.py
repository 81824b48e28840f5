"""Optimizer update rules a Pipeline applies next to the storage, with their hyper-parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple


def _check(name: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        bound = "(" if open_low else "["
        raise ValueError(f"{name}={value!r} is outside {bound}{low}, {high}]")


@dataclass(frozen=True)
class Adam:
    """Adam (L2 weight decay added to the gradient), as ``torch.optim.Adam``."""

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    name = "adam"

    def __post_init__(self) -> None:
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        _check("lr", self.lr, 0.0, math.inf)
        _check("betas[0]", self.betas[0], 0.0, 1.0)
        _check("betas[1]", self.betas[1], 0.0, 1.0)
        if self.betas[0] == 1.0 or self.betas[1] == 1.0:
            raise ValueError(f"betas must be < 1, got {self.betas}")
        _check("eps", self.eps, 0.0, math.inf, open_low=True)
        _check("weight_decay", self.weight_decay, 0.0, math.inf)


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``."""

    weight_decay: float = 1e-2
    name = "adamw"


UpdateRule = Adam
