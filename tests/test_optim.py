"""smartinf.optim against torch.optim on the same model and gradients."""
import errno
import hashlib
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import smartinf.optim as so
from smartinf.pipeline.compress import TopK, decompress
from conftest import assert_close_fp32

CASES = [
    (so.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (so.Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)),
    (so.SGD, torch.optim.SGD, dict(lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    (so.SGD, torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True)),
    (so.SGD, torch.optim.SGD, dict(lr=5e-2)),
    (so.Adagrad, torch.optim.Adagrad, dict(lr=1e-1, lr_decay=1e-2, weight_decay=1e-2,
                                           initial_accumulator_value=0.1)),
    # a rule added as a row (docs/torch.md, "Adding an update rule"): its class is torch's
    # signature over that row
    (so.Adamax, torch.optim.Adamax, dict(lr=2e-2, betas=(0.8, 0.95), weight_decay=1e-2)),
]
IDS = ["adamw", "adam", "sgd-momentum", "sgd-nesterov", "sgd-plain", "adagrad", "adamax"]
SMALL = dict(subgroup_size=700, chunk=256)  # params split across sub-groups and chunks


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 9)).to(dtype)


def groups(model, **second):
    """Two param groups: weights, and biases with their own hyper-parameters."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, **second}]


def reference_grads(model, step):
    """Gradients of a fixed loss at the reference model's params (fed to both sides)."""
    torch.manual_seed(100 + step)
    x = torch.randn(16, 24, dtype=next(model.parameters()).dtype)
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.to(p.dtype).clone()


def train_both(model, ours, reference, ref_opt, steps):
    """Steps ``ours`` and the torch optimizer on the reference model's gradients."""
    for step in steps:
        set_grads(model, reference_grads(reference, step))
        ours.step()
        ref_opt.step()


def adamw_pair(directory, steps=0, **kwargs):
    """smartinf.optim.AdamW and torch.optim.AdamW on two copies of the model, trained
    ``steps`` steps on the same gradients: (model, ours, reference model, torch's)."""
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[directory], **SMALL, **kwargs)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    train_both(a, oa, b, ob, range(steps))
    return a, oa, b, ob


def assert_models_close(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert_close_fp32(pa.detach().numpy(), pb.detach().numpy(), name)


@pytest.mark.parametrize("ours, theirs, kw", CASES, ids=IDS)
def test_matches_torch_with_groups_and_scheduler(disk_dir, ours, theirs, kw):
    a, b = make_model(), make_model()
    second = {"lr": kw["lr"] / 2, "weight_decay": 0.0}
    oa = ours(groups(a, **second), devices=[disk_dir], **SMALL, **kw)
    ob = theirs(groups(b, **second), **kw)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=5, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=5, gamma=0.5)
    assert len(oa._plan) > 2  # the layout really splits params
    for step in range(20):
        grads = reference_grads(b, step)
        set_grads(a, grads)
        oa.step()
        ob.step()
        sa.step()
        sb.step()
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]
    assert_models_close(a, b)
    assert oa.pipeline.step_count == 20
    oa.close()


def test_a_rule_row_is_a_torch_drop_in(disk_dir):
    """A rule with no class written in optim.py (Adamax) gets torch's signature from its row:
    hyper-parameters by position or keyword, torch's defaults in its param groups, torch's
    checks of them, and the storage options by keyword."""
    import inspect
    model = make_model()
    params = inspect.signature(so.Adamax).parameters
    assert list(params)[:5] == ["params", "lr", "betas", "eps", "weight_decay"]
    assert "devices" in params and "maximize" in params
    by_position = so.Adamax(model.parameters(), 1e-2, (0.8, 0.9), devices=[disk_dir + "/a"], **SMALL)
    by_name = so.Adamax(model.parameters(), lr=1e-2, betas=(0.8, 0.9), devices=[disk_dir + "/b"], **SMALL)
    reference = torch.optim.Adamax(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    assert by_position.defaults == by_name.defaults == reference.defaults
    assert by_position.param_groups[0]["eps"] == 1e-8
    with pytest.raises(ValueError, match="Invalid beta"):
        so.Adamax(model.parameters(), betas=(1.5, 0.9), devices=[disk_dir + "/c"])
    with pytest.raises(TypeError, match="takes 5 hyper-parameters by position"):
        so.Adamax(model.parameters(), 1e-2, (0.8, 0.9), 1e-8, 0.0, None, 7, devices=[disk_dir + "/d"])
    by_position.close()
    by_name.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_within_one_ulp(disk_dir, dtype):
    """An fp16/bf16 model: the fp32 master lives on storage; the model gets it rounded."""
    low, master = make_model(dtype), make_model(dtype).float()
    ours = so.AdamW(low.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    ref = torch.optim.AdamW(master.parameters(), lr=1e-2)
    for step in range(20):
        grads = reference_grads(low, step)  # fp16/bf16 gradients of the low-precision model
        set_grads(low, grads)
        set_grads(master, [g.float() for g in grads])
        ours.step()
        ref.step()
    for p, q in zip(low.parameters(), master.parameters()):
        expected = q.detach().to(dtype)
        ulp = (torch.nextafter(expected.abs().float().to(dtype), torch.tensor(math.inf, dtype=dtype))
               .float() - expected.abs().float())
        assert torch.all((p.float() - expected.float()).abs() <= ulp)
    ours.close()


@pytest.mark.parametrize("ours, theirs, kw", [CASES[0], CASES[2], CASES[5], CASES[6]],
                         ids=["adamw", "sgd", "adagrad", "adamax"])
def test_state_dict_round_trips_through_torch(disk_dir, tmp_path, ours, theirs, kw):
    a, b = make_model(), make_model()
    oa = ours(a.parameters(), devices=[disk_dir], **SMALL, **kw)
    for step in range(3):
        set_grads(a, reference_grads(b, step))
        oa.step()
    saved = oa.state_dict()
    b.load_state_dict(a.state_dict())
    ob = theirs(b.parameters(), **kw)
    ob.load_state_dict(saved)  # torch accepts our state_dict ...
    back = ob.state_dict()
    for key, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(back["state"][key][name], value), name
    assert [dict(g) for g in back["param_groups"]] == [dict(g) for g in saved["param_groups"]]
    # ... and ours accepts torch's: a fresh optimizer continues exactly like torch does.
    c = make_model()
    c.load_state_dict(a.state_dict())
    oc = ours(c.parameters(), devices=[str(tmp_path / "fresh")], **SMALL, **kw)
    oc.load_state_dict(back)
    train_both(c, oc, b, ob, range(3, 6))
    assert_models_close(c, b)
    oa.close()
    oc.close()


def states_digest(directory):
    with open(os.path.join(directory, "states.bin"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("compress", [None, TopK(0.1)], ids=["dense", "topk"])
def test_overflow_step_is_skipped_and_storage_untouched(disk_dir, compress):
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], compress=compress, **SMALL)
    set_grads(a, reference_grads(b, 0))
    oa.step()
    before = states_digest(disk_dir)
    params = [p.detach().clone() for p in a.parameters()]
    traffic = oa.traffic()
    grads = reference_grads(b, 1)
    grads[2][3, 4] = math.inf
    set_grads(a, grads)
    oa.step()
    assert oa.last_step_skipped and oa.skipped_steps == 1
    assert states_digest(disk_dir) == before
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), params))
    assert oa.traffic() == traffic and oa.pipeline.step_count == 1
    grads[2][3, 4] = math.nan
    set_grads(a, grads)
    oa.step()
    assert oa.skipped_steps == 2
    assert list(oa.last_step_phases) == ["open_and_drain_s", "norm_s", "edits_s", "take_s"]
    set_grads(a, reference_grads(b, 2))
    with torch.profiler.profile() as profiled:
        oa.step()
    assert not oa.last_step_skipped and oa.pipeline.step_count == 2
    # where step() went, phase by phase (a skipped step has no updates), and under
    # torch.profiler a marker where each phase ends
    assert list(oa.last_step_phases) == ["open_and_drain_s", "norm_s", "edits_s", "take_s",
                                         "updates_s"]
    assert all(s >= 0 for s in oa.last_step_phases.values())
    assert [e.name for e in profiled.events() if e.name.startswith("smartinf.")] == \
        ["smartinf." + k[:-2] for k in oa.last_step_phases]
    oa.close()


