"""torch.amp's GradScaler loop and gradient edits between backward and step() (issue 60):
``smartinf.optim`` takes GradScaler's protocol for optimizers that unscale themselves
(``_step_supports_amp_scaling``), and an update started during backward is kept only where
the gradient's bits at ``step()`` are the ones it read (a digest, not the version counter
that ``GradScaler.unscale_`` and ``.data`` edits leave alone).

Each run trains a model with real backward passes (so updates start during backward, on the
CPU with SMARTINF_SPECULATE_ON_CPU=1 as conftest sets, and on a GPU where there is one) and
feeds the same scaled gradients to torch's optimizer under a GradScaler of its own: the
params after every step within the README's fp32 tolerance of torch's, the same loss-scale
sequence, and overlap on equal to overlap off bit for bit."""
import logging
import os

import pytest
import torch

import smartinf.optim as so
from conftest import assert_close_fp32

# 1369 params: two sub-groups, several chunks; their states on the host, where updates start
# during backward (a GPU's own states are updated at step(), where the gradients are)
SMALL = dict(subgroup_size=700, chunk=256, gpu_memory_budget=0)
SUBGROUPS = 2
STEPS = 8
OVERFLOW_STEP = 3  # its loss is scaled past fp32's range: inf gradients, a skipped step
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPTIMIZERS = {"adamw": (so.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
              "sgd-momentum": (so.SGD, torch.optim.SGD, dict(lr=5e-2, momentum=0.9))}


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 9)).to(device)


def scaled_backward(model, scaler, step, device, dtype):
    """A forward under autocast and the scaled loss's backward; the loss (unscaled)."""
    torch.manual_seed(1000 + step)
    x = torch.randn(16, 24).to(device)
    with torch.autocast(device, dtype=dtype):
        loss = model(x).float().pow(2).mean()
    if step == OVERFLOW_STEP:
        loss = loss * 1e38
    scaler.scale(loss).backward()
    return loss.detach()


def train(directory, device, dtype, name, unscale, overlap, edit=None, **kw):
    """Our optimizer over a model trained with GradScaler, and torch's over a copy fed the
    same scaled gradients under its own GradScaler: (our params after each step, torch's,
    our scales, torch's, the speculation's counts)."""
    ours_cls, torch_cls, hyper = OPTIMIZERS[name]
    model, ref = make_model(device), make_model(device)
    opt = ours_cls(model.parameters(), devices=[str(directory)], overlap=overlap, **hyper,
                   **SMALL, **kw)
    ref_opt = torch_cls(ref.parameters(), **hyper)
    scaler, ref_scaler = torch.amp.GradScaler(device), torch.amp.GradScaler(device)
    history = {"ours": [], "torch": [], "scale": [], "torch_scale": []}
    for step in range(STEPS):
        loss = scaled_backward(model, scaler, step, device, dtype)
        ref_scaler.scale(loss)  # (its scale made on first use, as in a real loop)
        if edit is not None:
            edit(model, step)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        for s, o, m in ((scaler, opt, model), (ref_scaler, ref_opt, ref)):
            if unscale:
                s.unscale_(o)
                if unscale == "clip":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-2)
            s.step(o)
            s.update()
            o.zero_grad(set_to_none=True)
        history["ours"].append([p.detach().cpu().clone() for p in model.parameters()])
        history["torch"].append([p.detach().cpu().clone() for p in ref.parameters()])
        history["scale"].append(scaler.get_scale())
        history["torch_scale"].append(ref_scaler.get_scale())
    counts = opt._speculation.counts if opt._speculation is not None else None
    assert opt.skipped_steps == 1 and not opt.last_step_skipped
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    opt.close()
    return history, counts


def assert_as_torch(history):
    assert history["scale"] == history["torch_scale"]
    assert history["scale"][OVERFLOW_STEP] < history["scale"][OVERFLOW_STEP - 1]  # backed off
    for step, (ours, theirs) in enumerate(zip(history["ours"], history["torch"])):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            assert_close_fp32(p.numpy(), q.numpy(), f"param {i} after step {step + 1}")


def assert_same_bits(a, b):
    for step, (x, y) in enumerate(zip(a["ours"], b["ours"])):
        for i, (p, q) in enumerate(zip(x, y)):
            assert torch.equal(p, q), f"param {i} after step {step + 1}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["streamed", "resident"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("unscale", [None, "unscale", "clip"],
                         ids=["scaler-step", "unscale_", "unscale_-clip"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_grad_scaler_loop(tmp_path, device, tier, name, unscale, dtype):
    """The AMP loop as torch documents it, with and without ``unscale_`` (and clipping):
    torch's params and scales, and the same bits with updates during backward as without.
    Without ``unscale_`` the updates started during backward are kept (all but the skipped
    step's and the step after it, whose scale backed off); ``unscale_`` divides the
    gradients in place, unseen by their version counters, so the digests retract them."""
    kw = dict(memory_budget="1MiB") if tier == "resident" else {}
    on, counts = train(tmp_path / "on", device, dtype, name, unscale, True, **kw)
    off, _ = train(tmp_path / "off", device, dtype, name, unscale, False, **kw)
    assert_as_torch(on)
    assert_same_bits(on, off)
    if unscale is None:
        assert set(counts.reasons) <= {"step skipped"}
        assert counts.kept == SUBGROUPS * (STEPS - 3)  # not 1 (adopts), 4 (skipped), 5 (after)
    else:
        assert counts.reasons.get("gradient changed") == SUBGROUPS
        assert counts.kept == 0  # updates wait for step() once a gradient changed


def _halve_through_data(model, step):
    for p in model.parameters():
        p.grad.data.mul_(0.5)  # .data: a tensor of its own version counter


def _halve_in_post_accumulate_hook(model):
    """A hook of the user's, registered after the optimizer's: it runs after an update
    started from the gradient it then edits."""
    def halve(p):
        p.grad.data.mul_(0.5)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(halve)


def _halve_under_no_grad(model, step):
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(0.5)


def _freeze_after_backward(model, step):
    """requires_grad_(False) between backward and step: torch still steps a param with a
    gradient, and so does smartinf (unfrozen before the next backward)."""
    model[0].weight.requires_grad_(False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit", [_halve_through_data, _halve_under_no_grad, "hook",
                                  _freeze_after_backward],
                         ids=["grad.data", "no_grad", "user-hook", "requires_grad_"])
