"""Updates started during backward (overlap, smartinf/speculation.py): every step's params and
the final states bit for bit those of overlap=False, whatever turned out other than the
speculation assumed (an overflow, a loss scale or clipping that changed, another accumulation,
gradients edited between backward and step), and the updates that assumed rightly kept."""
import logging

import numpy as np
import pytest
import torch

import smartinf
import smartinf.optim as so
from smartinf.step.speculation import Speculation

SMALL = dict(subgroup_size=700, chunk=256)  # params split across sub-groups and chunks


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 9)).to(dtype)


def backward(model, step, micro=0, scale=1.0):
    torch.manual_seed(1000 * step + micro)
    p = next(model.parameters())
    x = torch.randn(16, 24, dtype=p.dtype).to(p.device)
    (model(x).float().pow(2).mean() * scale).backward()


def train(directory, overlap, steps=6, dtype=torch.float32, accumulate=lambda step: 1,
          loss_scale=lambda step: 1.0, edit=None, lr=lambda step: 1e-2, device="cpu", **kw):
    """Trains the model with real backward passes; the params after every step, the states
    at the end, and the pipeline's stats."""
    model = make_model(dtype).to(device)
    opt = so.AdamW(model.parameters(), lr=lr(0), devices=[str(directory)], overlap=overlap,
                   **SMALL, **kw)
    history = []
    for step in range(steps):
        for micro in range(accumulate(step)):
            backward(model, step, micro, loss_scale(step))
        if edit is not None:
            edit(model, opt, step)
        opt.step(grad_scale=1.0 / loss_scale(step))
        opt.zero_grad(set_to_none=True)
        for group in opt.param_groups:
            group["lr"] = lr(step + 1)  # as a scheduler: before the next backward
        history.append([p.detach().cpu().clone() for p in model.parameters()])
    states = opt.state_dict()["state"]
    stats = opt.pipeline.stats
    counts = opt._speculation.counts if opt._speculation is not None else None
    opt.close()
    return history, states, stats, counts


def assert_same(tmp_path, **kw):
    """overlap=True against overlap=False: the same bits after every step; the speculation's
    counts."""
    off = train(tmp_path / "off", False, **kw)
    on = train(tmp_path / "on", True, **kw)
    for step, (a, b) in enumerate(zip(off[0], on[0])):
        for i, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p, q), f"param {i} after step {step + 1}"
    for i in off[1]:
        for k in off[1][i]:
            assert torch.equal(torch.as_tensor(off[1][i][k]), torch.as_tensor(on[1][i][k])), (i, k)
    assert off[2]["speculative_updates"] == 0
    assert on[2]["speculative_updates"] == on[3].started
    assert on[2]["retracted_updates"] == on[3].retracted
    assert on[3].started == on[3].kept + on[3].retracted
    return on[3]


SUBGROUPS = 2  # 1369 params in sub-groups of 700


@pytest.mark.parametrize("kw", [dict(memory_budget=0), dict(memory_budget=0, commit_every=3),
                                dict(memory_budget="1MiB"),
                                dict(memory_budget="1MiB", commit_every=3)],
                         ids=["streamed", "streamed-k3", "resident", "resident-k3"])
def test_updates_during_backward_kept(tmp_path, kw):
    """Nothing other than assumed (the learning rate scheduled before each backward): from the
    second step on (the first adopts the model's weights) every update that could be retracted
    started during backward and was kept.
    Streamed sub-groups are retractable in the first step of a commit interval, resident ones
    where the budget holds their twin."""
    counts = assert_same(tmp_path, steps=7, lr=lambda s: 1e-2 * 0.9 ** s, **kw)
    assert counts.retracted == 0
    k = kw.get("commit_every", 1)
    if kw["memory_budget"]:  # each gets its twin at its first speculative update
        assert counts.kept == SUBGROUPS * 6
    else:
        assert counts.kept == SUBGROUPS * sum(1 for step in range(1, 7) if step % k == 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, dict(memory_budget="1MiB", commit_every=3),
                                dict(dtype=torch.bfloat16, master="split", state_dtype="int8",
                                     memory_budget="1MiB")],
                         ids=["streamed", "resident-k3", "bf16-split-int8"])