def test_clipping_matches_clip_grad_norm(disk_dir):
    a, b = make_model(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], max_grad_norm=0.05, **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(10):
        grads = reference_grads(b, step)
        set_grads(a, grads)
        oa.step()
        norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
        assert oa.last_grad_norm == pytest.approx(float(norm), rel=1e-6)
        ob.step()
    assert_models_close(a, b)
    oa.close()


@pytest.mark.parametrize("error_feedback", [False, True])
def test_topk_compression_equals_torch_on_the_kept_gradient(disk_dir, error_feedback):
    """Ours with top-k == torch AdamW fed decompress(compress(g)); the host link carries
    6 B per kept element, and clipping uses the dense gradients."""
    a, b = make_model(), make_model()
    ratio = 0.05
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], max_grad_norm=0.5,
                  compress=TopK(ratio, error_feedback=error_feedback), **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    reference = TopK(ratio, error_feedback=error_feedback)
    sizes = [sg.numel for sg in oa._plan]
    for step in range(8):
        grads = reference_grads(b, step)
        set_grads(a, grads)
        before = oa.traffic()["host_to_device"]
        oa.step()
        sent = oa.traffic()["host_to_device"] - before
        assert sent == sum(6 * reference.k(n) for n in sizes)
        # the reference: clip on dense grads, then the same top-k per sub-group
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = float(torch.clamp(0.5 / (norm + 1e-6), max=1.0))
        flat = torch.cat([g.reshape(-1) for g in grads]) * coef
        kept, start = [], 0
        for sg in oa._plan:
            kept.append(decompress(reference.compress(flat[start:start + sg.numel], key=sg.id)))
            start += sg.numel
        dense = torch.cat(kept)
        offset = 0
        for p in b.parameters():
            p.grad = dense[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        ob.step()
    assert_models_close(a, b)
    assert oa.compress.residual_bytes == (4 * sum(sizes) if error_feedback else 0)
    oa.close()


def test_reopening_resumes_training(disk_dir):
    a, oa, b, ob = adamw_pair(disk_dir, 4)
    oa.close()
    fresh = make_model()  # new weights: the stored master weights replace them
    with pytest.raises(ValueError, match="holds the states of an earlier run"):
        so.AdamW(fresh.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)  # resuming is a choice
    oc = so.AdamW(fresh.parameters(), lr=1e-2, devices=[disk_dir], if_exists="resume", **SMALL)
    assert_models_close(fresh, b)
    train_both(fresh, oc, b, ob, range(4, 8))
    assert_models_close(fresh, b)
    oc.close()


def test_resuming_without_subgroup_size_cuts_as_the_run_was_cut(disk_dir):
    """A run cut with another size (given, or an older default) resumes with subgroup_size
    left out: its directories' size is taken, and training goes on as torch's."""
    a, oa, b, ob = adamw_pair(disk_dir, 3)
    sizes = [sg.numel for sg in oa._plan]
    assert max(sizes) == SMALL["subgroup_size"] and len(sizes) > 1
    oa.close()
    fresh = make_model()
    oc = so.AdamW(fresh.parameters(), lr=1e-2, devices=[disk_dir], if_exists="resume",
                  chunk=SMALL["chunk"])
    assert [sg.numel for sg in oc._plan] == sizes
    assert_models_close(fresh, b)
    train_both(fresh, oc, b, ob, range(3, 6))
    assert_models_close(fresh, b)
    oc.close()
    fresh = make_model()  # overwritten: the default size again, one sub-group
    so.AdamW(fresh.parameters(), lr=1e-2, devices=[disk_dir], if_exists="overwrite").close()
    oc = so.AdamW(fresh.parameters(), lr=1e-2, devices=[disk_dir], if_exists="resume")
    assert [sg.numel for sg in oc._plan] == [sum(p.numel() for p in fresh.parameters())]
    oc.close()


def test_a_runs_size_is_read_from_every_directory_it_holds(tmp_path):
    """subgroups.stored_size: the largest sub-group of the devices' manifests and of the
    GPU's beside the first (gpu/, gpu-host/); None where none holds a run."""
    from smartinf.optim.subgroups import stored_size
    first, second = tmp_path / "a", tmp_path / "b"
    for d, numels in ((first / "gpu", [128, 64]), (first / "gpu-host", [128]), (second, [100])):
        d.mkdir(parents=True)
        (d / "manifest").write_text("smartinf-manifest 10\n" + "".join(
            f"sg {i} {n} 0 1 1 1 0\n" for i, n in enumerate(numels)))
    assert stored_size([str(first), str(second)]) == 128
    assert stored_size([str(second)]) == 100
    assert stored_size([str(tmp_path / "none")]) is None


def test_adagrad_initial_accumulator_value_is_one_for_all_groups(tmp_path):
    """The devices' sums start from one value: a group with another is refused, at
    construction and in add_param_group (DeepSpeed's param groups too: driver.stored_rule)."""
    model = make_model()
    with pytest.raises(ValueError, match="differ in initial_accumulator_value"):
        so.Adagrad(groups(model, initial_accumulator_value=0.5), devices=[str(tmp_path / "a")])
    opt = so.Adagrad(groups(model), initial_accumulator_value=0.1, devices=[str(tmp_path / "b")])
    with pytest.raises(ValueError, match=r"\(0.1 and 0.5\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))],
                             "initial_accumulator_value": 0.5})
    assert len(opt.param_groups) == 2
    opt.close()