def test_gradient_edited_between_backward_and_step(tmp_path, caplog, device, edit):
    """Gradients changed after backward where no version counter sees it (or one does):
    torch's result on the same edited gradients, and the same bits with updates during
    backward as without."""
    def run(directory, overlap):
        model, ref = make_model(device), make_model(device)
        opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(directory)], overlap=overlap,
                       **SMALL)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        if edit == "hook":
            _halve_in_post_accumulate_hook(model)
        ours, theirs = [], []
        for step in range(5):
            model[0].weight.requires_grad_(True)
            torch.manual_seed(step)
            model(torch.randn(16, 24).to(device)).pow(2).mean().backward()
            if callable(edit):
                edit(model, step)
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            ref_opt.step()
            for o in (opt, ref_opt):
                o.zero_grad(set_to_none=True)
            ours.append([p.detach().cpu().clone() for p in model.parameters()])
            theirs.append([p.detach().cpu().clone() for p in ref.parameters()])
        counts = opt._speculation.counts if opt._speculation is not None else None
        opt.close()
        return {"ours": ours, "torch": theirs}, counts
    with caplog.at_level(logging.WARNING, logger="smartinf"):
        on, counts = run(tmp_path / "on", True)
    off, _ = run(tmp_path / "off", False)
    for step, (x, y) in enumerate(zip(on["ours"], on["torch"])):
        for i, (p, q) in enumerate(zip(x, y)):
            assert_close_fp32(p.numpy(), q.numpy(), f"param {i} after step {step + 1}")
    assert_same_bits(on, off)
    if edit is _freeze_after_backward:
        assert not counts.reasons  # nothing about the gradient changed
    else:
        assert counts.reasons == {"gradient changed": SUBGROUPS}
        assert "changed between backward and step()" in caplog.text


def test_grad_scale_protocol_attributes_forgotten_after_a_failed_step(tmp_path):
    """A step that raises (here: a frozen param given a gradient) leaves no GradScaler
    attribute behind, which would multiply into the next scale."""
    model = make_model("cpu")
    model[0].bias.requires_grad_(False)
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path)], **SMALL)
    scaler = torch.amp.GradScaler("cpu")
    model[0].bias.requires_grad_(True)
    scaled_backward(model, scaler, 0, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="frozen"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    opt.close()


def _ddp_train(rank, directory, port, overlap, out):
    """One rank of DDP (gloo, world 2) training with GradScaler: each rank's batch its own,
    the gradients averaged by DDP's all-reduce, which lands after the optimizer's hooks
    started updates from the rank's own gradients."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(make_model("cpu"))
    ref = make_model("cpu")
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[directory], overlap=overlap, **SMALL)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for step in range(5):
        loss = scaled_backward(model, scaler, 10 * step + rank, "cpu", torch.bfloat16)
        ref_scaler.scale(loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()  # the averaged gradients
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
            o.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save({"ours": [p.detach().clone() for p in model.parameters()],
                    "torch": [p.detach().clone() for p in ref.parameters()],
                    "reasons": opt._speculation and opt._speculation.counts.reasons,
                    "kept": opt._speculation and opt._speculation.counts.kept}, out)
    opt.close()
    torch.distributed.destroy_process_group()


def test_ddp_all_reduce_after_the_hooks(tmp_path):
    """DDP replaces each gradient with the ranks' mean at the end of backward: the updates
    start from DDP's averaged gradients (its communication hook, optim/ddp.py), not the rank's
    own, and are kept; the run is torch's AdamW on the averaged gradients, the same bits as
    without updates during backward."""
    port = 29000 + os.getpid() % 400
    results = {}
    for overlap in (True, False):
        out = tmp_path / f"{overlap}.pt"
        torch.multiprocessing.spawn(_ddp_train, args=(str(tmp_path / str(overlap)), port + overlap,
                                                      overlap, str(out)), nprocs=2)
        results[overlap] = torch.load(out)
    on, off = results[True], results[False]
    for p, q, r in zip(on["ours"], off["ours"], on["torch"]):
        assert torch.equal(p, q)
        assert_close_fp32(p.numpy(), r.numpy(), "param")
    assert on["reasons"] == {} and on["kept"] >= SUBGROUPS * 3  # (steps 2-5: GradScaler's scale held)
