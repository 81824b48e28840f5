"""smartinf.optim's step finished while the next forward runs (optim/tail.py), forced on the CPU
(SMARTINF_STEP_TAIL_ON_CPU=1; on a GPU it is the default): every step's params and the final
states bit for bit those of overlap=False, with clipping acting, a skipped inf step, gradient
accumulation zeroed in place, and the params read or edited right after step() (a forward,
an EMA, ``.data``, ``state_dict``); each sub-group's update slowed here so that what reads its
params really waits. A step that fails in the background raises at the next use of its params,
the model's params back at the last commit."""
import sys
import threading
import time

import pytest
import torch

import smartinf.optim as so
from smartinf.optim import tail as tail_module

SMALL = dict(subgroup_size=300, chunk=128)  # five sub-groups


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 9))


def loss_of(model, step, micro=0, poison=False):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(16, 24, generator=g).to(next(model.parameters()).device)
    loss = model(x).pow(2).mean()
    return loss * float("inf") if poison else loss


def slowed(opt, seconds=0.02, fail_at=None, gate=None):
    """Each update sent later (on the step's thread), so that the caller's reads really wait;
    ``fail_at``: (step, sub-group) whose send raises; ``gate``: an Event the sends wait for."""
    send, calls = opt._driver.send, {"failed": False}

    def slow(sg, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
            if gate is not None:
                gate.wait()
        if fail_at == (opt.pipeline.step_count, sg) and not kwargs.get("speculative") \
                and not calls["failed"]:
            calls["failed"] = True
            raise OSError("the device went away")
        return send(sg, *args, **kwargs)
    opt._driver.send = slow


def train(tmp_path, name, overlap, steps=7, accumulate=2, reads=True, device="cpu", **kw):
    model, ema = make_model().to(device), make_model().to(device)
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path / name)], overlap=overlap,
                   max_grad_norm=0.05, **SMALL, **kw)
    history = []
    slowed_from = 0 if opt.pipeline is not None else 1  # (on a GPU: laid out by the first step)
    for step in range(steps):
        for micro in range(accumulate):
            loss_of(model, step, micro, poison=step == 3 and micro == 1).backward()
        if step == slowed_from:
            slowed(opt)
        opt.step()
        if reads:  # right after step(): an EMA of the params, an edit, the optimizer's states
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
            if step == 4:
                model[2].bias.data[0] = 0.25
            if step == 5:
                opt.state_dict()
        opt.zero_grad(set_to_none=False)  # zeroed in place: waits for the updates reading them
        history.append([p.detach().clone() for p in model.parameters()])
    states = opt.state_dict()["state"]
    tail = opt._tail
    opt.close()
    return history, states, [e.detach().clone() for e in ema.parameters()], tail


@pytest.fixture
def tail_on_cpu(monkeypatch):
    monkeypatch.setenv("SMARTINF_STEP_TAIL_ON_CPU", "1")
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:  # (a graph an earlier test made here keeps the steps in step())
        torch._dynamo.reset()
        utils.counters.clear()


def test_the_same_bits_as_a_step_that_waits(tmp_path, tail_on_cpu):
    on = train(tmp_path, "on", True)
    off = train(tmp_path, "off", False)
    assert off[3] is None and on[3] is not None
    for step, (a, b) in enumerate(zip(on[0], off[0]), 1):
        for i, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p, q), f"param {i} after step {step}"
    for i in off[1]:
        for k in off[1][i]:
            assert torch.equal(torch.as_tensor(on[1][i][k]), torch.as_tensor(off[1][i][k])), (i, k)
    for p, q in zip(on[2], off[2]):
        assert torch.equal(p, q)
    assert on[3].deferred == 5 * 6  # five sub-groups a step, the inf step skipped
    assert on[3].waits > 0  # the reads after step() found updates still running


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("placement", [
    {},  # the default there: every state in the GPU's memory, the GPU updating them
    dict(gpu_memory_budget=0),  # the host's cores update, params back through host buffers
    dict(gpu_memory_budget="10KiB", gpu_host_states=True, memory_budget="64KiB"),
], ids=["gpu-memory", "host", "gpu-and-host-memory"])
def test_on_a_gpu_the_same_bits_as_a_step_that_waits(tmp_path, placement):
    """On a GPU (the default there): the step's own CUDA stream, each sub-group's params on
    the GPU before its uses go on, the GPU updating states in its memory and in host memory,
    and the host's cores updating them."""
    on = train(tmp_path, "on", True, device="cuda", **placement)
    off = train(tmp_path, "off", False, device="cuda", **placement)
    # (every update the GPU's in its own memory: the step stays in step(), optim/tail.py)
    assert off[3] is None and on[3] is not None and (on[3].deferred > 0) == bool(placement)
    for step, (a, b) in enumerate(zip(on[0], off[0]), 1):
        for i, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p, q), f"param {i} after step {step}"
    for p, q in zip(on[2], off[2]):
        assert torch.equal(p, q)