def test_native_save_is_a_resumable_checkpoint(disk_dir, tmp_path):
    a, b = make_model(), make_model()
    oa = so.Adagrad(a.parameters(), lr=1e-1, devices=[disk_dir], **SMALL)
    ob = torch.optim.Adagrad(b.parameters(), lr=1e-1)
    train_both(a, oa, b, ob, range(3))
    dirs = oa.save(str(tmp_path / "ckpt"))
    set_grads(a, reference_grads(b, 99))
    oa.step()  # training goes on after the save; the checkpoint does not move
    oa.close()
    resumed_model = make_model()
    oc = so.Adagrad(resumed_model.parameters(), lr=1e-1, devices=dirs, if_exists="resume", **SMALL)
    assert oc.pipeline.step_count == 3
    train_both(resumed_model, oc, b, ob, range(3, 6))
    assert_models_close(resumed_model, b)
    with pytest.raises(FileExistsError, match="not empty"):
        oc.save(str(tmp_path / "ckpt"))
    oc.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_model_matches_cpu_reference(disk_dir):
    a, b = make_model().cuda(), make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(10):
        grads = reference_grads(b, step)
        set_grads(a, [g.cuda() for g in grads])
        oa.step()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close_fp32(pa.detach().cpu().numpy(), pb.detach().numpy(), "cuda param")
    oa.close()


def test_subgroups_without_grads_are_not_updated(disk_dir):
    """As torch skips params without .grad: their sub-group (here its own param group)
    is not sent, and weight decay does not touch it."""
    model = make_model()
    frozen = model[2].weight
    before = frozen.detach().clone()
    oa = so.AdamW([{"params": [model[0].weight]}, {"params": [frozen]}], lr=0.1,
                  weight_decay=0.5, devices=[disk_dir])
    model[0].weight.grad = torch.ones_like(model[0].weight)
    sent = oa.traffic()["host_to_device"]
    oa.step()
    assert torch.equal(frozen, before)
    assert not torch.equal(model[0].weight, make_model()[0].weight)
    assert oa.traffic()["host_to_device"] - sent == model[0].weight.numel() * 4
    oa.close()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"subgroup_size": 0}, ValueError, "subgroup_size"),
    ({"compress": 0.01}, TypeError, "TopK"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ({"lr": -1.0}, ValueError, "learning rate"),  # torch's own check
    ({"nesterov": True}, TypeError, "nesterov"),
])
def test_bad_settings(disk_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        so.AdamW(make_model().parameters(), devices=[disk_dir], **kwargs)


def test_bad_params_and_state_dicts(disk_dir, tmp_path):
    with pytest.raises(TypeError, match="torch.float64"):
        so.SGD([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], devices=[disk_dir])
    model = make_model()
    oa = so.AdamW(model.parameters(), devices=[str(tmp_path / "a")], **SMALL)
    set_grads(model, reference_grads(make_model(), 0))
    oa.step()
    digest = states_digest(str(tmp_path / "a"))
    good = oa.state_dict()
    with pytest.raises(ValueError, match="param groups"):
        oa.load_state_dict({"state": {}, "param_groups": good["param_groups"] * 2})
    wrong = {"state": {0: dict(good["state"][0], exp_avg=torch.zeros(5))},
             "param_groups": good["param_groups"]}
    with pytest.raises(ValueError, match="has 5 elements"):
        oa.load_state_dict(wrong)
    adam_groups = [dict(g, decoupled_weight_decay=False) for g in good["param_groups"]]
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        oa.load_state_dict({"state": good["state"], "param_groups": adam_groups})
    assert states_digest(str(tmp_path / "a")) == digest  # nothing half-loaded
    assert oa.pipeline.step_count == 1
    oa.close()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def test_state_dict_of_a_large_model_is_not_in_anonymous_memory(disk_dir, tmp_path):
    """8 M params: 64 MB of exported Adam states go to the page cache, not to RssAnon;
    torch.save writes them and torch.load(mmap=True) + load_state_dict reads them back."""
    params = [torch.nn.Parameter(torch.zeros(1 << 20)) for _ in range(8)]
    opt = so.AdamW(params, lr=1e-3, devices=[disk_dir], subgroup_size=3 << 20)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    opt.settle()  # (the step's own buffers are not the export's)
    # nor the staging its reads go through, made at their first use (a step that updates
    # the params in place makes none)
    for buffer in opt._driver.host_arrays(2 * opt._driver.staging.depth, 3 << 20):
        buffer.zero_()  # (its pages touched)
    before = _rss_anon()
    saved = opt.state_dict()
    grown = _rss_anon() - before
    assert grown < 16 << 20, f"state_dict grew anonymous memory by {grown / 2**20:.0f} MiB"
    assert all(torch.all(saved["state"][i]["exp_avg"] == 0.05) for i in range(8))
    assert [f for f in os.listdir(disk_dir) if f.startswith(".state_dict")] == []
    torch.save(saved, tmp_path / "opt.pt")
    del saved
    loaded = torch.load(tmp_path / "opt.pt", mmap=True)
    opt.load_state_dict(loaded)
    assert opt.pipeline.read_states(0)["exp_avg"][0] == np.float32(0.05)
    opt.close()


def test_bad_hyperparameter_in_a_later_group_changes_nothing(disk_dir):
    model = make_model()
    opt = so.AdamW(groups(model), lr=1e-2, devices=[disk_dir], **SMALL)
    set_grads(model, reference_grads(make_model(), 0))
    opt.step()
    digest = states_digest(disk_dir)
    params = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1]["lr"] = -1.0  # e.g. a broken scheduler
    with pytest.raises(ValueError, match="lr=-1.0"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert states_digest(disk_dir) == digest and opt.pipeline.step_count == 1
    opt.close()


def test_int8_states_export_decoded_and_load_coded(disk_dir, tmp_path, monkeypatch):
    """state_dict() of int8 states: torch-format fp32 moments, decoded; close to torch's
    own (the code's error of at most 1/16 per value, carried over a few steps); a fresh
    int8 optimizer loading it codes them again to the same bytes, so both continue
    identically."""
    monkeypatch.setenv("SMARTINF_SMALL_TENSOR", "0")  # small tensors: their moments quantised too
    a, b = make_model(), make_model()
    kw = dict(lr=1e-2, weight_decay=0.1)
    oa = so.AdamW(a.parameters(), devices=[disk_dir], state_dtype="int8", **SMALL, **kw)
    ob = torch.optim.AdamW(b.parameters(), **kw)
    for step in range(3):
        grads = reference_grads(b, step)
        set_grads(a, grads)
        set_grads(b, grads)
        oa.step()
        ob.step()
    saved, theirs = oa.state_dict(), ob.state_dict()
    for key, entry in saved["state"].items():
        assert entry["exp_avg"].dtype == torch.float32
        for name in ("exp_avg", "exp_avg_sq"):
            ref = theirs["state"][key][name]
            assert torch.linalg.vector_norm(entry[name] - ref) <= 0.1 * torch.linalg.vector_norm(ref), name
    c = make_model()
    c.load_state_dict(a.state_dict())
    oc = so.AdamW(c.parameters(), devices=[str(tmp_path / "fresh")], state_dtype="int8", **SMALL, **kw)
    oc.load_state_dict(saved)
    for step in range(3, 5):
        grads = reference_grads(b, step)
        set_grads(a, grads)
        set_grads(c, grads)
        oa.step()
        oc.step()
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)
    oa.close()
    oc.close()


