"""How far smartinf.optim's update is from torch.optim's on this CPU: one step over 64 Ki
random fp32 elements per rule; the share of elements that differ and the largest
difference in ulps of max(|param|, |update|) (docs/correctness.md, "How close to torch").

    python bench/torch_ulps.py                       # torch's kernels for this CPU
    ATEN_CPU_CAPABILITY=default python bench/torch_ulps.py   # torch's portable kernels
"""
import tempfile

import numpy as np
import torch

import smartinf.optim

CASES = {"Adam": dict(lr=1e-3), "AdamW": dict(lr=3e-3, weight_decay=0.1),
         "Adagrad": dict(lr=0.1), "SGD": dict(lr=0.1, momentum=0.9)}


def main() -> None:
    torch.manual_seed(0)
    n = 1 << 16
    p0, grad = torch.randn(n), torch.randn(n) * 1e-2
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for name, kw in CASES.items():
        a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
        ref = getattr(torch.optim, name)([a], **kw)
        with tempfile.TemporaryDirectory() as d:
            ours = getattr(smartinf.optim, name)([b], devices=[d], **kw)
            a.grad, b.grad = grad.clone(), grad.clone()
            ref.step()
            ours.step()
            ours.close()
        x, y, p = (t.detach().double().numpy() for t in (a, b, p0))
        ulp = np.maximum(np.abs(p), np.abs(x - p)) * 2.0 ** -23
        print(f"{name:<8} differ on {(x != y).mean():6.1%} of elements, "
              f"at most {(np.abs(x - y) / ulp).max():.2f} ulps of max(|param|, |update|)")
    # torch's sqrt of a large fp32 tensor against the correctly rounded root (the kernels').
    v = torch.rand(n) * 1e-4
    exact = np.sqrt(v.numpy().astype(np.float64)).astype(np.float32)
    print(f"torch.sqrt not correctly rounded on {(v.sqrt().numpy() != exact).mean():.1%} of elements")


if __name__ == "__main__":
    main()