def test_off_on_the_cpu_by_default(tmp_path):
    assert train(tmp_path, "default", True, steps=1, reads=False)[3] is None


def test_the_forward_reads_each_param_after_its_update(tmp_path, tail_on_cpu):
    """A forward right after step(): every op on a pending param (and its gradient) waited;
    none is pending once the step is done; metadata reads do not wait."""
    model = make_model()
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path)], **SMALL)
    gate = threading.Event()
    slowed(opt, seconds=0, gate=gate)
    loss_of(model, 0).backward()
    opt.step()
    first = model[0].weight
    assert type(first).__name__ == "PendingParameter" and first.shape == (40, 24)
    assert first.grad is not None and not opt._tail._events[0].is_set()  # (no wait)
    gate.set()
    loss_of(model, 1).backward()  # the next backward: the whole step done first
    assert not tail_module._PENDING
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert opt.pipeline.step_count == 1
    opt.close()


def test_a_step_failed_in_the_background_raises_at_the_next_use(tmp_path, tail_on_cpu):
    model = make_model()
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path)], commit_every=1,
                   max_grad_norm=1e-3, **SMALL)  # (clipped: no update starts during backward)
    slowed(opt, fail_at=(1, 3))  # the second step's fourth sub-group
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    committed = [p.detach().clone() for p in model.parameters()]
    loss_of(model, 1).backward()
    opt.step()
    with pytest.raises(OSError, match="the device went away"):  # (its forward, or backward)
        loss_of(model, 2).backward()
    opt.zero_grad()
    for p, q in zip(model.parameters(), committed):
        assert torch.equal(p, q)  # back at the last commit
    assert opt.pipeline.step_count == 1
    loss_of(model, 2).backward()
    opt.step()  # and it goes on
    opt.settle()
    assert opt.pipeline.step_count == 2
    opt.close()


@pytest.mark.parametrize("how", ["from the start", "after two steps"])
def test_a_compiled_forward_never_reads_a_pending_param(tmp_path, tail_on_cpu, how):
    """Compiled code reads the params' storage past any torch function: once torch.compile has
    made a graph the step finishes in step(), and a module compiled while a step runs waits
    for all of it first; the same bits as overlap=False."""
    import torch._dynamo.utils

    def run(name, overlap):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = make_model()
        opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path / name)],
                       overlap=overlap, max_grad_norm=0.05, **SMALL)
        slowed(opt)
        forward = torch.compile(model) if how == "from the start" else model
        losses = []
        for step in range(5):
            if step == 2 and how != "from the start":
                forward = torch.compile(model)
            loss = loss_of(forward, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return losses, params
    try:
        on, off = run("on", True), run("off", False)
    finally:  # (the graphs made would keep every later step of this process in step())
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    for a, b in zip(on[0] + on[1], off[0] + off[1]):
        assert torch.equal(a, b)


def test_copies_of_the_model_right_after_step_hold_its_result(tmp_path, tail_on_cpu):
    """deepcopy, model.state_dict() and torch.save right after step(): each waited for the
    params it copied, and holds plain Parameters."""
    import copy
    import io
    model = make_model()
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path)], **SMALL)
    slowed(opt, seconds=0.05)
    loss_of(model, 0).backward()
    opt.step()
    copied = copy.deepcopy(model)
    state = model.state_dict()
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    opt.settle()
    for name, p in model.named_parameters():
        for other in (dict(copied.named_parameters())[name], state[name],
                      dict(loaded.named_parameters())[name]):
            assert torch.equal(other, p) and type(other) in (torch.nn.Parameter, torch.Tensor)
    assert opt._tail.waits > 0
    opt.close()