# -- everyday inputs: what users pass that torch takes ------------------------------------
def test_frozen_params_are_left_alone_and_get_no_states(disk_dir):
    """PEFT / partial fine-tuning: requires_grad=False params are not touched by weight
    decay (torch skips them) and take no storage."""
    a, b = make_model(), make_model()
    for m in (a, b):
        m[0].weight.requires_grad_(False)
    frozen = a[0].weight.detach().clone()
    oa = so.AdamW(a.parameters(), lr=1e-2, weight_decay=0.5, devices=[disk_dir], **SMALL)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.5)
    assert sum(sg.numel for sg in oa._plan) == sum(p.numel() for p in a.parameters()) - 960
    train_both(a, oa, b, ob, range(4))
    assert torch.equal(a[0].weight, frozen)
    assert_models_close(a, b)
    assert set(oa.state_dict()["state"]) == set(ob.state_dict()["state"]) == {1, 2, 3}
    a[0].weight.requires_grad_(True)  # unfrozen after the optimizer was made: refused
    a[0].weight.grad = torch.ones_like(a[0].weight)
    with pytest.raises(ValueError, match="frozen .* when smartinf.optim.AdamW was created"):
        oa.step()
    assert torch.equal(a[0].weight, frozen)
    oa.close()


def test_add_param_group_trains_the_new_params_like_torch(disk_dir):
    a, b = make_model(), make_model()
    oa = so.AdamW(a[0].parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    ob = torch.optim.AdamW(b[0].parameters(), lr=1e-2)
    train_both(a, oa, b, ob, range(2))
    oa.add_param_group({"params": a[2].parameters(), "lr": 3e-2, "weight_decay": 0.2})
    ob.add_param_group({"params": b[2].parameters(), "lr": 3e-2, "weight_decay": 0.2})
    train_both(a, oa, b, ob, range(2, 5))
    assert_models_close(a, b)
    with pytest.raises(ValueError, match="more than one parameter group"):
        oa.add_param_group({"params": [a[0].weight]})  # torch's own check
    assert len(oa.param_groups) == 2
    oa.close()
    # Reopened with the same calls, every sub-group (the added ones too) resumes.
    c = make_model()
    oc = so.AdamW(c[0].parameters(), lr=1e-2, devices=[disk_dir], if_exists="resume", **SMALL)
    oc.add_param_group({"params": c[2].parameters(), "lr": 3e-2, "weight_decay": 0.2})
    assert_models_close(c, b)
    train_both(c, oc, b, ob, range(5, 7))
    assert_models_close(c, b)
    oc.close()


@pytest.mark.parametrize("clip", [None, 1e9], ids=["no-clip", "clip"])
@pytest.mark.parametrize("grad_scale", [1.0, 1 / 1024])
def test_fp16_gradients_with_a_norm_above_65504_are_a_step(disk_dir, grad_scale, clip):
    """Finite fp16 gradients whose norm overflows fp16 are not an overflow (the norm taken
    where clipping needs it; else checked for inf/NaN without one)."""
    p = torch.nn.Parameter(torch.zeros(20_000, dtype=torch.float16))
    ref = torch.nn.Parameter(torch.zeros(20_000))
    ours = so.SGD([p], lr=1e-4, devices=[disk_dir], chunk=4096, max_grad_norm=clip)
    theirs = torch.optim.SGD([ref], lr=1e-4)
    p.grad = torch.full_like(p, 1000.0)  # norm 1.4e5
    ref.grad = p.grad.float() * grad_scale
    ours.step(grad_scale=grad_scale)
    theirs.step()
    assert not ours.last_step_skipped and ours.skipped_steps == 0
    if clip is None:
        assert ours.last_grad_norm is None  # (no pass over the gradients for a norm)
    else:
        assert math.isclose(ours.last_grad_norm, 1000.0 * math.sqrt(20_000) * grad_scale, rel_tol=1e-4)
    assert torch.equal(p.detach(), ref.detach().half())
    p.grad[7] = math.inf  # a real overflow still skips
    ours.step(grad_scale=grad_scale)
    assert ours.last_step_skipped
    ours.close()


def test_state_dict_with_different_step_counts_in_a_subgroup_is_refused(disk_dir, tmp_path):
    """torch counts steps per param; a sub-group keeps one count: loading such a state
    would change the next update, so it is refused, and nothing is written."""
    b = make_model()
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(3):
        set_grads(b, reference_grads(b, step))
        if step == 2:
            b[2].bias.grad = None  # unused in this step: its count stays at 2
        ob.step()
    a = make_model()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], **SMALL)
    before = states_digest(disk_dir)
    with pytest.raises(ValueError, match=r"stepped \[2, 3\] times"):
        oa.load_state_dict(ob.state_dict())
    assert states_digest(disk_dir) == before and oa.pipeline.step_count == 0
    oa.close()


