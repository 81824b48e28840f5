"""The CUDA device (smartinf.CudaDevice): the update on a GPU, bit for bit the cpu device's
for every rule, fp32 and split masters, fp32, int8 and int4 moments, over several steps and
chunks (params and every state compared). Needs smartinf built with CUDA and a GPU (the lent GPU machine:
bench/gpu_kit.sh rebuild); the argument checks and the clear error of a build without CUDA
run everywhere."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import smartinf
import smartinf.optim as so
from smartinf.step.rounding import to_bf16

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


def assert_same_bits(a, b):
    """Two runs' params and every state, bit for bit."""
    for x, y in zip(a[0], b[0]):
        assert np.array_equal(bits(x), bits(y))
    for sa, sb in zip(a[1], b[1]):
        assert sa.keys() == sb.keys()
        for name in sa:
            assert np.array_equal(bits(sa[name]), bits(sb[name])), name


def train(device, rule, master: str, dtype: torch.dtype, steps: int = 5, sizes=(12_345, 7_001),
          state_dtype: str = "fp32", chunk: int = CHUNK):
    """Sub-groups trained from the same init and gradients; their params and states."""
    rng = np.random.default_rng(0)
    pipe = smartinf.Pipeline(device, rule, chunk=chunk, master=master, state_dtype=state_dtype)
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
    assert_same_bits(gpu, cpu)
    assert any(np.any(bits(v) != 0) for v in gpu[1][0].values())  # states were written


@needs_gpu
@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
@pytest.mark.parametrize("rule", ["adamw", "adam", "lion"])
@pytest.mark.parametrize("master,dtype", [("fp32", torch.float32), ("fp32", torch.float16),
                                          ("split", torch.bfloat16)])
def test_quantized_moments_on_the_gpu_match_the_cpu_device_bit_for_bit(disk_dir, state_dtype,
                                                                       rule, master, dtype):
    """Blocks and tiles cut by chunk ends (a chunk of 40 000: int4's third tile partial, and
    the sub-groups' last chunks partial rows and blocks), 8 steps: the block maxima and the
    codes written from them are the cpu device's."""
    rules = {"adamw": lambda: smartinf.AdamW(lr=1e-2, weight_decay=0.1),
             "adam": lambda: smartinf.Adam(lr=1e-2, weight_decay=0.01, betas=(0.5, 0.99)),
             "lion": lambda: smartinf.Lion(lr=1e-3, weight_decay=0.1)}
    sizes = (100_003, 7_001)
    gpu, cpu = (train(device(os.path.join(disk_dir, name)), rules[rule](), master, dtype, steps=8,
                      sizes=sizes, state_dtype=state_dtype, chunk=40_000)
                for name, device in (("gpu", smartinf.CudaDevice), ("cpu", smartinf.CpuDevice)))
    assert_same_bits(gpu, cpu)
    assert np.any(bits(gpu[1][0]["exp_avg"]) != 0)


def run_steps(pipe, params, rng, sizes, steps, ons):
    """`steps` steps of random gradients (made on the host, then moved to each sub-group's
    GPU in `ons`, if any)."""
    for _ in range(steps):
        with pipe.step():
            futures = []
            for sg, n in enumerate(sizes):
                grad = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(params[sg].dtype)
                futures.append(pipe.update(sg, grad if ons[sg] is None else grad.to(ons[sg]), params[sg]))
            for f in futures:
                f.wait()


def train_resident(device, rule, dtype, on=None, steps=(7, 2), sizes=(12_345, 7_001),
                   **settings):
    """Sub-groups trained over `steps[0]` steps, the pipeline closed and reopened (states
    from storage), then `steps[1]` more; their params, states and residency."""
    rng = np.random.default_rng(0)
    params = [to_bf16(torch.from_numpy(rng.standard_normal(n).astype(np.float32))).to(dtype)
              for n in sizes]
    resident = []
    for run, count in enumerate(steps):
        pipe = smartinf.Pipeline(device, rule(), chunk=CHUNK, commit_every=3, **settings)
        for sg, n in enumerate(sizes):
            pipe.add_subgroup(n, params[sg].float().cpu())
            assert pipe.resumed(sg) == (run > 0)
        # `on` a GPU: the tensors of the sub-groups updated on it
        ons = [on if on is not None and pipe.gpu_of(sg) is not None else None
               for sg in range(len(sizes))]
        params = [p if o is None else p.to(o) for p, o in zip(params, ons)]
        run_steps(pipe, params, rng, sizes, count, ons)
        resident.append([pipe.resident(sg) for sg in range(len(sizes))])
        stats = pipe.stats
        pipe.close()
    pipe = smartinf.Pipeline(device, rule(), chunk=CHUNK, **settings)
    for sg, n in enumerate(sizes):
        pipe.add_subgroup(n, None)
    split = settings.get("master") == "split"  # its masters come back with their params
    states = [pipe.read_states(sg, params=params[sg].cpu()) if split else pipe.read_states(sg)
              for sg in range(len(sizes))]
    pipe.close()
    return [p.cpu() for p in params], states, resident, stats