def test_gpu_params(tmp_path, kw):
    """Params and gradients on the GPU, their states on the host: gradients copied to host
    buffers during backward and the update launched once they landed (an event), params
    copied back at step()."""
    counts = assert_same(tmp_path, steps=7, device="cuda", gpu_memory_budget=0, **kw)
    assert counts.retracted == 0 and counts.kept == SUBGROUPS * 6


def test_resident_without_room_for_twins(tmp_path):
    """A budget that holds the states once: a resident sub-group's update cannot be retracted
    (it works in place), so none starts during backward; the same bits."""
    counts = assert_same(tmp_path, memory_budget="32KiB")
    assert counts.started == 0


def test_bf16_split_master_int8(tmp_path):
    counts = assert_same(tmp_path, dtype=torch.bfloat16, master="split", state_dtype="int8",
                         memory_budget="1MiB")
    assert counts.kept > 0 and counts.retracted == 0


def test_fp16_loss_scale_overflow_and_backoff(tmp_path):
    """fp16 params, manual loss scaling: step 3's scale overflows the fp16 gradients (inf):
    its speculative updates are retracted and the step skipped; the next step's scale
    differs from the one predicted (the step after an overflow is not speculated at all);
    then the updates are kept again."""
    scales = [1024.0, 1024.0, 1024.0, 1e30, 512.0, 512.0, 512.0]
    counts = assert_same(tmp_path, steps=7, dtype=torch.float16, loss_scale=lambda s: scales[s])
    assert counts.reasons == {"step skipped": SUBGROUPS}
    assert counts.kept == SUBGROUPS * 4  # steps 2, 3, 6 and 7

@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipping", "no-clipping"])
def test_clipping(tmp_path, max_norm):
    """With clipping active the scale differs every step: a step after a clipped one starts
    nothing during backward; without it every update is kept."""
    counts = assert_same(tmp_path, max_grad_norm=max_norm)
    if max_norm < 1:
        assert counts.started == 0
    else:
        assert counts.kept == SUBGROUPS * 5 and counts.retracted == 0


def test_accumulation_learned_and_changed(tmp_path):
    """Two backward passes per step (learned at the first step: updates start at the second
    pass), then one step of three: that step's updates are accumulated into again after they
    started, so they are retracted; the next step expects three and finds two."""
    micro = [2, 2, 2, 3, 2, 2, 2]
    counts = assert_same(tmp_path, steps=7, accumulate=lambda s: micro[s])
    assert counts.reasons == {"accumulated again": SUBGROUPS}
    assert counts.kept == SUBGROUPS * 4  # steps 2, 3, 6 and 7 (5 expected three passes)


def test_lr_changed_between_backward_and_step(tmp_path):
    """A learning rate set after backward (not before it, as schedulers are): the updates
    that assumed the old one are retracted."""
    def edit(model, opt, step):
        if step == 3:
            for group in opt.param_groups:
                group["lr"] = 5e-3
    counts = assert_same(tmp_path, edit=edit)
    assert counts.reasons == {"hyper-parameters": SUBGROUPS}
    assert counts.kept == SUBGROUPS * 4


def test_gradients_edited_in_place(tmp_path, caplog):
    """clip_grad_norm_ on the gradients between backward and step (instead of
    max_grad_norm=): the updates started during backward are redone with the clipped
    gradients, a warning says why, and updates wait for step() from then on."""
    def edit(model, opt, step):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
    with caplog.at_level(logging.WARNING, logger="smartinf"):
        counts = assert_same(tmp_path, edit=edit)
    assert counts.reasons == {"gradient changed": SUBGROUPS}
    assert counts.kept == 0
    assert "changed between backward and step()" in caplog.text