def test_a_failed_commit_keeps_the_step(disk_dir, caplog):
    """A durable commit that fails (a full disk at its sync) raises from step(), and nothing
    is undone: the step stands (params and states, like torch's), said so, and the next
    durable commit writes it."""
    import smartinf._native as native
    a, oa, b, ob = adamw_pair(disk_dir, 2, memory_budget=0, commit_every=1)  # (streamed, durable)
    set_grads(a, reference_grads(b, 2))
    native.arm_fault("store.synced", "error", errno=28)
    try:
        with pytest.raises(OSError) as e:
            oa.step()
    finally:
        native.disarm_fault()
    ob.step()
    assert e.value.errno == 28
    assert (oa.pipeline.step_count, oa.pipeline.durable_step_count) == (3, 2)
    assert "the steps stand, in memory, nothing undone (step 3; do not redo it)" in caplog.text
    assert_models_close(a, b)
    train_both(a, oa, b, ob, range(3, 5))  # training goes on; the next commit is durable
    assert oa.pipeline.durable_step_count == 5
    assert_models_close(a, b)
    oa.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_resident_states_and_a_commit_interval_match_torch_and_keep_a_failed_commits_steps(
        disk_dir, caplog, overlap):
    """memory_budget + commit_every=3 train like torch; a durable commit that fails undoes
    nothing: the steps since the last durable one stand in memory (said so), training goes
    on like torch, and the next durable commit writes them. With overlap the commit is
    written in the background and fails where it lands: here state_dict()."""
    import smartinf._native as native
    a, oa, b, ob = adamw_pair(disk_dir, 5, memory_budget="4MiB", commit_every=3, overlap=overlap)
    oa.pipeline.settle()
    assert (oa.pipeline.durable_step_count, oa.pipeline.step_count) == (3, 5)
    assert all(oa.pipeline.resident(i) for i in range(oa.pipeline.num_subgroups))
    assert_models_close(a, b)
    set_grads(a, reference_grads(b, 5))
    native.arm_fault("store.synced", "error", errno=5)
    try:
        with pytest.raises(OSError):
            oa.step()  # step 6: its durable commit fails
            assert overlap and oa.pipeline.commit_pending
            oa.state_dict()  # with overlap it lands here
    finally:
        native.disarm_fault()
    ob.step()
    assert (oa.pipeline.step_count, oa.pipeline.durable_step_count) == (6, 3)
    assert "nothing undone" in caplog.text
    assert_models_close(a, b)
    train_both(a, oa, b, ob, range(6, 9))
    oa.pipeline.settle()
    assert oa.pipeline.durable_step_count == 7  # (the commit after the failed one: due at once)
    assert_models_close(a, b)
    oa.close()


@pytest.mark.parametrize("every", [1, 10])
def test_an_exception_in_step_undoes_that_step_alone(disk_dir, caplog, every):
    """Steps before a failing one stay, whatever commit_every: one failing before any
    update (its closure raises) changes nothing; one failing after its first sub-group's
    update (a gradient the caller's code breaks mid-step) undoes that update where it read
    what the committed copy holds (commit_every=1), else keeps it, said so, one step ahead;
    the other sub-groups' params are torch's at step 3 either way, and training goes on."""
    a, oa, b, ob = adamw_pair(disk_dir, 3, commit_every=every)
    c, oc, d, od = adamw_pair(str(Path(disk_dir) / "ref4"), 4)  # torch's model at step 4
    with pytest.raises(ZeroDivisionError):
        oa.step(lambda: 1 / 0)
    assert oa.pipeline.step_count == 3
    assert_models_close(a, b)
    set_grads(a, reference_grads(b, 3))
    send, calls = oa._driver.send, []

    def failing(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("the caller's code broke mid-step")
        return send(*args, **kwargs)
    oa._driver.send = failing
    with pytest.raises(RuntimeError, match="mid-step"):
        oa.step()
    oa._driver.send = send
    assert oa.pipeline.step_count == 3 and oa.pipeline.durable_step_count in (0, 3)
    first = oa._plan[calls[0]]
    kept = "were updated in place over steps not yet durable" in caplog.text
    assert kept == (every == 10)
    for sg in oa._plan:
        for sl in sg.slices:
            want = d if sg is first and kept else b  # (torch at step 4, or at 3)
            j = next(j for j, q in enumerate(a.parameters()) if q is sl.param)
            got = sl.param.detach().reshape(-1)[sl.start:sl.stop]
            ref = list(want.parameters())[j].detach().reshape(-1)[sl.start:sl.stop]
            assert_close_fp32(got.numpy(), ref.numpy(), f"sub-group {sg.id}")
    if not kept:
        train_both(a, oa, b, ob, range(3, 6))  # the step redone: torch's from there
        assert_models_close(a, b)
    oa.close()


def test_state_dict_on_a_full_disk_raises_enospc(small_fs):
    from conftest import fill
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300)
    opt = so.AdamW(model.parameters(), devices=[small_fs], chunk=1 << 14)
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    filler = fill(small_fs)
    os.truncate(filler, os.path.getsize(filler) - (256 << 10))  # 256 KiB free
    # needed: two moments of 90,000 + 300 params, each a file of whole pages: 729.1 kB
    with pytest.raises(OSError) as e:
        opt.state_dict()
    assert e.value.errno == errno.ENOSPC
    # where it writes, what it needs and has, and what else to do: refused before any file
    assert e.value.filename == small_fs and f"unlinked files in {small_fs}" in str(e.value)
    assert re.search(r"needs 729\.1 kB there, [\d.]+ k?B free", str(e.value))  # (free: a non-root's)
    assert "opt.save(DIR)" in str(e.value)
    assert [f for f in os.listdir(small_fs) if f.startswith(".state_dict")] == []
    os.remove(filler)
    assert opt.state_dict()["state"][0]["step"] == 1
    opt.close()


def test_non_contiguous_params_match_torch(disk_dir):
    """Transposed and channels_last params are updated in torch's logical order."""
    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 5))
        m.to(memory_format=torch.channels_last)
        m[2].weight = torch.nn.Parameter(m[2].weight.detach().t().contiguous().t())
        return m
    a, b = model(), model()
    assert not a[0].weight.is_contiguous() and not a[2].weight.is_contiguous()
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[disk_dir], subgroup_size=500, chunk=256)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(2, 3, 8, 8)
        for m in (a, b):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        oa.step()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)  # torch's strided kernels round differently (FMA)
    assert not a[0].weight.is_contiguous()  # written in place, layout kept
    oa.close()