# Both sub-groups resident with room for their twins (a durable commit written in the
# background while the next steps update the second copy), or only the first, without;
# or placed with their twins (twins=True): only the first.
BUDGETS = {"all": (8 << 20, False), "first": (200 << 10, False), "reserved": (400 << 10, True)}


# Where the GPU's budget is: its memory, or page-locked host memory whose states cross PCIe
# to it each update (CudaDevice(memory="host")).
MEMORIES = ("gpu", "host")


def budget_devices(disk_dir, budget, memory="gpu"):
    """The GPU with the budget, and the cpu device whose pipeline gets it, alike in twins."""
    size, twins = BUDGETS[budget]
    return (smartinf.CudaDevice(os.path.join(disk_dir, "gpu"), memory_budget=size, twins=twins,
                                memory=memory),
            smartinf.CpuDevice(os.path.join(disk_dir, "cpu"), twins=twins), size)


@needs_gpu
@pytest.mark.parametrize("rule", ["adamw", "lion", "sgd-nesterov"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("memory", MEMORIES)
def test_states_resident_in_gpu_memory_match_the_cpu_device_bit_for_bit(disk_dir, rule, dtype,
                                                                         budget, memory):
    """Commits every 3 steps (the resident states written at 3 and 6, the run closed at 7
    and reopened: the states of step 7 come from the working copies written at close),
    resumed from storage into GPU memory (or the GPU's host memory)."""
    gpu_device, cpu_device, size = budget_devices(disk_dir, budget, memory)
    gpu = train_resident(gpu_device, RULES[rule], dtype)
    cpu = train_resident(cpu_device, RULES[rule], dtype, memory_budget=size)
    assert gpu[2] == cpu[2]
    if rule == "adamw":  # 12 B/param: the second sub-group's states (or twins) do not fit
        assert cpu[2] == [[True, budget == "all"]] * 2
    assert_same_bits(gpu, cpu)


@needs_gpu
@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
@pytest.mark.parametrize("rule", ["adamw", "lion"])
@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("memory", MEMORIES)
def test_quantized_states_resident_in_gpu_memory_match_the_cpu_device(disk_dir, state_dtype, rule,
                                                                      budget, memory):
    gpu_device, cpu_device, size = budget_devices(disk_dir, budget, memory)
    gpu = train_resident(gpu_device, RULES[rule], torch.bfloat16, state_dtype=state_dtype)
    cpu = train_resident(cpu_device, RULES[rule], torch.bfloat16, memory_budget=size,
                         state_dtype=state_dtype)
    assert gpu[2] == cpu[2] and cpu[2][0][0]
    assert_same_bits(gpu, cpu)


@needs_gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("master", ["fp32", "split"])
def test_a_host_twin_changes_no_bit(disk_dir, state_dtype, master):
    """A budget holding the first sub-group without room for its twin, with a host twin
    (twins="host": durable commits copy the resident states to page-locked host memory and
    write them from there while the next steps update the resident copy): the same bits
    and residency as without one, through durable commits, a close and a resume."""
    size = BUDGETS["first"][0]
    runs = {}
    for twins in (False, "host"):
        device = smartinf.CudaDevice(os.path.join(disk_dir, f"gpu-{twins}"), memory_budget=size,
                                     twins=twins)
        runs[twins] = train_resident(device, RULES["adamw"], torch.bfloat16,
                                     state_dtype=state_dtype, master=master)
    assert runs["host"][2] == runs[False][2] and runs["host"][2][0][0]
    assert_same_bits(runs["host"], runs[False])


@needs_gpu
def test_cuda_tensors_are_read_and_written_in_place(disk_dir):
    """Gradients and params in the GPU's memory, states resident there: nothing crosses
    PCIe, and the bits are those of host buffers on the cpu device."""
    gpu = train_resident(smartinf.CudaDevice(os.path.join(disk_dir, "gpu"), memory_budget=8 << 20),
                         RULES["adamw"], torch.bfloat16, on="cuda")
    cpu = train_resident(smartinf.CpuDevice(os.path.join(disk_dir, "cpu")), RULES["adamw"],
                         torch.bfloat16)
    assert gpu[3]["host_to_device"] == gpu[3]["device_to_host"] == 0
    assert cpu[3]["host_to_device"] > 0
    assert_same_bits(gpu, cpu)


def placed_as_on_one_cpu_device(disk_dir, devices, sizes):
    """Sub-groups of `sizes` trained over `devices` (the GPU's tensors in place) and over one
    cpu device, across a reopen: the params bit for bit; where each went (its GPU, or None),
    each device's params, and the runs' residency."""
    mixed = train_resident(devices, RULES["adamw"], torch.bfloat16, on="cuda", sizes=sizes)
    one = train_resident(smartinf.CpuDevice(os.path.join(disk_dir, "one")), RULES["adamw"],
                         torch.bfloat16, sizes=sizes)
    for a, b in zip(mixed[0], one[0]):
        assert np.array_equal(bits(a), bits(b))
    pipe = smartinf.Pipeline(devices, smartinf.AdamW(), chunk=CHUNK)
    for n in sizes:
        pipe.add_subgroup(n, None)
    placed = [pipe.gpu_of(sg) for sg in range(len(sizes))], [d["numel"] for d in pipe.device_stats]
    pipe.close()
    return (*placed, mixed[2])


@needs_gpu
def test_sub_groups_fill_the_gpu_budget_first_and_reopen_where_they_are(disk_dir):
    # 12,345 + 7,001 params' states fit in 300 KiB, then 9,000 do not (streamed on the cpu
    # device), and 4,000 do
    devices = [smartinf.CudaDevice(os.path.join(disk_dir, "gpu"), memory_budget=300 << 10, twins=False),
               smartinf.CpuDevice(os.path.join(disk_dir, "cpu"))]
    gpus, numels, resident = placed_as_on_one_cpu_device(disk_dir, devices, (12_345, 7_001, 9_000, 4_000))
    assert gpus == [0, 0, None, 0] and numels == [12_345 + 7_001 + 4_000, 9_000]
    assert resident == [[True, True, False, True]] * 2


@needs_gpu
def test_the_gpus_memory_fills_first_then_its_host_memory_then_the_cores(disk_dir):
    """A GPU with a budget of its memory and one of host memory, before a cpu device: the
    sub-groups fill them in that order, the GPU updates both (its tensors in place), the
    rest stream on the host's cores; bit for bit one cpu device's, across a reopen. Small
    tensors' fp32 moments stay in host memory, as with a memory_budget."""
    # states of 148, 84, 108 and 48 KiB: the first in the GPU's memory, the second and the
    # fourth in its host memory, the third (too large for what is left) on the cores
    devices = [smartinf.CudaDevice(os.path.join(disk_dir, "gpu"), memory_budget=160 << 10, twins=False),
               smartinf.CudaDevice(os.path.join(disk_dir, "gpu-host"), memory_budget=140 << 10,
                                   memory="host"),
               smartinf.CpuDevice(os.path.join(disk_dir, "cpu"))]
    gpus, numels, resident = placed_as_on_one_cpu_device(disk_dir, devices, (12_345, 7_001, 9_000, 4_000))
    assert gpus == [0, 0, None, 0] and numels == [12_345, 7_001 + 4_000, 9_000]
    assert resident == [[True, True, False, True]] * 2
    host = smartinf.CudaDevice(os.path.join(disk_dir, "int8"), memory_budget=140 << 10, memory="host")
    pipe = smartinf.Pipeline(host, smartinf.AdamW(), chunk=CHUNK, state_dtype="int8",
                             small_sizes=[100])
    pipe.add_subgroup(100, None, small=True)
    assert pipe.resident(0) and pipe.gpu_of(0) is None
    pipe.close()


@pytest.mark.skipif(not cuda_built, reason="smartinf built without CUDA")
def test_a_host_memory_budget_beyond_the_machines_memory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"CudaDevice\(memory='host'\) budgets \(1125.9 TB\) holds 1125.9 TB of host memory"):
        smartinf.Pipeline(smartinf.CudaDevice(str(tmp_path), memory_budget=1 << 50, memory="host"),
                          smartinf.AdamW(), chunk=CHUNK)


def test_host_states_on_the_gpu_need_a_model_there(tmp_path):
    """smartinf.optim's gpu_host_states=True: the GPU the model is on updates the memory
    tier's states; refused clearly without one (no GPU here, or the model on the CPU)."""
    model = torch.nn.Linear(4, 4)
    for share in (True, 0.5):  # (all, or that share with the rest on the cores)
        with pytest.raises(ValueError, match="no CUDA GPU is visible here|params are on"):
            so.AdamW(model.parameters(), devices=str(tmp_path), memory_budget="1MiB",
                     gpu_host_states=share)
    with pytest.raises(ValueError, match=r"or a share from 0 to 1 \(.*\); got 'yes'"):
        so.AdamW(model.parameters(), devices=str(tmp_path), memory_budget="1MiB",
                 gpu_host_states="yes")


def test_a_gpus_memory_is_gpu_or_host(tmp_path):
    with pytest.raises(ValueError, match='memory must be "gpu"'):
        smartinf.CudaDevice(str(tmp_path), memory_budget=1 << 20, memory="ram")
    assert smartinf.CudaDevice(str(tmp_path), memory="host").twins is False


def _mlp_and_optim(path, **options):
    """A small MLP on the GPU and smartinf's AdamW over it (clipping acting)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).cuda()
    return model, so.AdamW(model.parameters(), lr=1e-2, devices=path, subgroup_size=10_000,
                           max_grad_norm=0.5, chunk=CHUNK, **options)


@needs_gpu
def test_optim_keeps_states_in_the_models_gpu_with_a_budget(disk_dir):
    """smartinf.optim with gpu_memory_budget: the GPU in front of the directory, the same
    bits as the states on the cpu device (clipping acting)."""
    def run(path, **options):
        model, opt = _mlp_and_optim(path, **options)
        data = torch.randn(6, 32, 64, generator=torch.Generator().manual_seed(1)).cuda()
        start = opt.pipeline.stats  # the states made from the params crossed
        for x in data:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        stats = {k: v - start.get(k, 0) for k, v in opt.pipeline.stats.items()}
        opt.close()
        return [p.detach().cpu() for p in model.parameters()], stats
    cpu, _ = run(os.path.join(disk_dir, "cpu"), gpu_memory_budget=0)
    # With overlap (the default) or without, the GPU's sub-groups are updated at step(),
    # where they are: nothing crosses PCIe.
    for overlap in (True, False):
        path = os.path.join(disk_dir, f"gpu-{overlap}")
        gpu, stats = run(path, gpu_memory_budget="4MiB", overlap=overlap)
        assert os.path.isfile(os.path.join(path, "gpu", "manifest"))
        assert stats["host_to_device"] == stats["device_to_host"] == 0
        for a, b in zip(gpu, cpu):
            assert np.array_equal(bits(a), bits(b))
    # A GPU budget for one sub-group, the memory tier's states updated by the GPU too: only
    # those states cross PCIe, alike each way; the directory keeps none in its memory
    path = os.path.join(disk_dir, "gpu-host")
    host, stats = run(path, gpu_memory_budget="64KiB", memory_budget="4MiB", gpu_host_states=True)
    assert os.path.isfile(os.path.join(path, "gpu-host", "manifest"))
    assert stats["host_to_device"] == stats["device_to_host"] > 0
    for a, b in zip(host, cpu):
        assert np.array_equal(bits(a), bits(b))


@needs_gpu
def test_optim_measures_an_auto_gpu_budget_at_its_first_step(disk_dir):
    """gpu_memory_budget="auto": nothing laid out until the first step, which sizes the budget
    from what its forward and backward left (planning/gpu_budget.measured) and opens the
    GPU's device in front of the directory; the same bits as the states on the cpu device."""
    def run(path, **options):
        model, opt = _mlp_and_optim(path, **options)
        laid_out_at_init = opt.pipeline is not None
        for x in torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1)).cuda():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        opt.close()
        return [p.detach().cpu() for p in model.parameters()], laid_out_at_init
    cpu, _ = run(os.path.join(disk_dir, "cpu"))
    path = os.path.join(disk_dir, "auto")
    gpu, laid_out_at_init = run(path, gpu_memory_budget="auto")
    assert not laid_out_at_init
    assert os.path.isfile(os.path.join(path, "gpu", "manifest"))
    for a, b in zip(gpu, cpu):
        assert np.array_equal(bits(a), bits(b))