def test_states_read_between_backward_and_step(tmp_path):
    """state_dict() between backward and step retracts the started updates (it reads the
    states at the last step); step() then updates those sub-groups itself."""
    model, ref = make_model(), make_model()
    opt = so.AdamW(model.parameters(), lr=1e-2, devices=[str(tmp_path / "a")], **SMALL)
    ref_opt = so.AdamW(ref.parameters(), lr=1e-2, devices=[str(tmp_path / "b")], overlap=False,
                       **SMALL)
    for step in range(3):
        for m in (model, ref):
            backward(m, step)
        if step == 2:
            before = {i: {k: v.clone() for k, v in e.items() if isinstance(v, torch.Tensor)}
                      for i, e in opt.state_dict()["state"].items()}
            after_one = ref_opt.state_dict()["state"]
            for i in before:
                for k in before[i]:
                    assert torch.equal(before[i][k], after_one[i][k]), (i, k)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt._speculation.counts.reasons == {"step skipped": SUBGROUPS}
    opt.close()
    ref_opt.close()


def test_not_on_cpu_by_default(tmp_path, monkeypatch):
    """Where backward runs on the CPU, updates wait for step() unless
    SMARTINF_SPECULATE_ON_CPU=1 (backward holds the cores the update needs); a value other
    than 0/1 is refused."""
    monkeypatch.setenv("SMARTINF_SPECULATE_ON_CPU", "0")
    history, _, stats, counts = train(tmp_path / "on", True)
    assert counts is None and stats["speculative_updates"] == 0
    for a, b in zip(history, train(tmp_path / "off", False)[0]):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    monkeypatch.setenv("SMARTINF_SPECULATE_ON_CPU", "yes")
    with pytest.raises(ValueError, match="SMARTINF_SPECULATE_ON_CPU"):
        so.AdamW(make_model().parameters(), devices=[str(tmp_path / "refused")])


def test_kept_updates_are_handed_on_unfinished(tmp_path):
    """take(later=): each update that held goes to ``later`` as it is, not waited for (the
    DeepSpeed tail waits for it when the forward gathers its params), one that did not is
    retracted; ``unfinished`` counts those not done. The params are those of an update made
    after backward."""
    sizes = (3000, 2000)
    grads = [np.linspace(-1, 1, n, dtype=np.float32) for n in sizes]
    def run(speculate):
        with smartinf.Pipeline(str(tmp_path / str(speculate)), smartinf.AdamW(lr=1e-2)) as pipe:
            for n in sizes:
                pipe.add_subgroup(n, torch.full((n,), 0.5))
            outs = [torch.empty(n) for n in sizes]
            spec, handed = Speculation(pipe), {}
            spec.predict(1.0)
            with pipe.step():
                if speculate:
                    for sg in range(len(sizes)):
                        spec.start(sg, {}, outs[sg], lambda scale, sg=sg: pipe.update(
                            sg, grads[sg], outs[sg], grad_scale=scale, speculative=True))
                    assert 0 <= spec.unfinished() <= len(sizes)
                    # sub-group 1's learning rate changed before step(): retracted, redone
                    kept = spec.take(1.0, lambda sg: {} if sg == 0 else {"lr": 2e-2},
                                     later=lambda sg, launched: handed.update({sg: launched}))
                    assert list(kept) == list(handed) == [0] and kept[0] is outs[0]
                    assert spec.counts.retracted == 1 and spec.unfinished() == 0
                    handed[0].result().wait()
                    pipe.update(1, grads[1], outs[1], lr=2e-2).wait()
                else:
                    pipe.update(0, grads[0], outs[0]).wait()
                    pipe.update(1, grads[1], outs[1], lr=2e-2).wait()
            return outs
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_a_launch_that_failed_is_not_unfinished(tmp_path):
    """An update whose launch raised counts as done (asked from backward's hooks, which must
    go on), and take() raises its error."""
    with smartinf.Pipeline(str(tmp_path), smartinf.AdamW()) as pipe:
        spec = Speculation(pipe)
        spec.predict(1.0)
        def launch(scale):
            raise RuntimeError("no room for the update")
        spec.start(0, {}, torch.empty(1), launch)
        assert spec.unfinished() == 0
        with pytest.raises(RuntimeError, match="no room"):
            spec.take(1.0, lambda sg: {})