def test_sparse_gradients_as_torch(disk_dir, tmp_path):
    def embedding():
        torch.manual_seed(0)
        return torch.nn.Embedding(50, 4, sparse=True)
    for ours, theirs, kw in [(so.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                             (so.Adagrad, torch.optim.Adagrad, dict(lr=0.1))]:
        a, b = embedding(), embedding()
        oa = ours(a.parameters(), devices=[str(tmp_path / ours.__name__)], **kw)
        ob = theirs(b.parameters(), **kw)
        for step in range(3):
            for e, o in ((a, oa), (b, ob)):
                e.zero_grad()
                e(torch.tensor([step, 7, 7])).sum().backward()
                o.step()
        assert_close_fp32(a.weight.detach().numpy(), b.weight.detach().numpy(), ours.__name__)
        oa.close()
    e = embedding()
    opt = so.AdamW(e.parameters(), devices=[disk_dir])
    e(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        opt.step()
    opt.close()


def test_unusable_params_and_devices_are_refused_clearly(disk_dir, tmp_path):
    meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        so.AdamW(meta.parameters(), devices=[disk_dir])
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="appears twice"):
        so.AdamW([{"params": [p, p]}], devices=[disk_dir])
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        so.AdamW([p], devices=[str(a_file)])


def test_another_model_of_the_same_size_is_refused(disk_dir):
    """Same numbers of params, other shapes: the stored weights are not reinterpreted."""
    first = torch.nn.Parameter(torch.randn(40, 24))
    opt = so.AdamW([first], devices=[disk_dir])
    first.grad = torch.ones_like(first)
    opt.step()
    opt.close()
    with pytest.raises(ValueError, match="another parameter layout"):
        so.AdamW([torch.nn.Parameter(torch.randn(24, 40))], devices=[disk_dir], if_exists="resume")
    so.AdamW([torch.nn.Parameter(torch.randn(40, 24))], devices=[disk_dir], if_exists="resume").close()


def test_a_model_that_shrank_and_grew_back_is_refused(disk_dir):
    """Sub-groups left behind by a smaller model are stale once it committed a step."""
    def train(layers, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
        opt = so.AdamW(model.parameters(), devices=[disk_dir], subgroup_size=272, chunk=256,
                       if_exists="resume")
        for _ in range(steps):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
        opt.close()
    train(3, 2)
    train(2, 0)  # opened smaller without a step: the third layer's states stay current
    train(3, 1)
    train(2, 1)  # a step without the third layer: its states fall behind
    with pytest.raises(ValueError, match="stale"):
        train(3, 1)


# -- habits of framework users: re-running, resuming, Accelerate, DDP ---------------------
def test_if_exists_overwrite_starts_from_the_model(disk_dir):
    a, oa, b, ob = adamw_pair(disk_dir, 3)
    oa.close()
    c, d = make_model(), make_model()  # a re-run from scratch on the same directory
    oc = so.AdamW(c.parameters(), lr=1e-2, devices=[disk_dir], if_exists="overwrite", **SMALL)
    assert oc.pipeline.step_count == 0 and not oc.state_dict()["state"]
    assert_models_close(c, d)
    train_both(c, oc, d, torch.optim.AdamW(d.parameters(), lr=1e-2), range(3))
    assert_models_close(c, d)
    oc.close()


def test_weights_loaded_after_the_optimizer_was_made_are_not_overwritten(disk_dir):
    a, oa, b, ob = adamw_pair(disk_dir, 2)
    oa.close()
    c = make_model()
    oc = so.AdamW(c.parameters(), lr=1e-2, devices=[disk_dir], if_exists="resume", **SMALL)
    torch.manual_seed(5)
    other = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 9))
    c.load_state_dict(other.state_dict())  # e.g. a framework loading its checkpoint now
    ref = torch.optim.AdamW(other.parameters(), lr=1e-2)
    ref.load_state_dict(ob.state_dict())  # the stored moments stay; the weights are `other`'s
    train_both(c, oc, other, ref, range(2, 4))
    assert_models_close(c, other)
    oc.close()


def test_a_state_dict_of_another_step_after_resuming_is_refused(disk_dir):
    """Trainer-style resume with if_exists="resume": the directory's later weights went into
    the model, and the checkpoint's optimizer state is older: refused, not mixed."""
    a, oa, b, ob = adamw_pair(disk_dir, 2)
    older = oa.state_dict()
    train_both(a, oa, b, ob, range(2, 4))
    oa.close()
    c = make_model()
    oc = so.AdamW(c.parameters(), lr=1e-2, devices=[disk_dir], if_exists="resume", **SMALL)
    with pytest.raises(ValueError, match=r"if_exists='overwrite'"):
        oc.load_state_dict(older)
    oc.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_state_dict_resumes_low_precision_params_exactly(tmp_path, dtype):
    """The fp32 masters travel in the state_dict ("fp32_master", ignored by torch)."""
    def run(steps, model, opt):
        for step in steps:
            set_grads(model, reference_grads(model, step))
            opt.step()
    a = make_model(dtype)
    oa = so.AdamW(a.parameters(), lr=1e-2, devices=[str(tmp_path / "a")], **SMALL)
    run(range(3), a, oa)
    saved = oa.state_dict()
    assert saved["state"][0]["fp32_master"].dtype == torch.float32
    run(range(3, 6), a, oa)  # the uninterrupted run
    c = make_model(dtype)
    oc = so.AdamW(c.parameters(), lr=1e-2, devices=[str(tmp_path / "c")], **SMALL)
    run(range(3), c, oc)  # the same first three steps, then a save/load through torch.save
    weights = {k: v.clone() for k, v in c.state_dict().items()}
    torch.save(oc.state_dict(), tmp_path / "opt.pt")
    oc.close()
    d = make_model(dtype)
    d.load_state_dict(weights)
    od = so.AdamW(d.parameters(), lr=1e-2, devices=[str(tmp_path / "d")], **SMALL)
    od.load_state_dict(torch.load(tmp_path / "opt.pt"))
    run(range(3, 6), d, od)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), d.parameters()))
    torch.optim.AdamW(make_model(dtype).parameters()).load_state_dict(saved)  # torch takes it
    oa.close()
    od.close()


def test_accelerate_prepare_moves_no_state_bytes(disk_dir):
    accelerate = pytest.importorskip("accelerate")
    a, oa, b, ob = adamw_pair(disk_dir)
    accelerator = accelerate.Accelerator(cpu=True)
    before = oa.traffic()
    assert accelerator.prepare(oa).optimizer is oa  # state_dict + load_state_dict inside
    assert oa.traffic() == before  # before the first step: no state byte read or written
    train_both(a, oa, b, ob, range(2))
    before = oa.traffic()
    accelerator.prepare(oa)
    after = oa.traffic()  # its own export loaded back: read once, nothing written
    assert after["storage_write"] == before["storage_write"] and after["step"] == before["step"]
    oa.close()