@needs_gpu
def test_optim_cuts_larger_sub_groups_where_its_gpu_holds_every_state(disk_dir):
    """subgroup_size left out: sub-groups of subgroups.GPU_SIZE where the params' GPU holds
    every state (the default budget, "auto"), of HOST_SIZE where it holds none; the same
    params as torch's AdamW either way, with clipping acting and a ``.data`` edit between
    steps taken as the master."""
    from smartinf.optim import subgroups

    def run(path, **options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 1200)).cuda()
        opt = so.AdamW(model.parameters(), lr=1e-3, devices=[path], max_grad_norm=1.0, **options) \
            if path else torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i, x in enumerate(torch.randn(3, 8, 4096, generator=torch.Generator().manual_seed(2)).cuda()):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if not path:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if i == 1:
                model[0].weight.data.mul_(0.5)
        sizes = [sg.numel for sg in opt._plan] if path else None
        if path:
            opt.close()
        return [p.detach().cpu() for p in model.parameters()], sizes
    reference, _ = run(None)
    numel = sum(p.numel() for p in reference)
    assert subgroups.HOST_SIZE < numel <= subgroups.GPU_SIZE
    for path, options, sizes in ((os.path.join(disk_dir, "gpu"), {}, [numel]),
                                 (os.path.join(disk_dir, "host"), dict(gpu_memory_budget=0),
                                  [subgroups.HOST_SIZE, numel - subgroups.HOST_SIZE])):
        params, cut = run(path, **options)
        assert cut == sizes
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b)


