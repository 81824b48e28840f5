import math

import pytest

import smartinf


def test_defaults_follow_torch():
    assert smartinf.AdamW() == smartinf.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    assert smartinf.Adam().weight_decay == 0.0
    assert smartinf.Adam(betas=[0.5, 0.6]).betas == (0.5, 0.6)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"lr": math.nan}, ValueError, "lr=nan"),
    ({"lr": -1.0}, ValueError, "lr=-1.0"),
    ({"lr": math.inf}, ValueError, "lr=inf"),
    ({"betas": (0.9,)}, ValueError, "betas must be a pair"),
    ({"betas": (1.0, 0.999)}, ValueError, "betas must be < 1"),
    ({"betas": (0.9, math.nan)}, ValueError, r"betas\[1\]=nan"),
    ({"eps": 0.0}, ValueError, "eps=0.0"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
    ({"lr": "0.1"}, TypeError, "lr must be a number"),
])
def test_bad_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        smartinf.AdamW(**kwargs)