def test_signature_environment_default_and_ignored_torch_options(tmp_path, monkeypatch, caplog):
    import inspect
    for cls in (so.AdamW, so.Adam, so.SGD, so.Adagrad):
        assert "devices" in inspect.signature(cls).parameters
    monkeypatch.setenv("SMARTINF_DEVICES", f"{tmp_path / 'x'}{os.pathsep}{tmp_path / 'y'}")
    model = make_model()
    with caplog.at_level("INFO", logger="smartinf"):
        opt = so.AdamW(model.parameters(), fused=True, foreach=True)  # what Trainer passes
    assert [d.path for d in opt.pipeline.devices] == [str(tmp_path / "x"), str(tmp_path / "y")]
    assert "fused=True ignored" in caplog.text
    opt.close()
    monkeypatch.delenv("SMARTINF_DEVICES")
    with pytest.raises(ValueError, match="SMARTINF_DEVICES"):
        so.AdamW(model.parameters())


def _ddp_rank(rank, directory, port):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    model = make_model()
    opt = so.AdamW(model.parameters(), devices=[directory])  # one spec for every rank
    assert opt.pipeline.devices[0].path == os.path.join(directory, f"rank{rank:05d}")
    labelled = so.SGD(make_model().parameters(), devices=[os.path.join(directory, "r{rank}")])
    assert labelled.pipeline.devices[0].path == os.path.join(directory, f"r{rank}")
    opt.close()
    labelled.close()
    torch.distributed.destroy_process_group()


def test_one_directory_spec_serves_every_ddp_rank(tmp_path):
    torch.multiprocessing.spawn(_ddp_rank, args=(str(tmp_path), 29400 + os.getpid() % 500), nprocs=2)


@pytest.mark.parametrize("ours, theirs, kw", CASES, ids=IDS)
def test_maximize_matches_torch(disk_dir, ours, theirs, kw):
    a, b = make_model(), make_model()
    oa = ours(a.parameters(), devices=[disk_dir], maximize=True, **SMALL, **kw)
    ob = theirs(b.parameters(), maximize=True, **kw)
    train_both(a, oa, b, ob, range(5))
    assert_models_close(a, b)
    oa.close()


@pytest.mark.parametrize("ours, theirs", [(so.AdamW, torch.optim.AdamW), (so.Adam, torch.optim.Adam)])
def test_amsgrad_matches_torch(disk_dir, tmp_path, ours, theirs):
    a, b = make_model(), make_model()  # weight decay: Adam's L2 term with AMSGrad too
    oa = ours(groups(a, lr=5e-3), lr=1e-2, weight_decay=0.05, amsgrad=True, devices=[disk_dir],
              **SMALL)
    ob = theirs(groups(b, lr=5e-3), lr=1e-2, weight_decay=0.05, amsgrad=True)
    train_both(a, oa, b, ob, range(6))
    assert_models_close(a, b)
    saved = oa.state_dict()  # the fourth array travels as torch's max_exp_avg_sq
    for key, entry in ob.state_dict()["state"].items():
        assert_close_fp32(saved["state"][key]["max_exp_avg_sq"].numpy(),
                          entry["max_exp_avg_sq"].numpy(), "max_exp_avg_sq")
    c = make_model()
    c.load_state_dict(a.state_dict())
    oc = ours(groups(c, lr=5e-3), lr=1e-2, weight_decay=0.05, amsgrad=True,
              devices=[str(tmp_path / "c")], **SMALL)
    oc.load_state_dict(ob.state_dict())
    train_both(c, oc, b, ob, range(6, 9))
    assert_models_close(c, b)
    with pytest.raises(ValueError, match="amsgrad differs"):
        oc.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "amsgrad": False})
    with pytest.raises(ValueError, match="keeps fp32 states"):
        ours(make_model().parameters(), amsgrad=True, devices=[str(tmp_path / "i8")], state_dtype="int8")
    oa.close()
    oc.close()


class ReferenceLion(torch.optim.Optimizer):
    """The paper's update (Chen et al. 2023, Algorithm 2) in plain torch, as the reference."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m * beta1 + p.grad * (1 - beta1)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def test_lion_matches_the_paper_reference(disk_dir, tmp_path):
    a, b = make_model(), make_model()
    second = {"lr": 5e-4, "weight_decay": 0.0}
    oa = so.Lion(groups(a, **second), lr=1e-3, weight_decay=0.1, devices=[disk_dir], **SMALL)
    ob = ReferenceLion(groups(b, **second), lr=1e-3, weight_decay=0.1)
    train_both(a, oa, b, ob, range(8))
    assert_models_close(a, b)
    saved = oa.state_dict()
    for key, entry in ob.state_dict()["state"].items():
        assert_close_fp32(saved["state"][key]["exp_avg"].numpy(), entry["exp_avg"].numpy(), "exp_avg")
    c = make_model()
    c.load_state_dict(a.state_dict())
    oc = so.Lion(groups(c, **second), lr=1e-3, weight_decay=0.1, devices=[str(tmp_path / "c")], **SMALL)
    oc.load_state_dict(saved)
    train_both(c, oc, b, ob, range(8, 11))
    assert_models_close(c, b)
    oa.close()
    oc.close()


def test_lion_moves_two_thirds_of_adams_storage_bytes(tmp_path):
    """One moment: 8 B/param of fp32 states read and written per step, against Adam's 12
    (streamed: no memory budget)."""
    read = {}
    for cls in (so.Lion, so.AdamW):
        p = torch.nn.Parameter(torch.randn(4 * 4096))
        opt = cls([p], devices=[str(tmp_path / cls.__name__)], chunk=4096, memory_budget=0)
        p.grad = torch.ones_like(p)
        before = opt.traffic()
        opt.step()
        after = opt.traffic()
        read[cls] = (after["storage_read"] - before["storage_read"],
                     after["storage_write"] - before["storage_write"])
        opt.close()
    assert read[so.Lion] == (8 * 4 * 4096, 8 * 4 * 4096)
    assert read[so.AdamW] == (12 * 4 * 4096, 12 * 4 * 4096)


# torch.optim.SGD in a process that runs torch's portable kernels (ATEN_CPU_CAPABILITY=default:
# the same code on every x86-64 CPU, one rounding per operation, no fused multiply-add).
TORCH_PORTABLE_SGD = """
import sys, torch
inputs = torch.load(sys.argv[1])
out = {}
for name, kw in inputs["cases"].items():
    p = torch.nn.Parameter(inputs["param"].clone())
    opt = torch.optim.SGD([p], **kw)
    for g in inputs["grads"]:
        p.grad = g.clone()
        opt.step()
    out[name] = p.detach()