def test_an_auto_gpu_budget_without_a_gpu_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match='gpu_memory_budget="auto" sizes a budget of the GPU'):
        so.AdamW(torch.nn.Linear(4, 4).parameters(), devices=[str(tmp_path)], gpu_memory_budget="auto")
    assert not os.listdir(tmp_path)


@needs_gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("memory", MEMORIES)
def test_a_split_master_resident_in_gpu_memory_matches_the_cpu_device(disk_dir, state_dtype,
                                                                      budget, memory):
    """A split master's low halves and moments resident in GPU memory (with their params'
    checksum, which the GPU's copy holds), commits every 3 steps, a reopen: bit for bit a
    cpu device's with the same budget in RAM (the params, the masters rebuilt from them)."""
    gpu_device, cpu_device, size = budget_devices(disk_dir, budget, memory)
    gpu = train_resident(gpu_device, RULES["adamw"], torch.bfloat16, master="split",
                         state_dtype=state_dtype)
    cpu = train_resident(cpu_device, RULES["adamw"], torch.bfloat16, memory_budget=size,
                         master="split", state_dtype=state_dtype)
    assert gpu[2] == cpu[2] and cpu[2][0][0]
    assert gpu[3]["foreign_chunks"] == cpu[3]["foreign_chunks"] == 0
    assert_same_bits(gpu, cpu)


