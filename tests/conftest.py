import os
import subprocess

import numpy as np
import pytest
import torch

import smartinf

SHM = "/dev/shm"


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a real disk (O_DIRECT works there)."""
    if _fs_type(tmp_path) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs; the O_DIRECT path needs a real disk")
    return str(tmp_path)


@pytest.fixture
def shm_dir(tmp_path_factory):
    if not os.path.isdir(SHM) or _fs_type(SHM) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm to test the buffered fallback on")
    path = tmp_path_factory.mktemp("x")  # unique name, reused under /dev/shm
    target = os.path.join(SHM, f"smartinf-test-{os.getpid()}-{path.name}")
    os.makedirs(target)
    yield target
    subprocess.run(["rm", "-rf", target], check=False)


def _fs_type(path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def uring_works() -> bool:
    if not smartinf.io_uring_built():
        return False
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with smartinf.Pipeline(d, chunk=1024, slots=1, io="auto") as p:
            return p.engine == "uring"


ENGINES = [pytest.param("uring", marks=pytest.mark.skipif(
    not uring_works(), reason="io_uring is unavailable here (not built, seccomp or io_uring_disabled)")),
    "threads"]


class TorchReference:
    """The same sub-groups and gradients through torch.optim, for comparison."""

    def __init__(self, inits, rule):
        self.params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in inits]
        kind = torch.optim.AdamW if isinstance(rule, smartinf.AdamW) else torch.optim.Adam
        self.opt = kind(self.params, lr=rule.lr, betas=rule.betas, eps=rule.eps,
                        weight_decay=rule.weight_decay)

    def step(self, grads, lr=None):
        for p, g in zip(self.params, grads):
            p.grad = torch.from_numpy(np.asarray(g, dtype=np.float32).copy())
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        self.opt.step()

    def states(self, i):
        p = self.params[i]
        s = self.opt.state[p]
        return {"param": p.detach().numpy(), "exp_avg": s["exp_avg"].numpy(),
                "exp_avg_sq": s["exp_avg_sq"].numpy()}


def assert_close_fp32(actual, expected, what=""):
    """fp32 agreement with torch: <= 1e-6 relative.

    Relative to max(|x_i|, mean |x|): torch's vectorised CPU kernels use FMA (lerp,
    addcmul) where our portable kernel rounds twice, a 1-ulp difference that cancellation
    in exp_avg can leave on elements much smaller than the rest of the tensor.
    """
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.abs(actual - expected)
    bound = 1e-6 * np.maximum(np.abs(expected), np.abs(expected).mean()) + 1e-30
    worst = np.argmax(err - bound)
    assert np.all(err <= bound), (f"{what}: element {worst}: {actual[worst]!r} vs "
                                  f"{expected[worst]!r} (rel {err[worst] / max(abs(expected[worst]), 1e-30):.2e})")