out["capability"] = torch.backends.cpu.get_cpu_capability()
torch.save(out, sys.argv[2])
"""


def test_sgd_is_torch_bit_for_bit_where_torch_rounds_once_per_operation(disk_dir, tmp_path):
    """smartinf's kernels round every operation once, in torch's single-tensor order. Where
    torch does the same (its portable kernels) SGD is torch's bit for bit, in every variant.
    torch's vectorised kernels (AVX2, AVX-512) fuse multiply-adds and its sqrt of large
    tensors goes through MKL (not correctly rounded), so there Adam, Adagrad and SGD agree
    to ~2 ulps per step (docs/correctness.md, "How close to torch"; the other tests here)."""
    import subprocess
    import sys
    rng = np.random.default_rng(0)
    n = 1 << 16  # past torch's thresholds for vectorised and multi-threaded loops
    cases = {"plain": dict(lr=0.1), "weight-decay": dict(lr=0.1, weight_decay=0.01),
             "momentum": dict(lr=0.1, momentum=0.9, dampening=0.1),
             "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
             "maximize": dict(lr=0.1, momentum=0.5, maximize=True)}
    inputs = {"param": torch.from_numpy(rng.standard_normal(n, dtype=np.float32)),
              "grads": [torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 1e-2)
                        for _ in range(5)], "cases": cases}
    torch.save(inputs, tmp_path / "inputs.pt")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    subprocess.run([sys.executable, "-c", TORCH_PORTABLE_SGD, str(tmp_path / "inputs.pt"),
                    str(tmp_path / "torch.pt")], env=env, check=True)
    theirs = torch.load(tmp_path / "torch.pt")
    assert theirs["capability"] == "DEFAULT"
    for name, kw in cases.items():
        p = torch.nn.Parameter(inputs["param"].clone())
        opt = so.SGD([p], devices=[os.path.join(disk_dir, name)], **kw)
        for g in inputs["grads"]:
            p.grad = g.clone()
            opt.step()
        opt.close()
        assert torch.equal(p.detach().view(torch.int32), theirs[name].view(torch.int32)), name


@pytest.mark.parametrize("dtype, kw", [(torch.float32, {}),
                                       (torch.bfloat16, dict(master="split", state_dtype="int8"))],
                         ids=["fp32", "bf16-split-int8"])
def test_overlap_changes_no_bit(tmp_path, dtype, kw):
    """Resident states with room for twins and commit_every=2: with overlap (durable commits
    written in the background while the next steps update the twins) the params after every
    step and the states at the end equal overlap=False's, bit for bit; a reopen resumes them."""
    models, opts = [], []
    for overlap in (False, True):
        m = make_model(dtype)
        models.append(m)
        opts.append(so.AdamW(m.parameters(), lr=1e-2, devices=[str(tmp_path / str(overlap))],
                             memory_budget="1MiB", commit_every=2, overlap=overlap, **SMALL, **kw))
    grads_model = make_model(dtype)
    for step in range(7):
        grads = reference_grads(grads_model, step)
        for m, o in zip(models, opts):
            set_grads(m, grads)
            o.step()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q), f"step {step + 1}"
    assert opts[1].pipeline.stats["twin_copies"] > 0  # the twins were used
    states = [o.state_dict()["state"] for o in opts]
    for i in states[0]:
        for k in states[0][i]:
            assert torch.equal(torch.as_tensor(states[0][i][k]), torch.as_tensor(states[1][i][k])), (i, k)
    for o in opts:
        o.close()


def test_a_subgroups_params_put_and_gradients_gathered_whole_and_cut():
    """The put of a flat sub-group into the model (``subgroups.copy_into``: whole params as
    themselves, cut ones through their slices, one multi-tensor copy), the digest's parts
    (``held``) and the flat gradient (``gradients.flat``: a missing one as zeros) hold the
    elements ``read``/``write`` give, in logical order, for params cut across sub-groups."""
    from smartinf.optim import gradients, subgroups
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(3)),
              torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(2, 2))]
    plan = subgroups.plan_subgroups([{"params": params}], 30)
    assert any(s.stop - s.start != s.param.numel() for sg in plan for s in sg.slices)  # (cut)
    grads = {id(p): torch.randn_like(p) for p in params[:3]}  # (the last has none)
    for sg in plan:
        flat = torch.randn(sg.numel)
        subgroups.copy_into(sg, [s.param for s in sg.slices], flat)
        got = torch.cat([subgroups.read(s.param, s.start, s.stop) for s in sg.slices])
        assert torch.equal(got, flat)
        held = [subgroups.held(s.param, s.start, s.stop) for s in sg.slices]
        assert torch.equal(torch.cat([h.reshape(-1) for h in held]), flat)
        assert all(h is s.param for h, s in zip(held, sg.slices) if s.stop - s.start == s.param.numel())
        expected = torch.cat([grads[id(s.param)].reshape(-1)[s.start:s.stop] if id(s.param) in grads
                              else torch.zeros(s.stop - s.start) for s in sg.slices])
        assert torch.equal(gradients.flat(sg, grads), expected)
    assert all(not p.grad_fn and p.requires_grad for p in params)  # (written as leaves still)


@pytest.mark.parametrize("where", ["cpu", "cpu+cuda", "cuda"])
def test_the_gradients_norm_wherever_they_lie(where):
    """``gradients.total_norm`` over gradients on the host, on a GPU (two dtypes: two
    multi-tensor groups) or on both at once: the L2 norm of them all, on the host."""
    if "cuda" in where and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from smartinf.optim import gradients
    torch.manual_seed(0)
    grads = [torch.randn(n) for n in (5, 300, 1, 77)]
    grads[1] = grads[1].bfloat16()  # (a second dtype: a param dtype smartinf takes)
    expected = torch.linalg.vector_norm(torch.cat([g.double() for g in grads])).item()
    if where != "cpu":
        moved = [g.cuda() for g in grads]
        grads = moved if where == "cuda" else grads[:2] + moved[2:]
    got = gradients.total_norm(grads, torch.float32)
    assert got.device.type == "cpu"
    # fp32 sums of 383 squares, then roots: within n units of fp32 rounding
    assert got.item() == pytest.approx(expected, rel=383 * 2.0 ** -24)