@needs_gpu
def test_a_pipeline_with_a_gpu_takes_larger_chunks(disk_dir, monkeypatch):
    """Unset, a new pipeline with a CUDA device takes chunks of defaults.GPU_CHUNK (each chunk
    a GPU updates costs launches and waits besides its work)."""
    monkeypatch.delenv("SMARTINF_CHUNK", raising=False)
    pipe = smartinf.Pipeline([smartinf.CudaDevice(os.path.join(disk_dir, "gpu"), memory_budget=1 << 20),
                              smartinf.CpuDevice(os.path.join(disk_dir, "cpu"))], smartinf.AdamW())
    assert pipe.settings.chunk == smartinf.defaults.GPU_CHUNK
    pipe.close()


@needs_gpu
def test_cuda_tensors_go_only_to_their_gpus_sub_groups(disk_dir):
    pipe = smartinf.Pipeline(smartinf.CpuDevice(disk_dir), smartinf.AdamW(), chunk=CHUNK)
    pipe.add_subgroup(100, None)
    with pytest.raises(ValueError, match="grad is on cuda:0; pass a CPU"):
        pipe.update(0, torch.zeros(100, device="cuda"), torch.zeros(100))
    pipe.close()


@needs_gpu
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_the_gpu_checksum_of_params_is_the_hosts(offset):
    """A split master's params checksum hashed on the GPU (device/cuda_checksum.cu: a warp a
    32 KiB piece, its four groups of threads summing a block's stripes) is the host's, for
    lengths at the edges of XXH3's long path, of a block and of a piece, at 8-byte aligned
    addresses (offset 0) and not (1-3 params on)."""
    from smartinf import _native
    piece = 1 << 14
    g = torch.Generator().manual_seed(offset)
    host = torch.randint(-2**15, 2**15, (3 * piece + 4096 + offset,), dtype=torch.int16,
                         generator=g).view(torch.bfloat16)
    gpu = host.cuda()
    for numel in (1, 120, 121, 512, 513, 4096, piece - 1, piece, piece + 1, 2 * piece + 121,
                  3 * piece + 7, 3 * piece + 4096):
        expected = _native.params_checksum(host[offset:].data_ptr(), numel)
        assert _native.params_checksum(gpu[offset:].data_ptr(), numel, gpu=True) == expected, numel


