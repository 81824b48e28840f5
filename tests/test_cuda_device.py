"""The CUDA device (smartinf.CudaDevice): the update on a GPU, bit for bit the cpu device's
for every rule, fp32 and split masters, over several steps and chunks (params and every
state compared). Needs smartinf built with CUDA and a GPU (the lent GPU machine:
bench/gpu_kit.sh rebuild); the argument checks and the clear error of a build without CUDA
run everywhere."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import smartinf
import smartinf.optim as so
from smartinf.rounding import to_bf16

CHUNK = 5000  # two full chunks and a partial one per sub-group

cuda_built = smartinf.build_info()["cuda"]
needs_gpu = pytest.mark.skipif(not (cuda_built and torch.cuda.is_available()),
                               reason="smartinf built without CUDA, or no CUDA GPU here")


def bits(x) -> np.ndarray:
    """The bit patterns of a tensor (params) or an array (states)."""
    if isinstance(x, torch.Tensor):
        x = x.contiguous().view(torch.int16) if x.dtype == torch.bfloat16 else x.contiguous()
        x = x.numpy()
    return np.ascontiguousarray(x).view(np.uint32 if x.dtype == np.float32 else np.uint16)


def train(device, rule, master: str, dtype: torch.dtype, steps: int = 5, sizes=(12_345, 7_001)):
    """Sub-groups trained from the same init and gradients; their params and states."""
    rng = np.random.default_rng(0)
    pipe = smartinf.Pipeline(device, rule, chunk=CHUNK, master=master)
    params = []
    for n in sizes:
        init = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        init = to_bf16(init) if dtype == torch.bfloat16 else init
        pipe.add_subgroup(n, init.float())
        params.append(init.to(dtype).clone())
    for _ in range(steps):
        with pipe.step():
            futures = [pipe.update(sg, torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype),
                                   params[sg]) for sg, n in enumerate(sizes)]
            for f in futures:
                f.wait()
    states = [pipe.read_states(sg, params=params[sg]) if master == "split" else pipe.read_states(sg)
              for sg in range(len(sizes))]
    pipe.close()
    return params, states


RULES = {
    "adamw": lambda: smartinf.AdamW(lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda: smartinf.Adam(lr=1e-2, weight_decay=0.01, amsgrad=True),
    "sgd-nesterov": lambda: smartinf.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adagrad": lambda: smartinf.Adagrad(lr=0.05, lr_decay=0.01),
    "lion": lambda: smartinf.Lion(lr=1e-3, weight_decay=0.1),
}


@needs_gpu
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("master,dtype", [("fp32", torch.float32), ("fp32", torch.bfloat16),
                                          ("split", torch.bfloat16)])
def test_gpu_updates_match_the_cpu_device_bit_for_bit(disk_dir, rule, master, dtype):
    gpu = train(smartinf.CudaDevice(os.path.join(disk_dir, "gpu")), RULES[rule](), master, dtype)
    cpu = train(smartinf.CpuDevice(os.path.join(disk_dir, "cpu")), RULES[rule](), master, dtype)
    for a, b in zip(gpu[0], cpu[0]):
        assert np.array_equal(bits(a), bits(b))
    for sa, sb in zip(gpu[1], cpu[1]):
        assert sa.keys() == sb.keys()
        for name in sa:
            assert np.array_equal(bits(sa[name]), bits(sb[name])), name
    assert any(np.any(bits(v) != 0) for v in gpu[1][0].values())  # states were written


@needs_gpu
@pytest.mark.parametrize("settings,message", [
    ({"state_dtype": "int8"}, "int8 states run on cpu devices"),
    ({"memory_budget": 1 << 20}, "a memory budget is for cpu devices"),
])
def test_what_the_gpu_device_does_not_do_yet_is_refused(disk_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        smartinf.Pipeline(smartinf.CudaDevice(disk_dir), smartinf.AdamW(), chunk=CHUNK, **settings)


def test_gpu_ordinal_is_checked(tmp_path):
    for bad in (-1, "0", True, 1.0):
        with pytest.raises(ValueError, match="gpu must be a CUDA device ordinal"):
            smartinf.CudaDevice(tmp_path, gpu=bad)


@pytest.mark.skipif(not cuda_built or torch.cuda.is_available(),
                    reason="smartinf built without CUDA, or a GPU is here")
def test_without_a_gpu_a_gpu_device_is_a_clear_error(disk_dir):
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        smartinf.Pipeline(smartinf.CudaDevice(disk_dir), smartinf.AdamW(), chunk=CHUNK)
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):  # the optimizer's path too
        so.AdamW(torch.nn.Linear(4, 4).parameters(), devices=smartinf.CudaDevice(disk_dir))


@pytest.mark.skipif(cuda_built, reason="smartinf was built with CUDA")
def test_without_cuda_a_gpu_device_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="built without CUDA"):
        smartinf.Pipeline(smartinf.CudaDevice(tmp_path), smartinf.AdamW())