@needs_gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("memory", MEMORIES)
def test_a_split_masters_params_in_gpu_memory_stay_there(disk_dir, state_dtype, memory):
    """A split master's params as CUDA tensors of the GPU that updates them (what the
    DeepSpeed integration passes for its GPU's sub-groups): read, checksummed
    (device/cuda_checksum.cu) and written there, nothing crosses PCIe but states in host
    memory, each way alike; commits every 3 steps and a reopen, bit for bit a cpu device's
    with host params, none taken as foreign."""
    gpu_device, cpu_device, size = budget_devices(disk_dir, "all", memory)
    gpu = train_resident(gpu_device, RULES["adamw"], torch.bfloat16, on="cuda", master="split",
                         state_dtype=state_dtype)
    cpu = train_resident(cpu_device, RULES["adamw"], torch.bfloat16, memory_budget=size,
                         master="split", state_dtype=state_dtype)
    assert gpu[3]["foreign_chunks"] == cpu[3]["foreign_chunks"] == 0
    assert gpu[3]["host_to_device"] == gpu[3]["device_to_host"]
    assert (gpu[3]["host_to_device"] > 0) == (memory == "host")
    assert_same_bits(gpu, cpu)


@needs_gpu
def test_a_split_masters_params_edited_in_gpu_memory_become_the_masters(disk_dir):
    """Params edited on the GPU between steps are told from the stored checksum as on the
    host: the edited chunk's params become its masters, the same bits as a cpu device's."""
    def run(device, on):
        rng = np.random.default_rng(3)
        sizes = (12_345,)
        params = [to_bf16(torch.from_numpy(rng.standard_normal(12_345).astype(np.float32)))]
        pipe = smartinf.Pipeline(device, smartinf.AdamW(lr=1e-2), chunk=CHUNK, master="split",
                                 memory_budget=None if on else 8 << 20)
        pipe.add_subgroup(12_345, params[0].float())
        params = [p.to(on) if on else p for p in params]
        run_steps(pipe, params, rng, sizes, 2, [on])
        params[0][CHUNK + 7] += 0.5  # the second chunk's params edited
        with pytest.warns(smartinf.ParamsChangedWarning):
            run_steps(pipe, params, rng, sizes, 2, [on])
        foreign = pipe.stats["foreign_chunks"]
        states = pipe.read_states(0, params=params[0].cpu())
        pipe.close()
        return [params[0].cpu()], [states], foreign
    gpu = run(smartinf.CudaDevice(os.path.join(disk_dir, "gpu"), memory_budget=8 << 20), "cuda")
    cpu = run(smartinf.CpuDevice(os.path.join(disk_dir, "cpu")), None)
    assert gpu[2] == cpu[2] == 1
    assert_same_bits(gpu[:2], cpu[:2])


def test_a_host_memory_budget_needs_a_cpu_device(tmp_path):
    if not cuda_built:
        pytest.skip("smartinf built without CUDA")
    with pytest.raises(ValueError, match="memory_budget is host memory for cpu devices"):
        smartinf.Pipeline(smartinf.CudaDevice(tmp_path), smartinf.AdamW(), memory_budget=1 << 20)


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


def test_gpu_twins_need_a_gpu_budget(tmp_path):
    with pytest.raises(ValueError, match="gpu_twins is for the states a gpu_memory_budget keeps"):
        so.AdamW(torch.nn.Linear(4, 4).parameters(), devices=str(tmp_path), gpu_twins=True)
    with pytest.raises(TypeError, match='CudaDevice twins must be True or False, "host"'):
        smartinf.CudaDevice(tmp_path, twins="yes")


# A child that trains sub-groups resident in GPU memory with their twins (in the budget, or
# a host twin), a durable commit
# every 3 steps written in the background, until killed (spawned afresh, not forked: CUDA
# does not survive a fork).
KILL_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import smartinf, smartinf._native as native
from conftest import open_with_subgroups
from test_crash import ALL_STATES, CHUNK, RULE, SIZES, train_step
directory, point, after, host = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
if point != "none":
    native.arm_fault(point, "kill", after=after)
device = smartinf.CudaDevice(directory, memory_budget=(1 if host else 2) * ALL_STATES,
                             twins="host" if host else True)
with open_with_subgroups([device], RULE, SIZES, CHUNK, commit_every=3) as pipe:
    assert all(pipe.gpu_of(sg) == 0 for sg in range(len(SIZES)))
    print("training", flush=True)
    for step in range(pipe.step_count, pipe.step_count + 300):
        train_step(pipe, step)
"""


@needs_gpu
@pytest.mark.parametrize("host", [False, True], ids=["twins", "host-twin"])
def test_sigkill_during_a_gpus_background_commit_leaves_the_last_durable_one(tmp_path, host):
    """Killed at random moments and in the writes of a durable commit (io.write: with every
    state resident those are the commit's, written from the GPU's copy, or its host twin,
    in the background),
    a reopened GPU directory is at its last durable commit (a multiple of 3 steps), bit
    for bit an uninterrupted cpu device's states there, and training goes on from it."""
    from conftest import open_with_subgroups
    from test_crash import ALL_STATES, CHUNK, RULE, SIZES, snapshot, snapshot_at

    tests = os.path.dirname(os.path.abspath(__file__))
    directory = str(tmp_path / "gpu")
    rnd = random.Random(20261126)
    trials = [("none", 0)] * 6 + [("io.write", k) for k in (0, 2, 5, 9, 14, 20)]
    rnd.shuffle(trials)
    reference = open_with_subgroups([str(tmp_path / "reference")], RULE, SIZES, CHUNK)
    killed, base, by_point = 0, 0, {}
    for point, after in trials:
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, tests, directory, point,
                                  str(after), str(int(host))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        started = child.stdout.readline()  # past imports and CUDA's start
        if point == "none" and started == "training\n":
            time.sleep(rnd.uniform(0, 0.3))
            child.send_signal(signal.SIGKILL)
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        err = child.stderr.read()
        assert started == "training\n" or child.returncode == -signal.SIGKILL, err
        assert child.returncode in (0, -signal.SIGKILL), err
        if child.returncode == -signal.SIGKILL:
            killed += 1
            by_point[point] = by_point.get(point, 0) + 1
        device = smartinf.CudaDevice(directory, memory_budget=(1 if host else 2) * ALL_STATES,
                                     twins="host" if host else True)
        with open_with_subgroups([device], RULE, SIZES, CHUNK, commit_every=3) as pipe:
            step = pipe.step_count
            assert child.returncode == 0 or (step - base) % 3 == 0, \
                f"step {step} is not durable ({point}, {after})"
            if child.returncode == 0:  # its close() made its last step durable
                base = step
            for sg, (got, want) in enumerate(zip(snapshot(pipe), snapshot_at(reference, step))):
                assert np.array_equal(got, want), f"sub-group {sg} differs at step {step} ({point}, {after})"
    reference.close()
    print(f"\nGPU kills: {len(trials)} trials, {killed} killed ({by_point}); reached step {step}")
    assert by_point.get("io.write", 0) >= 4 and step > 3 * len(trials)
